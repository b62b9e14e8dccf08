"""The csrc/ kernels against their pure-PyTorch oracle: bit equality over random shapes, dtypes and
slices; pack/unpack round trips; opcheck; and bad input refused before any byte is written.

Every test that takes ``device`` runs on the CPU here and in CI, and on the GPU as well on a
machine with one and a CUDA build of the kernels (the device machine): one suite for both."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import kernels
from runtime.kernels import reference
from runtime.kernels.paths import library_path
from tests.runtime.kernels.cases import (
    DTYPES,
    LARGE_PIECES,
    MANY_DIMS_PIECES,
    at_odd_address,
    large_slice_set,
    pieces,
    random_tensor,
    slice_sets,
)
from tests.support.services import in_ci

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available() or kernels.backend() != "compiled",
                reason="needs a GPU and the compiled kernels",
            ),
        ],
    ),
]
on_every_device = pytest.mark.parametrize("device", DEVICES)


def test_compiled_kernels_are_in_use_in_ci():
    """make install builds them; CI must exercise the compiled ops, not only the fallback."""
    if in_ci():
        assert kernels.backend() == "compiled"
    # Elsewhere: a built library is the one in use unless it is stale or will not load, and then
    # it is never silently passed over: the status says why (and nereus doctor with it).
    status = kernels.library_status()
    assert (kernels.backend() == "compiled") == (status.state == "compiled")
    assert (status.state == "not built") == (not library_path().exists())
    assert status.state in {"compiled", "not built"} or status.detail


@on_every_device
@settings(max_examples=60, deadline=None)
@given(pieces())
def test_checksum_matches_the_oracle_and_ignores_how_the_tensor_is_cut(device, case):
    shape, dtype, dim, cuts, seed = case
    whole = random_tensor(shape, dtype, seed, device)
    expected = reference.checksum(whole, shape, (0,) * len(shape))
    assert kernels.checksum(whole, shape, (0,) * len(shape)) == expected
    total = 0
    for start, stop in itertools.pairwise(cuts):
        offset = [0] * len(shape)
        offset[dim] = start
        part = whole.narrow(dim, start, stop - start)
        assert kernels.checksum(part, shape, offset) == reference.checksum(part, shape, offset)
        total += kernels.checksum(part, shape, offset)
    assert total & (2**64 - 1) == expected


@on_every_device
def test_checksum_sees_a_single_bit(device):
    x = torch.randn(100, 100, device=device)
    before = kernels.checksum(x, x.shape, (0, 0))
    x.view(torch.int32)[42, 7] ^= 1 << 3
    assert kernels.checksum(x, x.shape, (0, 0)) != before


@on_every_device
@settings(max_examples=60, deadline=None)
@given(slice_sets())
def test_pack_equals_oracle_and_unpack_round_trips(device, case):
    tensors, slices = case
    _round_trip([t.to(device) for t in tensors], slices)


def _round_trip(tensors, slices) -> list[torch.Tensor]:
    """Pack equals the oracle's; unpacked into zeros by either implementation, from the buffer
    and from a copy of it at an odd address, every slice comes back byte for byte."""
    packed = kernels.pack(tensors, slices)
    assert torch.equal(packed, reference.pack(tensors, slices))
    odd = torch.zeros(packed.numel() + 1, dtype=torch.uint8, device=packed.device)[1:]
    odd.copy_(packed)
    # pack into a buffer inside sentinel bytes: nothing around it is written
    guarded = torch.full((packed.numel() + 129,), 0xA5, dtype=torch.uint8, device=packed.device)
    kernels.pack(tensors, slices, out=guarded[65 : 65 + packed.numel()])
    assert torch.equal(guarded[65 : 65 + packed.numel()], packed)
    assert (guarded[:65] == 0xA5).all() and (guarded[65 + packed.numel() :] == 0xA5).all()
    for impl, buffer in itertools.product((kernels, reference), (packed, odd)):
        restored = [torch.zeros_like(t) for t in tensors]
        impl.unpack(buffer, restored, slices)
        for index, dim, start, length in slices.tolist():
            original = tensors[index].narrow(dim, start, length)
            assert torch.equal(
                restored[index].narrow(dim, start, length).view(torch.uint8),
                original.contiguous().view(torch.uint8),
            )
        # whole: nothing outside the slices was written
        oracle = [torch.zeros_like(t) for t in tensors]
        reference.unpack(packed, oracle, slices)
        for got, want in zip(restored, oracle, strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return restored


@on_every_device
@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_bad_input_is_refused_before_any_byte_is_written(impl, device):
    dest = [torch.zeros(4, 4, device=device), torch.zeros(3, device=device)]
    for slices, nbytes, message in [
        ([[0, 0, 0, 1], [1, 0, 2, 2]], 24, r"outside \[0, 3\)"),
        ([[0, 0, 0, 1], [2, 0, 0, 1]], 20, "names tensor 2 of 2"),
        ([[0, 0, 0, 1], [0, 0, 0, 1]], 32, "overlap in destination 0"),
        ([[0, 0, 0, 1], [0, 1, 1, 1]], 32, "overlap in destination 0"),
        ([[0, 2, 0, 1]], 16, "dim 2 outside a 2-d tensor"),
        ([[0, 0, 0, 2]], 24, "slices cover 32 bytes, the buffer holds 24"),
    ]:
        buffer = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
        with pytest.raises(RuntimeError, match=message):
            impl.unpack(buffer, dest, torch.tensor(slices, dtype=torch.int64))
        assert all(not t.any() for t in dest), message
    buffer = torch.zeros(12, dtype=torch.uint8, device=device)
    with pytest.raises(RuntimeError, match="buffer must be a contiguous 1-d uint8 tensor"):
        impl.unpack(buffer.float(), dest, torch.tensor([[1, 0, 0, 3]], dtype=torch.int64))
    with pytest.raises(RuntimeError, match="slices must be an int64 tensor"):
        impl.pack(dest, torch.tensor([[0, 0, 0]], dtype=torch.int64))
    with pytest.raises(RuntimeError, match="is not contiguous"):
        impl.pack(
            [torch.zeros(4, 4, device=device).t()], torch.tensor([[0, 0, 0, 1]], dtype=torch.int64)
        )
    with pytest.raises(RuntimeError, match=r"checksum: dim 0 slice \[3, 7\) outside \[0, 5\)"):
        impl.checksum(torch.zeros(4, device=device), (5,), (3,))


@on_every_device
@pytest.mark.skipif(kernels.backend() != "compiled", reason="opcheck needs the compiled ops")
def test_opcheck(device):
    tensors = [
        torch.randn(6, 5, device=device),
        torch.arange(12, dtype=torch.int32, device=device).view(3, 4),
    ]
    slices = torch.tensor([[0, 1, 1, 3], [1, 0, 1, 2]], dtype=torch.int64)
    torch.library.opcheck(
        torch.ops.nereus.pack.default,
        (tensors, slices),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    buffer = kernels.pack(tensors, slices)
    torch.library.opcheck(
        torch.ops.nereus.pack_into.default,
        (tensors, slices, torch.empty_like(buffer)),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    dest = [torch.zeros(6, 5, device=device), torch.zeros(3, 4, dtype=torch.int32, device=device)]
    torch.library.opcheck(
        torch.ops.nereus.unpack.default,
        (buffer, dest, slices),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    torch.library.opcheck(
        torch.ops.nereus.checksum.default,
        (tensors[0], [6, 5], [0, 0]),
        test_utils=("test_schema", "test_autograd_registration"),
    )


@on_every_device
@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_huge_offsets_and_aliased_destinations_are_refused(impl, device):
    """Found by review: start + length overflowed int64 in the C++ bounds check."""
    dest = torch.zeros(4, device=device)
    with pytest.raises(RuntimeError, match="outside"):
        impl.unpack(
            torch.zeros(4, dtype=torch.uint8, device=device),
            [dest],
            torch.tensor([[0, 0, 2**63 - 1, 1]]),
        )
    assert not dest.any()
    with pytest.raises(RuntimeError, match="outside"):
        impl.checksum(torch.zeros(4, device=device), (4,), (2**63 - 1,))
    shared = torch.zeros(8, device=device)
    with pytest.raises(RuntimeError, match="destinations 0 and 1 overlap in memory"):
        impl.unpack(
            torch.ones(36, dtype=torch.uint8, device=device),
            [shared[:5], shared[4:]],
            torch.tensor([[0, 0, 0, 5], [1, 0, 0, 4]]),
        )
    assert not shared.any()
    with pytest.raises(RuntimeError, match="checksum: global_shape has more than 2"):
        impl.checksum(torch.zeros(1, 1, device=device), (2**32, 2**32), (0, 0))


@on_every_device
@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_views_of_one_buffer_are_destinations_while_their_bytes_are_apart(impl, device):
    """A transition's new shards are views of one arena: unpack writes them all; only views
    that share bytes (or an output over a source) are refused."""
    arena = torch.zeros(12, device=device)
    views = [arena[:4].view(2, 2), arena[4:6], arena[6:]]
    buffer = torch.arange(48, dtype=torch.uint8, device=device)
    rows = torch.tensor([[0, 0, 0, 2], [1, 0, 0, 2], [2, 0, 0, 6]])
    impl.unpack(buffer, views, rows)
    assert torch.equal(arena.view(torch.uint8), buffer)
    empty = [torch.zeros(0, device=device), torch.zeros(0, device=device)]
    impl.unpack(torch.zeros(0, dtype=torch.uint8, device=device), empty, torch.zeros(0, 4).long())
    source = torch.arange(16, dtype=torch.uint8, device=device)

    def pack_into(sources, slices, out):
        return _pack_into(impl, sources, slices, out)

    with pytest.raises(RuntimeError, match="pack_into: out overlaps source 1 in memory"):
        pack_into(
            [torch.ones(4, dtype=torch.uint8, device=device), source[:8]],
            torch.tensor([[0, 0, 0, 4], [1, 0, 0, 8]]),
            source[4:],
        )
    # Sources that share bytes with each other are fine (they are only read); that pair must not
    # hide the one out shares with.
    wide = torch.arange(32, dtype=torch.uint8, device=device)
    rows = torch.tensor([[0, 0, 0, 4], [1, 0, 0, 8]])
    with pytest.raises(RuntimeError, match="pack_into: out overlaps source 1 in memory"):
        pack_into([wide[:4], wide[:8]], rows, wide[6:])
    assert torch.equal(wide, torch.arange(32, dtype=torch.uint8, device=device))
    packed = torch.zeros(12, dtype=torch.uint8, device=device)
    pack_into([wide[:4], wide[:8]], rows, packed)
    assert torch.equal(packed, torch.cat([wide[:4], wide[:8]]))


def test_zero_dimensional_tensors_pack_the_same_everywhere():
    scalars = [torch.tensor(3.5), torch.tensor(7, dtype=torch.int64)]
    for rows in ([[0, 0, 0, 1], [1, 0, 0, 1]], [[0, 0, 0, 0], [1, 0, 0, 1]]):
        slices = torch.tensor(rows, dtype=torch.int64)
        assert torch.equal(kernels.pack(scalars, slices), reference.pack(scalars, slices))


@pytest.mark.parametrize(("shape", "offset", "sizes"), LARGE_PIECES)
@on_every_device
def test_checksum_of_large_and_oddly_cut_pieces_matches_the_oracle(shape, offset, sizes, device):
    """Pieces big enough that the kernels split them into several tiles, and cut so that some
    dimensions merge and some locate rows: the arithmetic the CUDA kernel shares with the CPU."""
    whole = random_tensor(shape, torch.float32, 5, device)
    piece = whole[tuple(slice(o, o + n) for o, n in zip(offset, sizes, strict=True))]
    assert kernels.checksum(piece, shape, offset) == reference.checksum(piece, shape, offset)


@on_every_device
def test_pack_of_slices_larger_than_a_chunk_matches_the_oracle_and_round_trips(device):
    tensors, slices = large_slice_set(device)
    restored = _round_trip(tensors, slices)
    for index, dim, start, _ in slices.tolist():
        assert not restored[index].narrow(dim, 0, start).any()


@st.composite
def crowded_slices(draw):
    """Several slices per destination, along any dimension: some sets overlap, most do not. Each
    destination has its own dtype, so that slices of different element sizes follow each other
    in the buffer (a float32 slice at a byte offset that is not a multiple of 4)."""
    shapes = [
        tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        for _ in range(draw(st.integers(1, 3)))
    ]
    dtypes = [draw(st.sampled_from(DTYPES)) for _ in shapes]
    rows = []
    for index, shape in enumerate(shapes):
        dim = draw(st.integers(0, len(shape) - 1))
        cuts = sorted(draw(st.lists(st.integers(0, shape[dim]), min_size=2, max_size=5)))
        for start, stop in itertools.pairwise(cuts):
            rows.append([index, dim, start, stop - start])
        if draw(st.booleans()):  # one more, anywhere: it may overlap
            other = draw(st.integers(0, len(shape) - 1))
            start = draw(st.integers(0, shape[other]))
            rows.append([index, other, start, draw(st.integers(0, shape[other] - start))])
    rows = draw(st.permutations(rows))
    return shapes, dtypes, torch.tensor(rows, dtype=torch.int64).view(-1, 4)


@on_every_device
@settings(max_examples=80, deadline=None)
@given(crowded_slices())
def test_unpack_refuses_overlaps_exactly_where_the_oracle_does(device, case):
    """Both implementations refuse the same sets, naming the same pair of slices, and write the
    same bytes otherwise: with mixed dtypes, and from a buffer at an odd address too."""
    shapes, dtypes, slices = case
    sources = [
        random_tensor(shape, dtype, i, device)
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True))
    ]
    packed = reference.pack(sources, slices)
    odd = torch.zeros(packed.numel() + 1, dtype=torch.uint8, device=device)[1:]
    odd.copy_(packed)
    for buffer in (packed, odd):
        refused = {}
        results = {}
        for name, impl in (("kernels", kernels), ("reference", reference)):
            dest = [
                torch.zeros(shape, dtype=dtype, device=device)
                for shape, dtype in zip(shapes, dtypes, strict=True)
            ]
            try:
                impl.unpack(buffer, dest, slices)
            except RuntimeError as exc:
                assert "overlap in destination" in str(exc)
                assert all(not t.any() for t in dest), "a refused unpack wrote bytes"
                refused[name] = str(exc).splitlines()[0]
            else:
                refused[name] = None
            results[name] = dest
        assert refused["kernels"] == refused["reference"]
        for ours, theirs in zip(results["kernels"], results["reference"], strict=True):
            assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
        if refused["kernels"] is None:
            for index, dim, start, length in slices.tolist():
                assert torch.equal(
                    results["reference"][index].narrow(dim, start, length),
                    sources[index].narrow(dim, start, length),
                )


@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_overlapping_slices_are_named_alike(impl):
    """Found by review: the reference compared every pair of slices (O(n^2): 8,192 slices took
    seconds) and named the first pair by index; it now sorts as csrc/slices.h does, and names the
    pair the compiled op names."""
    dest = [torch.zeros(8)]
    rows = torch.tensor([[0, 0, 5, 1], [0, 0, 5, 1], [0, 0, 0, 1], [0, 0, 0, 1]])
    with pytest.raises(RuntimeError, match="unpack: slices 2 and 3 overlap in destination 0"):
        impl.unpack(torch.zeros(16, dtype=torch.uint8), dest, rows)
    assert not dest[0].any()
    # Thousands of slices, the overlapping pair last by start: found, and only that pair.
    n = 8192
    rows = torch.tensor([[0, 0, i, 1] for i in range(n)] + [[0, 0, n - 1, 1]])
    with pytest.raises(RuntimeError, match=f"unpack: slices {n - 1} and {n} overlap"):
        impl.unpack(torch.zeros(4 * (n + 1), dtype=torch.uint8), [torch.zeros(n)], rows)
    many = torch.zeros(n, 2)
    impl.unpack(
        torch.ones(8 * n, dtype=torch.uint8), [many], torch.tensor([[0, 0, i, 1] for i in range(n)])
    )
    assert torch.equal(many.view(torch.uint8), torch.ones(n, 8, dtype=torch.uint8))


def _pack_into(impl, sources, slices, out):
    if impl is reference:
        return reference.pack_into(sources, slices, out)
    return kernels.pack(sources, slices, out=out)


@on_every_device
@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_a_buffer_sharing_bytes_with_a_destination_is_refused_before_any_byte_is_written(
    impl, device
):
    """Found by review: unpack checked destinations against each other, not against the buffer
    (the compiled op copied overlapping ranges chunk by chunk, silently wrong; the reference
    raised after writing the slices before)."""
    arena = torch.arange(16, dtype=torch.uint8, device=device)
    first = torch.zeros(4, dtype=torch.uint8, device=device)
    rows = torch.tensor([[0, 0, 0, 4], [1, 0, 0, 8]])
    with pytest.raises(RuntimeError, match="unpack: buffer overlaps destination 1 in memory"):
        impl.unpack(arena[:12], [first, arena[2:10]], rows)
    assert not first.any()
    assert torch.equal(arena, torch.arange(16, dtype=torch.uint8, device=device))
    # A destination viewing the buffer's own bytes as another dtype.
    floats = torch.zeros(4, device=device)
    with pytest.raises(RuntimeError, match="unpack: buffer overlaps destination 0 in memory"):
        impl.unpack(floats.view(torch.uint8), [floats], torch.tensor([[0, 0, 0, 4]]))
    # More than a CPU chunk (1 MiB): the compiled op would have read bytes it had overwritten.
    mib = 1 << 20
    big = (torch.arange(3 * mib, device=device) % 251).to(torch.uint8)
    with pytest.raises(RuntimeError, match="unpack: buffer overlaps destination 0 in memory"):
        impl.unpack(big[: 2 * mib], [big[mib:]], torch.tensor([[0, 0, 0, 2 * mib]]))
    assert torch.equal(big, (torch.arange(3 * mib, device=device) % 251).to(torch.uint8))
    # Views of one arena beside the buffer's bytes, not over them, are written.
    impl.unpack(arena[:8], [arena[8:12], arena[12:]], torch.tensor([[0, 0, 0, 4], [1, 0, 0, 4]]))
    assert torch.equal(arena[8:], torch.arange(8, dtype=torch.uint8, device=device))


@on_every_device
@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_unpack_of_mixed_dtypes_from_any_byte_offset(impl, device):
    """Found by review: the reference viewed buffer bytes as the destination's dtype, which fails
    for a float32 slice at byte 3 (after a uint8 one) or a buffer at an odd address: it raised
    after writing the slices before."""
    sources = [
        torch.arange(3, dtype=torch.uint8, device=device),
        torch.tensor([1.5, 2.5], device=device),
        torch.tensor([[7, -9]], dtype=torch.int64, device=device),
    ]
    rows = torch.tensor([[0, 0, 0, 3], [1, 0, 0, 2], [2, 1, 0, 2]])
    packed = reference.pack(sources, rows)
    odd = torch.zeros(packed.numel() + 1, dtype=torch.uint8, device=device)[1:]
    odd.copy_(packed)
    for buffer in (packed, odd):
        dest = [torch.zeros_like(t) for t in sources]
        impl.unpack(buffer, dest, rows)
        assert all(torch.equal(d, t) for d, t in zip(dest, sources, strict=True))


@on_every_device
@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_unpack_and_pack_into_are_in_place_writes_for_autograd(impl, device):
    """Found by review: the compiled ops bumped no version counter (a backward that had saved a
    destination's old values ran on the new ones) and wrote into leaves that require grad."""
    rows = torch.tensor([[0, 0, 0, 4]])
    new = torch.full((16,), 0x40, dtype=torch.uint8, device=device)  # four floats of 3.0039
    weight = torch.ones(4, device=device, requires_grad=True)
    saved = torch.zeros(4, device=device)
    loss = (weight * saved).sum()  # saves `saved` for backward
    version = saved._version
    impl.unpack(new, [saved], rows)
    assert saved._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    out = torch.zeros(16, dtype=torch.uint8, device=device)
    version = out._version
    _pack_into(impl, [torch.ones(4, device=device)], rows, out)
    assert out._version > version
    # A destination that requires grad: refused, named, before any byte is written...
    plain = torch.zeros(4, device=device)
    leaf = torch.zeros(4, device=device, requires_grad=True)
    both = torch.tensor([[0, 0, 0, 4], [1, 0, 0, 4]])
    with pytest.raises(RuntimeError, match="unpack: destination 1 requires grad"):
        impl.unpack(torch.cat([new, new]), [plain, leaf], both)
    assert not plain.any() and not leaf.detach().any()
    with pytest.raises(RuntimeError, match="unpack: destination 0 requires grad"):
        impl.unpack(new, [leaf * 2], rows)
    # ... and written under torch.no_grad(), as loading weights into parameters does.
    with torch.no_grad():
        impl.unpack(torch.cat([new, new]), [plain, leaf], both)
    assert torch.equal(leaf.detach().view(torch.uint8), new)
    assert torch.equal(plain.view(torch.uint8), new)


@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_tensors_on_another_device_than_the_buffer_are_refused(impl):
    """Found by review: the reference (the fallback for a device the build has no kernels for,
    and for mixed devices) checked none, and copied across devices. 'meta' stands in for a second
    device here."""
    slices = torch.tensor([[0, 0, 0, 2], [1, 0, 0, 2]])
    here, there = torch.zeros(4, 2), torch.empty(4, 2, device="meta")
    message = r"{}: every tensor must be on the buffer's device \({}\), not {}"
    with pytest.raises(RuntimeError, match=message.format("unpack", "cpu", "meta")):
        impl.unpack(torch.full((32,), 7, dtype=torch.uint8), [here, there], slices)
    assert not here.any()
    with pytest.raises(RuntimeError, match=message.format("unpack", "meta", "cpu")):
        impl.unpack(torch.empty(32, dtype=torch.uint8, device="meta"), [there, here], slices)
    out = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=message.format("pack_into", "cpu", "meta")):
        _pack_into(impl, [torch.ones(4, 2), there], slices, out)
    assert not out.any()
    with pytest.raises(RuntimeError, match=message.format("pack", "cpu", "meta")):
        impl.pack([torch.ones(4, 2), there], slices)
    if impl is kernels and kernels.backend() == "compiled":  # the ops themselves, not only ours
        with pytest.raises(RuntimeError, match=message.format("unpack", "cpu", "meta")):
            torch.ops.nereus.unpack(torch.full((32,), 7, dtype=torch.uint8), [here, there], slices)
        with pytest.raises(RuntimeError, match=message.format("pack_into", "cpu", "meta")):
            torch.ops.nereus.pack_into([torch.ones(4, 2), there], slices, out)
        assert not here.any() and not out.any()


@on_every_device
@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_checksum_edge_cases_agree(impl, device):
    """Found by review: a global shape with a 0 extent after huge ones has no elements (the
    compiled op refused it as past 2**63), and an empty tensor of an unsupported element size is
    refused like a full one (the compiled op returned 0)."""
    assert impl.checksum(torch.zeros(1, 1, 0, device=device), (2**32, 2**32, 0), (0, 0, 0)) == 0
    with pytest.raises(RuntimeError, match="checksum: global_shape has more than 2"):
        impl.checksum(torch.zeros(1, 1, 1, device=device), (2**32, 2**32, 1), (0, 0, 0))
    for rows in (0, 3):
        with pytest.raises(RuntimeError, match="checksum: unsupported element size 16"):
            impl.checksum(
                torch.zeros(rows, 5, dtype=torch.complex128, device=device), (3, 5), (0, 0)
            )


@pytest.mark.parametrize(("shape", "offset", "sizes"), MANY_DIMS_PIECES)
@on_every_device
def test_checksum_of_pieces_cut_to_size_1_along_many_dimensions(shape, offset, sizes, device):
    """Found by review: each dimension of size 1 cut from a larger one opened a block of its own
    in csrc/geometry.h, so that past 16 of them the compiled op refused what the oracle accepts."""
    piece = random_tensor(sizes, torch.float32, 11, device)
    assert kernels.checksum(piece, shape, offset) == reference.checksum(piece, shape, offset)


@on_every_device
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.uint8])
def test_checksum_of_a_piece_at_an_odd_address(dtype, device):
    """Found by review: the kernels load each element as a word of its size, and a tensor may start
    at any byte of its storage: a sticky misaligned-address fault on the GPU, undefined behaviour
    on the CPU (where it happens to read right: test_cuda_emulated.py's UBSan case is the one that
    sees it there). Both backends now read an aligned copy."""
    piece = random_tensor((33, 7), dtype, 9, device)
    odd = at_odd_address(piece)
    shape, offset = (40, 7), (5, 0)
    expected = reference.checksum(piece, shape, offset)
    assert reference.checksum(odd, shape, offset) == expected
    assert kernels.checksum(odd, shape, offset) == expected
    assert kernels.checksum(odd[3:], shape, (8, 0)) == reference.checksum(piece[3:], shape, (8, 0))


@on_every_device
@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_an_empty_piece_of_a_global_shape_without_an_int64_stride(impl, device):
    """Found by review: [0, 2**40, 2**40] has no elements and a valid shape, but its strides
    overflow int64 (undefined behaviour in csrc/geometry.h, which test_cuda_emulated.py's UBSan
    case sees); an empty piece's checksum is 0 before any stride is computed."""
    piece = torch.zeros(0, 1, 1, device=device)
    assert impl.checksum(piece, (0, 2**40, 2**40), (0, 5, 5)) == 0


@on_every_device
@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_inference_tensors_are_written_only_in_inference_mode(impl, device):
    """Found by review: outside inference mode the compiled ops wrote into an inference tensor and
    then raised (bumping its version, which it has none of); the reference raised after writing
    too. Now both refuse before any byte is written; in inference mode they write."""
    rows = torch.tensor([[0, 0, 0, 4]])
    buffer = torch.full((16,), 7, dtype=torch.uint8, device=device)
    with torch.inference_mode():
        destination = torch.zeros(4, device=device)
        out = torch.zeros(16, dtype=torch.uint8, device=device)
    with pytest.raises(RuntimeError, match="unpack: destination 1 is an inference tensor"):
        impl.unpack(
            torch.cat([buffer, buffer]),
            [torch.zeros(4, device=device), destination],
            torch.tensor([[0, 0, 0, 4], [1, 0, 0, 4]]),
        )
    assert not destination.any()
    with pytest.raises(RuntimeError, match="pack_into: out is an inference tensor"):
        _pack_into(impl, [torch.ones(4, device=device)], rows, out)
    assert not out.any()
    with torch.inference_mode():
        impl.unpack(buffer, [destination], rows)
        _pack_into(impl, [torch.ones(4, device=device)], rows, out)
    assert torch.equal(destination.view(torch.uint8), buffer)
    assert torch.equal(out, torch.ones(4, device=device).view(torch.uint8))


@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_slices_on_a_third_device_are_refused_by_name(impl):
    """Found by review: slices on a GPU among CPU tensors chose the GPU kernel (the dispatcher
    goes by every tensor argument), which failed confusingly, or ran on CPU addresses. Slices must
    be on the CPU or on the buffer's device; 'meta' stands in for the other device here (the
    compiled ops' meta kernel unpacked nothing, silently). test_ops_gpu.py checks CUDA slices."""
    rows = torch.tensor([[0, 0, 0, 4]])
    message = r"{}: slices must be on the CPU or on the buffer's device \(cpu\), not meta"
    destination = torch.zeros(4)
    with pytest.raises(RuntimeError, match=message.format("unpack")):
        impl.unpack(torch.full((16,), 7, dtype=torch.uint8), [destination], rows.to("meta"))
    assert not destination.any()
    out = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=message.format("pack_into")):
        _pack_into(impl, [torch.ones(4)], rows.to("meta"), out)
    assert not out.any()
    with pytest.raises(RuntimeError, match=message.format("pack")):
        impl.pack([torch.ones(4)], rows.to("meta"))
    if impl is kernels and kernels.backend() == "compiled":  # the ops themselves, not only ours
        with pytest.raises(RuntimeError, match=message.format("unpack")):
            torch.ops.nereus.unpack(
                torch.full((16,), 7, dtype=torch.uint8), [destination], rows.to("meta")
            )
        assert not destination.any()


@on_every_device
@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_conjugate_and_negative_views_are_read_as_their_values(impl, device):
    """Found by review: the compiled ops read a conjugate or negative view's values (torch resolves
    their inputs), and the reference raised on them. Both now give the resolved tensor's bytes, and
    refuse to write into such a view (its bytes are not its values) before any byte is written."""
    complex_values = torch.randn(6, dtype=torch.complex64, device=device)
    real_values = torch.randn(2, 3, device=device)
    views = [complex_values.conj(), torch._neg_view(real_values)]
    assert all(v.is_conj() or v.is_neg() for v in views)
    for view in views:
        resolved = view.resolve_conj().resolve_neg()
        offset = (1,) * view.dim()
        shape = tuple(n + 1 for n in view.shape)
        assert impl.checksum(view, shape, offset) == reference.checksum(resolved, shape, offset)
    rows = torch.tensor([[0, 0, 1, 4], [1, 1, 0, 2]])
    expected = reference.pack([v.resolve_conj().resolve_neg() for v in views], rows)
    assert torch.equal(impl.pack(views, rows), expected)
    for index, view in enumerate(views):
        before = view.resolve_conj().resolve_neg()
        with pytest.raises(RuntimeError, match=f"unpack: destination {index} is a conjugate or"):
            impl.unpack(
                torch.zeros(8 * 6, dtype=torch.uint8, device=device),
                [v if v is view else v.resolve_conj().resolve_neg() for v in views],
                torch.tensor([[0, 0, 0, 6], [1, 0, 0, 2]]),
            )
        assert torch.equal(view.resolve_conj().resolve_neg(), before)
    out = torch._neg_view(torch.zeros(16, dtype=torch.uint8, device=device))
    with pytest.raises(RuntimeError, match="pack_into: out is a conjugate or negative view"):
        _pack_into(impl, [torch.ones(4, device=device)], torch.tensor([[0, 0, 0, 4]]), out)
    assert not out.any()


def test_the_reference_checksum_builds_its_indices_chunk_by_chunk(monkeypatch):
    """Found by review: the fallback built an int64 index for the whole piece before cutting it
    (16 bytes per byte of a uint8 tensor: a 64 MiB one took 1 GiB). Every index tensor it builds
    is now one chunk's at most, along the flat element range (a [1, n] piece is cut as well), and
    the values are those of one element at a time."""
    built = []

    def recording(function):
        def wrapper(*args, **kwargs):
            index = function(*args, **kwargs)
            built.append(index.numel())
            return index

        return wrapper

    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 1000)
    # global_indices built them all at once before the fix; _chunk_indices builds them now.
    for name in ("global_indices", "_chunk_indices"):
        if hasattr(reference, name):
            monkeypatch.setattr(reference, name, recording(getattr(reference, name)))
    for shape, offset, sizes, dtype in [
        ((1, 5000), (0, 0), (1, 5000), torch.uint8),
        ((9, 700), (2, 0), (6, 700), torch.float32),  # rows merged into one run of 4,200
        ((4, 9, 700), (1, 2, 50), (2, 6, 400), torch.bfloat16),  # cut along every dimension
    ]:
        piece = random_tensor(sizes, dtype, 4)
        built.clear()
        assert reference.checksum(piece, shape, offset) == _checksum_element_by_element(
            piece, shape, offset
        )
        assert built and max(built) <= 1000, built
        assert sum(built) == piece.numel()


def _checksum_element_by_element(piece, shape, offset) -> int:
    """The checksum's definition in Python integers, one element at a time (small pieces only)."""
    mask = (1 << 64) - 1

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    width = piece.element_size()
    bits = piece.contiguous().view(-1).view(torch.uint8).view(-1, width).tolist()
    total = 0
    for position, element in zip(itertools.product(*map(range, piece.shape)), bits, strict=True):
        index = 0
        for dim, (i, o) in enumerate(zip(position, offset, strict=True)):
            index = index * shape[dim] + i + o
        value = int.from_bytes(bytes(element), "little")
        total += mix(((index * 0x9E3779B97F4A7C15) & mask) ^ value)
    return total & mask
