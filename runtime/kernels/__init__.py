"""Transition kernels: pack shard slices into one buffer, unpack them, and the logical checksum.

The compiled ops of csrc/ (registered with PyTorch's operator registry as ``torch.ops.nereus.*``)
are used when ``python -m runtime.kernels.build`` has built them from the sources now in csrc/;
otherwise (not built, stale, or failing to load) the pure-PyTorch implementations in ``reference``
run, which are also the tests' oracle. ``backend()`` says which and ``library_status()`` why; the
choice is made once, on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
from collections.abc import Sequence

import torch

from runtime.kernels import paths, reference
from runtime.kernels.paths import library_path

logger = logging.getLogger(__name__)
_MASK64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class LibraryStatus:
    """The built library's state: ``compiled`` (loaded and in use), ``not built``, ``stale`` (built
    from other sources or for another torch: not loaded) or ``failed`` (it would not load); the
    detail says why."""

    state: str
    detail: str = ""


_lock = threading.Lock()
_status: LibraryStatus | None = None
_fakes_registered = False


def library_status() -> LibraryStatus:
    """Inspect and load the built library once (the first caller does; the others wait)."""
    global _status
    with _lock:
        if _status is None:
            _status = _inspect_library()
            if _status.state in {"stale", "failed"}:
                logger.warning(
                    "compiled kernels at %s: %s (%s); run `make kernels`. Using the "
                    "pure-PyTorch implementation",
                    library_path(),
                    "stale" if _status.state == "stale" else "failed to load",
                    _status.detail,
                )
        return _status


def _inspect_library() -> LibraryStatus:
    """The library's state, loading it if it is there and current (not cached: see library_status)."""
    path = library_path()
    if not path.exists():
        return LibraryStatus("not built")
    stale = _stale_because(path)
    if stale:
        return LibraryStatus("stale", stale)
    try:
        torch.ops.load_library(str(path))
        _register_fakes()
    except (OSError, RuntimeError) as exc:
        reason = exc.__cause__ or exc  # torch's OSError wraps the loader's, which says why
        return LibraryStatus("failed", str(reason).strip() or type(reason).__name__)
    return LibraryStatus("compiled")


def _stale_because(path) -> str:
    """Why the library at ``path`` does not match these sources and this torch ('' if it does)."""
    try:
        record = json.loads(paths.stamp_path().read_text())
        built_from, built_for = record["sources"], record["torch"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no record of what {path.name} was built from"
    if torch.__version__ != built_for:
        return f"built for torch {built_for}, this is torch {torch.__version__}"
    if paths.CSRC.is_dir() and paths.source_digest() != built_from:
        return "csrc/ changed since it was built"
    from runtime.kernels.build import compile_flags

    flags = " ".join(compile_flags())
    if record.get("flags") != flags:
        return f"built with flags {record.get('flags')!r}, this build uses {flags!r}"
    return ""


def _compiled() -> bool:
    """True once the built library is loaded; False (the reference runs) if it is missing, stale
    or would not load."""
    return library_status().state == "compiled"


def _register_fakes() -> None:
    """Shape functions for tracing (torch.compile, FakeTensor, opcheck), once per process; they
    check devices as the kernels do (a meta tensor among CPU ones would reach them)."""
    global _fakes_registered
    if _fakes_registered:
        return

    @torch.library.register_fake("nereus::pack")
    def _(sources, slices):
        if sources:
            reference.check_slices_device(slices, sources[0].device, "pack")
            reference.check_devices(sources, sources[0].device, "pack")
        return (
            sources[0].new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.uint8)
            if sources
            else torch.empty(0, dtype=torch.uint8)
        )

    @torch.library.register_fake("nereus::pack_into")
    def _(sources, slices, out):
        reference.check_slices_device(slices, out.device, "pack_into")
        reference.check_devices(sources, out.device, "pack_into")

    @torch.library.register_fake("nereus::unpack")
    def _(buffer, destinations, slices):
        reference.check_slices_device(slices, buffer.device, "unpack")
        reference.check_devices(destinations, buffer.device, "unpack")

    _fakes_registered = True


@functools.cache
def _has_kernel(op: str, device_type: str) -> bool:
    """Whether the built library has ``op`` for this device (a CPU-only build has no CUDA ops)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"nereus::{op}", key)


def _use(
    op: str,
    tensor: torch.Tensor | None,
    others: Sequence[torch.Tensor] = (),
    slices: torch.Tensor | None = None,
) -> bool:
    """The compiled op for ``tensor``'s device, if built for it; the reference otherwise, and
    where ``others`` are not all on that device or ``slices`` is neither there nor on the CPU (it
    refuses them, as the compiled ops do: slices on a third device would pick the kernel of that
    device, or of none where the build has no kernels for it)."""
    device = torch.device("cpu") if tensor is None else tensor.device
    if any(t.device != device for t in others):
        return False
    if slices is not None and slices.device.type != "cpu" and slices.device != device:
        return False
    return _compiled() and _has_kernel(op, device.type)


def has_kernels_for(device_type: str) -> bool:
    """Whether the loaded library has kernels for ``device_type`` (a CPU-only build has none for
    "cuda": CUDA tensors then use the reference)."""
    return _compiled() and all(
        _has_kernel(op, device_type) for op in ("checksum", "pack", "pack_into", "unpack")
    )


def backend() -> str:
    """``compiled`` when the csrc/ ops are loaded, else ``reference`` (library_status() says why)."""
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
        if _use("pack_into", out, sources, slices):
            torch.ops.nereus.pack_into(list(sources), slices, out)
        else:
            reference.pack_into(sources, slices, out)
        return out
    if _use("pack", sources[0] if sources else None, sources, slices):
        return torch.ops.nereus.pack(list(sources), slices)
    return reference.pack(sources, slices)


def unpack(
    buffer: torch.Tensor, destinations: Sequence[torch.Tensor], slices: torch.Tensor
) -> None:
    """Write the buffer's bytes into ``destinations[i].narrow(dim, start, length)``, row by row."""
    if _use("unpack", buffer, destinations, slices):
        torch.ops.nereus.unpack(buffer, list(destinations), slices)
    else:
        reference.unpack(buffer, destinations, slices)
