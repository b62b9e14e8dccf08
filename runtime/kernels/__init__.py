"""Transition kernels: pack shard slices into one buffer, unpack them, and the logical checksum.

The compiled ops of csrc/ (registered with PyTorch's operator registry as ``torch.ops.nereus.*``)
are used when ``python -m runtime.kernels.build`` has built them; otherwise the pure-PyTorch
implementations in ``reference`` run, which are also the tests' oracle. ``backend()`` says which;
the choice is made once, on first use.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from runtime.kernels import reference
from runtime.kernels.paths import library_path

logger = logging.getLogger(__name__)
_MASK64 = (1 << 64) - 1


@functools.cache
def _compiled() -> bool:
    """Load the built library once; False (the reference runs) if it is missing or stale."""
    path = library_path()
    if not path.exists():
        return False
    try:
        torch.ops.load_library(str(path))
        _register_fakes()
    except (OSError, RuntimeError) as exc:
        logger.warning(
            "compiled kernels at %s are unusable (%s); run `make kernels`. Using the "
            "pure-PyTorch implementation",
            path,
            exc,
        )
        return False
    return True


def _register_fakes() -> None:
    """Shape functions for tracing (torch.compile, FakeTensor, opcheck)."""

    @torch.library.register_fake("nereus::pack")
    def _(sources, slices):
        return (
            sources[0].new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.uint8)
            if sources
            else torch.empty(0, dtype=torch.uint8)
        )

    @torch.library.register_fake("nereus::pack_into")
    def _(sources, slices, out):
        return None

    @torch.library.register_fake("nereus::unpack")
    def _(buffer, destinations, slices):
        return None


@functools.cache
def _has_kernel(op: str, device_type: str) -> bool:
    """Whether the built library has ``op`` for this device (a CPU-only build has no CUDA ops)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"nereus::{op}", key)


def _use(op: str, tensor: torch.Tensor | None) -> bool:
    device = "cpu" if tensor is None else tensor.device.type
    return _compiled() and _has_kernel(op, device)


def backend() -> str:
    """``compiled`` when the csrc/ ops are loaded, else ``reference``."""
    return "compiled" if _compiled() else "reference"


def checksum(data: torch.Tensor, global_shape: Sequence[int], global_offset: Sequence[int]) -> int:
    """Layout-independent 64-bit checksum contribution of ``data`` at ``global_offset``."""
    if _use("checksum", data):
        return torch.ops.nereus.checksum(data, list(global_shape), list(global_offset)) & _MASK64
    return reference.checksum(data, global_shape, global_offset)


def pack(sources: Sequence[torch.Tensor], slices: torch.Tensor, *, out: torch.Tensor | None = None):
    """``sources[i].narrow(dim, start, length)`` for each row of ``slices``, back to back, as bytes:
    a new buffer, or the first bytes of ``out``."""
    if out is not None:
        if _use("pack_into", out):
            torch.ops.nereus.pack_into(list(sources), slices, out)
        else:
            reference.pack_into(sources, slices, out)
        return out
    if _use("pack", sources[0] if sources else None):
        return torch.ops.nereus.pack(list(sources), slices)
    return reference.pack(sources, slices)


def unpack(
    buffer: torch.Tensor, destinations: Sequence[torch.Tensor], slices: torch.Tensor
) -> None:
    """Write the buffer's bytes into ``destinations[i].narrow(dim, start, length)``, row by row."""
    if _use("unpack", buffer):
        torch.ops.nereus.unpack(buffer, list(destinations), slices)
    else:
        reference.unpack(buffer, destinations, slices)
