"""The CUDA kernels' own source (csrc/cuda/kernels.cuh) run on the CPU against the oracle.

No GPU exists here, so emulate_cuda.cpp stands in for one: it compiles the kernels with g++, runs
each CUDA thread of a block as a std::thread (a std::barrier for __syncthreads) with the grid and
block sizes ops_cuda.cu launches, and UBSan reports any word the kernels touch at an address not
aligned to it, and any other undefined behaviour it sees (a signed overflow in geometry.h). This
checks the kernels' indexing, word widths and block reduction, not the GPU itself: test_ops.py's
cuda cases and benchmarks/device_kernels.sh do that on a GPU machine.
"""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from runtime.kernels import reference
from runtime.kernels.paths import CSRC
from tests.runtime.kernels.cases import (
    LARGE_PIECES,
    MANY_DIMS_PIECES,
    at_odd_address,
    large_slice_set,
    pieces,
    random_tensor,
    slice_sets,
)

SOURCE = Path(__file__).with_name("emulate_cuda.cpp")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    compiler = shutil.which("g++")
    assert compiler, "g++ is needed (make install builds the kernels with it too)"
    library = tmp_path_factory.mktemp("emulate_cuda") / "libemulate_cuda.so"
    headers = [SOURCE, CSRC / "geometry.h", CSRC / "cuda" / "kernels.cuh"]
    assert all(h.exists() for h in headers)
    subprocess.run(
        [
            compiler,
            "-std=c++20",
            "-O1",
            "-shared",
            "-fPIC",
            "-pthread",
            "-fsanitize=undefined",
            str(SOURCE),
            "-o",
            str(library),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    lib = ctypes.CDLL(str(library))
    lib.nereus_emulate_copy.restype = ctypes.c_int64
    lib.nereus_emulate_checksum.restype = ctypes.c_uint64
    lib.nereus_emulate_misaligned_canary.restype = None
    return lib


def _int64s(values):
    values = [int(v) for v in values]
    return (ctypes.c_int64 * max(1, len(values)))(*values)


def _copy(lib, pack: bool, tensors, slices, buffer) -> int:
    shapes = [list(t.shape) for t in tensors]
    return lib.nereus_emulate_copy(
        ctypes.c_int(int(pack)),
        ctypes.c_int64(len(tensors)),
        _int64s(t.data_ptr() for t in tensors),
        _int64s(len(s) for s in shapes),
        _int64s(v for s in shapes for v in s),
        _int64s(t.element_size() for t in tensors),
        ctypes.c_int64(slices.shape[0]),
        _int64s(slices.flatten().tolist()),
        ctypes.c_int64(buffer.data_ptr()),
    )


def _checksum(lib, piece, shape, offset) -> int:
    piece = piece.contiguous()
    return lib.nereus_emulate_checksum(
        ctypes.c_int64(piece.data_ptr()),
        ctypes.c_int64(piece.element_size()),
        ctypes.c_int64(piece.dim()),
        _int64s(piece.shape),
        _int64s(shape),
        _int64s(offset),
    )


SENTINEL = 0xA5
MARGIN = 64  # bytes of sentinel either side of a buffer: a word or a chunk's run past its end


def _guarded(nbytes: int, *, odd: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed buffer of ``nbytes`` inside a larger one of sentinel bytes (the buffer at an odd
    address when ``odd``: the kernels must fall back to narrower words); returns both."""
    whole = torch.full((nbytes + 2 * MARGIN + 1,), SENTINEL, dtype=torch.uint8)
    start = MARGIN + int(odd)
    buffer = whole[start : start + nbytes]
    buffer.zero_()
    return whole, buffer


def _untouched_outside(whole: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr() - whole.data_ptr()
    outside = torch.cat([whole[:start], whole[start + buffer.numel() :]])
    return bool((outside == SENTINEL).all())


def _round_trip(lib, tensors, slices, *, odd: bool = False):
    """Pack equals the oracle's and writes nothing around the buffer; unpacked into zeros, every
    tensor equals the oracle's unpack into zeros, whole (so no byte outside a slice was written)."""
    expected = reference.pack(tensors, slices)
    whole, buffer = _guarded(expected.numel(), odd=odd)
    _copy(lib, True, tensors, slices, buffer)
    assert torch.equal(buffer, expected)
    assert _untouched_outside(whole, buffer), "pack wrote outside its buffer"
    guarded = [_guarded(t.numel() * t.element_size()) for t in tensors]
    restored = [b.view(t.dtype).view(t.shape) for (_, b), t in zip(guarded, tensors, strict=True)]
    oracle = [torch.zeros_like(t) for t in tensors]
    _copy(lib, False, restored, slices, buffer)
    reference.unpack(expected, oracle, slices)
    for got, want, (whole_t, bytes_t) in zip(restored, oracle, guarded, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert _untouched_outside(whole_t, bytes_t), "unpack wrote outside its destination"


def test_the_alignment_check_is_live(emulator, capfd):
    """Without this, 'no report' below could mean no checking."""
    emulator.nereus_emulate_misaligned_canary()
    err = capfd.readouterr().err
    assert "misaligned address" in err and "type uint4" in err  # the emulator's own check
    assert "type 'volatile uint32_t'" in err or "type 'volatile unsigned int'" in err  # UBSan


# capfd collects stderr across the examples, which is what is wanted: no example may report.
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(slice_sets())
def test_emulated_pack_and_unpack_equal_the_oracle(emulator, capfd, case):
    tensors, slices = case
    for odd in (False, True):
        _round_trip(emulator, tensors, slices, odd=odd)
    assert "runtime error" not in capfd.readouterr().err


@settings(max_examples=40, deadline=None)
@given(pieces())
def test_emulated_checksum_equals_the_oracle(emulator, case):
    shape, dtype, dim, cuts, seed = case
    whole = random_tensor(shape, dtype, seed)
    origin = (0,) * len(shape)
    assert _checksum(emulator, whole, shape, origin) == reference.checksum(whole, shape, origin)
    part = whole.narrow(dim, cuts[0], cuts[-1] - cuts[0])
    offset = [0] * len(shape)
    offset[dim] = cuts[0]
    assert _checksum(emulator, part, shape, offset) == reference.checksum(part, shape, offset)


@pytest.mark.parametrize(("shape", "offset", "sizes"), LARGE_PIECES + MANY_DIMS_PIECES)
def test_emulated_checksum_of_large_and_oddly_cut_pieces(emulator, capfd, shape, offset, sizes):
    """MANY_DIMS_PIECES: found by review (a piece cut to size 1 along 18 dimensions was refused)."""
    piece = random_tensor(sizes, torch.float32, 5)
    assert _checksum(emulator, piece, shape, offset) == reference.checksum(piece, shape, offset)
    assert "runtime error" not in capfd.readouterr().err


def test_emulated_checksum_of_a_piece_at_an_odd_address(emulator, capfd):
    """Found by review: the kernel loads each element as a word of its size, and a tensor may
    start at any byte of its storage (a GPU faults, sticky, on such a load): the host copies the
    piece to an aligned buffer first."""
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        piece = at_odd_address(random_tensor((5, 7), dtype, 3))
        shape, offset = (9, 7), (2, 0)
        assert _checksum(emulator, piece, shape, offset) == reference.checksum(piece, shape, offset)
    assert "runtime error" not in capfd.readouterr().err


def test_emulated_checksum_of_an_empty_piece_of_a_huge_global_shape(emulator, capfd):
    """Found by review: [0, 2**40, 2**40] is a valid global shape (no elements), whose strides
    overflowed int64 in make_geometry (undefined behaviour, which UBSan reports)."""
    piece = torch.zeros(0, 1, 1)
    assert _checksum(emulator, piece, [0, 2**40, 2**40], [0, 5, 5]) == 0
    assert reference.checksum(piece, [0, 2**40, 2**40], [0, 5, 5]) == 0
    assert "runtime error" not in capfd.readouterr().err


def test_emulated_copy_of_slices_larger_than_a_chunk(emulator, capfd):
    tensors, slices = large_slice_set()
    nbytes = reference.pack(tensors, slices).numel()
    blocks = _copy(emulator, True, tensors, slices, torch.empty(nbytes, dtype=torch.uint8))
    assert blocks > len(slices), "every slice fitted one chunk: the chunking went untested"
    for odd in (False, True):
        _round_trip(emulator, tensors, slices, odd=odd)
    assert "runtime error" not in capfd.readouterr().err
