"""The csrc/ kernels against their pure-PyTorch oracle: bit equality over random shapes, dtypes and
slices; pack/unpack round trips; opcheck; and bad input refused before any byte is written."""

import itertools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import kernels
from runtime.kernels import reference
from runtime.kernels.paths import library_path

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
]


def test_compiled_kernels_are_in_use_in_ci():
    """make install builds them; CI must exercise the compiled ops, not only the fallback."""
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        assert kernels.backend() == "compiled"
    # Elsewhere: a built library is always the one in use, never silently passed over.
    assert (kernels.backend() == "compiled") == library_path().exists()


def _tensor(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(
        -(2**30) if dtype != torch.uint8 else 0,
        2**30 if dtype != torch.uint8 else 255,
        shape,
        generator=gen,
        dtype=torch.int64,
    ).to(dtype)


@st.composite
def pieces(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    dim = draw(st.integers(0, len(shape) - 1))
    cuts = sorted(set(draw(st.lists(st.integers(0, shape[dim]), max_size=4))) | {0, shape[dim]})
    return shape, dtype, dim, cuts, draw(st.integers(0, 2**31))


@settings(max_examples=60, deadline=None)
@given(pieces())
def test_checksum_matches_the_oracle_and_ignores_how_the_tensor_is_cut(case):
    shape, dtype, dim, cuts, seed = case
    whole = _tensor(shape, dtype, seed)
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


def test_checksum_sees_a_single_bit():
    x = torch.randn(100, 100)
    before = kernels.checksum(x, x.shape, (0, 0))
    x.view(torch.int32)[42, 7] ^= 1 << 3
    assert kernels.checksum(x, x.shape, (0, 0)) != before


@st.composite
def slice_sets(draw):
    tensors = []
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
        tensors.append(_tensor(shape, draw(st.sampled_from(DTYPES)), i))
    rows = []
    for index, tensor in enumerate(tensors):
        dim = draw(st.integers(0, tensor.dim() - 1))
        start = draw(st.integers(0, tensor.shape[dim]))
        length = draw(st.integers(0, tensor.shape[dim] - start))
        rows.append([index, dim, start, length])
    return tensors, torch.tensor(rows, dtype=torch.int64)


@settings(max_examples=60, deadline=None)
@given(slice_sets())
def test_pack_equals_oracle_and_unpack_round_trips(case):
    tensors, slices = case
    packed = kernels.pack(tensors, slices)
    assert torch.equal(packed, reference.pack(tensors, slices))
    restored = [torch.zeros_like(t) for t in tensors]
    kernels.unpack(packed, restored, slices)
    for (index, dim, start, length), tensor in zip(slices.tolist(), restored, strict=True):
        original = tensors[index].narrow(dim, start, length)
        assert torch.equal(
            tensor.narrow(dim, start, length).view(torch.uint8),
            original.contiguous().view(torch.uint8),
        )


@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_bad_input_is_refused_before_any_byte_is_written(impl):
    dest = [torch.zeros(4, 4), torch.zeros(3)]
    for slices, nbytes, message in [
        ([[0, 0, 0, 1], [1, 0, 2, 2]], 24, r"outside \[0, 3\)"),
        ([[0, 0, 0, 1], [2, 0, 0, 1]], 20, "names tensor 2 of 2"),
        ([[0, 0, 0, 1], [0, 0, 0, 1]], 32, "overlap in destination 0"),
        ([[0, 0, 0, 1], [0, 1, 1, 1]], 32, "overlap in destination 0"),
        ([[0, 2, 0, 1]], 16, "dim 2 outside a 2-d tensor"),
        ([[0, 0, 0, 2]], 24, "slices cover 32 bytes, the buffer holds 24"),
    ]:
        buffer = torch.full((nbytes,), 7, dtype=torch.uint8)
        with pytest.raises(RuntimeError, match=message):
            impl.unpack(buffer, dest, torch.tensor(slices, dtype=torch.int64))
        assert all(not t.any() for t in dest), message
    buffer = torch.zeros(12, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="buffer must be a contiguous 1-d uint8 tensor"):
        impl.unpack(buffer.float(), dest, torch.tensor([[1, 0, 0, 3]], dtype=torch.int64))
    with pytest.raises(RuntimeError, match="slices must be an int64 tensor"):
        impl.pack(dest, torch.tensor([[0, 0, 0]], dtype=torch.int64))
    with pytest.raises(RuntimeError, match="is not contiguous"):
        impl.pack([torch.zeros(4, 4).t()], torch.tensor([[0, 0, 0, 1]], dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"checksum: dim 0 slice \[3, 7\) outside \[0, 5\)"):
        impl.checksum(torch.zeros(4), (5,), (3,))


@pytest.mark.skipif(kernels.backend() != "compiled", reason="opcheck needs the compiled ops")
def test_opcheck():
    tensors = [torch.randn(6, 5), torch.arange(12, dtype=torch.int32).view(3, 4)]
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
    dest = [torch.zeros(6, 5), torch.zeros(3, 4, dtype=torch.int32)]
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


@pytest.mark.parametrize("impl", [kernels, reference], ids=["dispatch", "reference"])
def test_huge_offsets_and_aliased_destinations_are_refused(impl):
    """Found by review: start + length overflowed int64 in the C++ bounds check."""
    dest = torch.zeros(4)
    with pytest.raises(RuntimeError, match="outside"):
        impl.unpack(torch.zeros(4, dtype=torch.uint8), [dest], torch.tensor([[0, 0, 2**63 - 1, 1]]))
    assert not dest.any()
    with pytest.raises(RuntimeError, match="outside"):
        impl.checksum(torch.zeros(4), (4,), (2**63 - 1,))
    shared = torch.zeros(8)
    with pytest.raises(RuntimeError, match="share storage"):
        impl.unpack(
            torch.ones(32, dtype=torch.uint8),
            [shared[:4], shared[4:]],
            torch.tensor([[0, 0, 0, 4], [1, 0, 0, 4]]),
        )
    assert not shared.any()


def test_zero_dimensional_tensors_pack_the_same_everywhere():
    scalars = [torch.tensor(3.5), torch.tensor(7, dtype=torch.int64)]
    for rows in ([[0, 0, 0, 1], [1, 0, 0, 1]], [[0, 0, 0, 0], [1, 0, 0, 1]]):
        slices = torch.tensor(rows, dtype=torch.int64)
        assert torch.equal(kernels.pack(scalars, slices), reference.pack(scalars, slices))
