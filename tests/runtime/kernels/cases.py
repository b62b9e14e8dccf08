"""Random tensors and slice sets the kernel tests share (compiled, reference and emulated)."""

import torch
from hypothesis import strategies as st

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
]


def random_tensor(shape, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return (
        torch.randint(
            -(2**30) if dtype != torch.uint8 else 0,
            2**30 if dtype != torch.uint8 else 255,
            shape,
            generator=gen,
            dtype=torch.int64,
        )
        .to(dtype)
        .to(device)
    )


@st.composite
def pieces(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    dim = draw(st.integers(0, len(shape) - 1))
    cuts = sorted(set(draw(st.lists(st.integers(0, shape[dim]), max_size=4))) | {0, shape[dim]})
    return shape, dtype, dim, cuts, draw(st.integers(0, 2**31))


@st.composite
def slice_sets(draw):
    tensors = []
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
        tensors.append(random_tensor(shape, draw(st.sampled_from(DTYPES)), i))
    rows = []
    for index, tensor in enumerate(tensors):
        dim = draw(st.integers(0, tensor.dim() - 1))
        start = draw(st.integers(0, tensor.shape[dim]))
        length = draw(st.integers(0, tensor.shape[dim] - start))
        rows.append([index, dim, start, length])
    return tensors, torch.tensor(rows, dtype=torch.int64)


LARGE_PIECES = [
    # (global shape, offset, piece sizes): big enough that the kernels cut them into several
    # tiles, cut so that some dimensions merge and some locate rows
    ((300_000,), (0,), (300_000,)),  # one long row, cut into several tiles
    ((200_000, 3), (25_000, 1), (150_000, 2)),  # many short rows, tiles of whole rows
    ((4, 3, 140_000), (1, 1, 20_000), (2, 2, 100_000)),  # two row dimensions, long rows
    ((5, 6, 7, 8), (1, 0, 2, 0), (3, 6, 4, 8)),  # inner dimensions merged with cut ones
    # short rows whose length divides no block of threads: a thread's next element is further on
    # in its row or in a later one (3 columns; 300, more than a block's 256 threads)
    ((40_000, 7), (1_000, 2), (30_000, 3)),
    ((3_000, 1_000), (10, 100), (2_000, 300)),
]


def large_slice_set(device="cpu"):
    """Slices larger than a chunk (on the CPU and the GPU), and runs at odd offsets."""
    tensors = [
        random_tensor((600, 1024), torch.float32, 1, device),  # 2.4 MiB
        random_tensor((3, 400_000), torch.float32, 2, device),
        random_tensor((600, 1024), torch.bfloat16, 3, device),
        random_tensor((501, 77), torch.uint8, 4, device),  # odd rows: no run is aligned to a word
        random_tensor((300, 6), torch.float32, 5, device),
        random_tensor((100, 3), torch.float64, 6, device),
    ]
    slices = torch.tensor(
        [
            # runs of 16 bytes, 24 bytes apart (first, so that the buffer side is aligned): a
            # 16-byte word would fit the first run and no other
            [4, 1, 0, 4],
            [5, 1, 1, 2],  # 16 bytes from byte 8 of each 24
            [0, 0, 100, 400],  # one contiguous run of 1.6 MB
            [1, 1, 1000, 390_000],  # three runs of 1.56 MB
            [2, 1, 10, 890],  # 600 runs of 1,780 bytes, several runs per chunk
            [3, 1, 3, 71],  # 501 runs of 71 bytes at odd offsets
        ],
        dtype=torch.int64,
    )
    return tensors, slices


def at_odd_address(tensor):
    """A copy of ``tensor`` whose data starts one byte into its storage, so at an address that is
    no multiple of its element size (as ``torch.frombuffer(..., offset=1)`` gives one)."""
    nbytes = tensor.numel() * tensor.element_size()
    storage = torch.zeros(nbytes + 1, dtype=torch.uint8, device=tensor.device).untyped_storage()
    odd = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    odd.set_(storage[1:], 0, tensor.shape)  # the sliced storage keeps its base alive
    odd.copy_(tensor)
    assert odd.data_ptr() % tensor.element_size() or tensor.element_size() == 1
    return odd


# Pieces cut to size 1 along more dimensions than csrc/geometry.h's kMaxDims (16), as (global
# shape, offset, piece sizes): every such dimension opened a block of its own, and the compiled op
# refused what the oracle accepts.
MANY_DIMS_PIECES = [
    ([2] * 18, [1] * 18, [1] * 18),
    ([3] * 24, [1] * 24, [2 if d % 3 == 2 else 1 for d in range(24)]),
    ([2] * 17 + [1000], [0] * 17 + [10], [1] * 17 + [900]),
]
