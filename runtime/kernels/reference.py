"""Pure-PyTorch implementations of the kernels: the fallback and the tests' oracle.

Same semantics and the same errors as csrc/: validation happens before any byte is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
# Elements per step of the checksum: its int64 temporaries (global indices, bits, terms) are built
# for one chunk at a time, never for the whole piece (8 MiB each, whatever the piece's size).
_CHUNK_ELEMENTS = 1 << 20
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIDTH_MASK = {2: 0xFFFF, 4: 0xFFFFFFFF}


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, in wrapping int64 arithmetic."""
    x = (x ^ _shift_right(x, 30)) * _M1
    x = (x ^ _shift_right(x, 27)) * _M2
    return x ^ _shift_right(x, 31)


def global_indices(shape: Sequence[int], global_shape: Sequence[int], global_offset: Sequence[int]):
    """Flat row-major index in the global tensor of every element of a block (all at once: the
    checksum builds them chunk by chunk, with _chunk_indices)."""
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for dim in range(len(global_shape) - 1, -1, -1):
        axis = (
            torch.arange(global_offset[dim], global_offset[dim] + shape[dim], dtype=torch.int64)
            * stride
        )
        view = [1] * len(global_shape)
        view[dim] = -1
        index = index + axis.view(view)
        stride *= global_shape[dim]
    return index.expand(tuple(shape)) if len(global_shape) else index


_Layout = tuple[int, list[tuple[int, int, int]]]


def _layout(
    shape: Sequence[int], global_shape: Sequence[int], global_offset: Sequence[int]
) -> _Layout:
    """Where a piece's elements sit in its global tensor, as (base, dims): the element at flat
    (row-major) position k of the piece has global index base + sum(((k // inner) % size) * stride)
    over dims (size, inner: the piece's stride of it, stride: the global one), innermost first.
    A dimension of size 1 is only an offset (in base); one merges with the dimension inside it
    where that spans its whole global extent, as csrc/geometry.h merges them."""
    base, dims = 0, []
    inner = stride = 1
    for dim in range(len(global_shape) - 1, -1, -1):
        base += global_offset[dim] * stride
        size = shape[dim]
        if size != 1:
            if dims and dims[-1][0] * dims[-1][2] == stride:  # the one inside spans it whole
                below, below_inner, below_stride = dims[-1]
                dims[-1] = (below * size, below_inner, below_stride)
            else:
                dims.append((size, inner, stride))
        inner *= size
        stride *= global_shape[dim]
    return base, dims


def _chunk_indices(layout: _Layout, start: int, stop: int) -> torch.Tensor:
    """Global indices of the piece's elements at flat positions [start, stop)."""
    base, dims = layout
    position = torch.arange(start, stop, dtype=torch.int64)
    index = torch.full_like(position, base)
    for size, inner, stride in dims:
        part = position // inner if inner > 1 else position
        if stop > inner * size:  # the outermost dimension needs no modulo
            part = part % size
        index += part * stride if stride > 1 else part
    return index


def checksum(data: torch.Tensor, global_shape: Sequence[int], global_offset: Sequence[int]) -> int:
    """Sum of mix(global_index * G ^ bits) modulo 2**64 over the elements of ``data``."""
    if len(global_shape) != data.dim() or len(global_offset) != data.dim():
        raise RuntimeError(
            "checksum: global_shape and global_offset need one entry per dimension of data"
        )
    for dim, (size, offset) in enumerate(zip(global_shape, global_offset, strict=True)):
        if offset < 0 or offset > size or data.shape[dim] > size - offset:
            raise RuntimeError(
                f"checksum: dim {dim} slice [{offset}, {offset + data.shape[dim]}) "
                f"outside [0, {size})"
            )
    if math.prod(global_shape) >= 2**63:
        raise RuntimeError("checksum: global_shape has more than 2**63 elements")
    width = data.element_size()
    if width not in _BITS:
        raise RuntimeError(f"checksum: unsupported element size {width}")
    numel = data.numel()
    if numel == 0:
        return 0
    # The values of a conjugate or negative view, not its bytes, as the compiled op (whose inputs
    # torch resolves) sums them.
    raw = _resolved(data.detach()).contiguous().view(_BITS[width]).reshape(-1)
    layout = _layout(tuple(data.shape), global_shape, global_offset)
    total = 0
    # Chunks of the flat element range, so that no temporary grows with the piece (a [1, 2**30]
    # piece is cut too); the sum modulo 2**64 does not depend on where the chunks end.
    for start in range(0, numel, _CHUNK_ELEMENTS):
        stop = min(numel, start + _CHUNK_ELEMENTS)
        bits = raw[start:stop].cpu().to(torch.int64)
        if width in _WIDTH_MASK:
            bits = bits & _WIDTH_MASK[width]
        terms = mix((_chunk_indices(layout, start, stop) * _GOLDEN) ^ bits)
        # Low and high 32-bit halves apart: neither sum can overflow int64 below 2**31 elements.
        total += int((terms & 0xFFFFFFFF).sum()) + (int(_shift_right(terms, 32).sum()) << 32)
    return total & _MASK64


def _resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in plain bytes: a conjugate or negative view resolved (a copy), any other
    tensor itself."""
    return tensor.resolve_conj().resolve_neg()


def _validate(
    tensors: Sequence[torch.Tensor], slices: torch.Tensor, device: torch.device, op: str
) -> list[tuple[int, ...]]:
    if slices.dtype != torch.int64 or slices.dim() != 2 or slices.shape[1] != 4:
        raise RuntimeError(
            f"{op}: slices must be an int64 tensor of shape [n, 4] (tensor, dim, start, length)"
        )
    check_slices_device(slices, device, op)
    rows = [tuple(int(v) for v in row) for row in slices.tolist()]
    for i, (t, dim, start, length) in enumerate(rows):
        if not 0 <= t < len(tensors):
            raise RuntimeError(f"{op}: slice {i} names tensor {t} of {len(tensors)}")
        tensor = tensors[t]
        if not tensor.is_contiguous():
            raise RuntimeError(f"{op}: tensor {t} is not contiguous")
        if not 0 <= dim < max(tensor.dim(), 1):
            raise RuntimeError(f"{op}: slice {i} dim {dim} outside a {tensor.dim()}-d tensor")
        size = tensor.shape[dim] if tensor.dim() else 1
        if start < 0 or length < 0 or start > size or length > size - start:
            raise RuntimeError(
                f"{op}: slice {i} [{start}, {start + length}) outside [0, {size}) of tensor {t}"
            )
    return rows


def _first_overlap(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The first two tensors, by address, whose elements can share a byte (empty ones occupy
    none), as (lower index, higher index); None if there are none."""
    spans = []
    for index, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        last = sum(
            (size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True)
        )
        begin = t.data_ptr()
        spans.append((str(t.device), begin, begin + (last + 1) * t.element_size(), index))
    spans.sort()
    reach = None
    for span in spans:
        if reach is not None and span[0] == reach[0] and span[1] < reach[2]:
            return min(reach[3], span[3]), max(reach[3], span[3])
        if reach is None or span[0] != reach[0] or span[2] > reach[2]:
            reach = span
    return None


def _view(tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return (
        tensor.reshape(1)[start : start + length]
        if tensor.dim() == 0
        else tensor.narrow(dim, start, length)
    )


def check_devices(tensors: Sequence[torch.Tensor], device: torch.device, op: str) -> None:
    """Every tensor on ``device`` (the buffer's, or out's), as the compiled ops require."""
    for tensor in tensors:
        if tensor.device != device:
            raise RuntimeError(
                f"{op}: every tensor must be on the buffer's device ({device}), not {tensor.device}"
            )


def check_slices_device(slices: torch.Tensor, device: torch.device, op: str) -> None:
    """``slices`` on the CPU or on ``device`` (the buffer's, or out's, or the sources'), as the
    compiled ops require: on a third device they would choose the kernel, which would then run on
    tensors of another device."""
    if slices.device.type != "cpu" and slices.device != device:
        raise RuntimeError(
            f"{op}: slices must be on the CPU or on the buffer's device ({device}), "
            f"not {slices.device}"
        )


def _check_apart(one: torch.Tensor, tensors: Sequence[torch.Tensor], what: str) -> None:
    """``one`` shares no byte with any of ``tensors``: '<what> <index> in memory' names the first
    that does."""
    for index, tensor in enumerate(tensors):
        if _first_overlap([one, tensor]) is not None:
            raise RuntimeError(f"{what} {index} in memory")


def _check_no_grad(tensor: torch.Tensor, op: str, name: str) -> None:
    """The ops are not differentiable: while grad mode is on, a tensor they would write that
    requires grad is refused (as the compiled ops' autograd kernel does)."""
    if torch.is_grad_enabled() and tensor.requires_grad:
        raise RuntimeError(
            f"{op}: {name} requires grad and the op is not differentiable: write into it under "
            "torch.no_grad(), or into a tensor that does not require grad"
        )


def _check_writable(tensor: torch.Tensor, op: str, name: str) -> None:
    """What the compiled ops refuse to write into, before any byte is written (csrc/ops.cpp): an
    inference tensor outside inference mode (it has no version to bump), and a conjugate or
    negative view (its bytes are not its values)."""
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{op}: {name} is an inference tensor, written outside inference mode: write into it "
            "under torch.inference_mode(), or into a tensor made outside it"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise RuntimeError(
            f"{op}: {name} is a conjugate or negative view, whose bytes are not its values: write "
            "into a resolved tensor (resolve_conj(), resolve_neg())"
        )


def _check_disjoint(rows: Sequence[tuple[int, ...]], op: str) -> None:
    """No two slices of one destination share an element, in O(n log n) as csrc/slices.h does
    (and naming the same pair): per destination by start, slices along different dimensions
    always meet; along one, a slice meets an earlier one if it starts before the furthest end so
    far (``reach``'s)."""
    order = sorted(
        (i for i, row in enumerate(rows) if row[3]), key=lambda i: (rows[i][0], rows[i][2], i)
    )
    reach = 0
    for k, i in enumerate(order):
        tensor, dim, start, length = rows[i]
        if k == 0 or rows[order[k - 1]][0] != tensor:
            reach = i
            continue
        _, reach_dim, reach_start, reach_length = rows[reach]
        if reach_dim != dim or reach_start + reach_length > start:
            raise RuntimeError(
                f"{op}: slices {min(reach, i)} and {max(reach, i)} overlap in destination {tensor}"
            )
        if start + length > reach_start + reach_length:
            reach = i


def pack(sources: Sequence[torch.Tensor], slices: torch.Tensor) -> torch.Tensor:
    device = sources[0].device if sources else torch.device("cpu")
    rows = _validate(sources, slices, device, "pack")
    check_devices(sources, device, "pack")
    # The values of conjugate and negative views, as the compiled op (whose inputs torch resolves)
    # packs them.
    parts = [
        _resolved(_view(sources[t], d, s, n)).contiguous().view(-1).view(torch.uint8)
        for t, d, s, n in rows
    ]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def pack_into(sources: Sequence[torch.Tensor], slices: torch.Tensor, out: torch.Tensor) -> None:
    _check_no_grad(out, "pack_into", "out")
    _check_writable(out, "pack_into", "out")
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise RuntimeError("pack_into: out must be a contiguous 1-d uint8 tensor")
    rows = _validate(sources, slices, out.device, "pack_into")
    check_devices(sources, out.device, "pack_into")
    need = sum(
        _view(sources[t], d, s, n).numel() * sources[t].element_size() for t, d, s, n in rows
    )
    if need > out.numel():
        raise RuntimeError(f"pack_into: slices need {need} bytes, out holds {out.numel()}")
    # Sources may share bytes with each other (they are only read), not with out.
    _check_apart(out, sources, "pack_into: out overlaps source")
    out[:need].copy_(pack(sources, slices))  # bumps out's version, as the compiled op does


def unpack(
    buffer: torch.Tensor, destinations: Sequence[torch.Tensor], slices: torch.Tensor
) -> None:
    # Every check first, in the compiled op's order: a refused unpack writes no byte.
    for index, destination in enumerate(destinations):
        _check_no_grad(destination, "unpack", f"destination {index}")
    for index, destination in enumerate(destinations):
        _check_writable(destination, "unpack", f"destination {index}")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise RuntimeError("unpack: buffer must be a contiguous 1-d uint8 tensor")
    rows = _validate(destinations, slices, buffer.device, "unpack")
    check_devices(destinations, buffer.device, "unpack")
    sizes = [
        _view(destinations[t], d, s, n).numel() * destinations[t].element_size()
        for t, d, s, n in rows
    ]
    if sum(sizes) != buffer.numel():
        raise RuntimeError(
            f"unpack: slices cover {sum(sizes)} bytes, the buffer holds {buffer.numel()}"
        )
    # A destination sharing bytes with the buffer would be read after it was (partly) written.
    _check_apart(buffer, destinations, "unpack: buffer overlaps destination")
    pair = _first_overlap(destinations)
    if pair is not None:
        raise RuntimeError(f"unpack: destinations {pair[0]} and {pair[1]} overlap in memory")
    _check_disjoint(rows, "unpack")
    offset = 0
    for (t, d, s, n), size in zip(rows, sizes, strict=True):
        view = _view(destinations[t], d, s, n)
        part = buffer[offset : offset + size]
        # Bytes of any dtype follow each other in the buffer (a uint8 slice, then a float32 one),
        # and the buffer may start anywhere: viewed as the destination's dtype only from an
        # offset that is a multiple of its element size, else from an aligned copy.
        if part.storage_offset() % view.element_size():
            part = part.clone()
        view.copy_(part.view(view.dtype).view(view.shape))  # bumps the destination's version
        offset += size
