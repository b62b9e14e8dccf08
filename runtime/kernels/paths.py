"""Where the compiled kernels are built and looked for, and what they were built from."""

import hashlib
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
BUILD_DIR = REPO / (os.environ.get("NEREUS_KERNELS_DIR") or "build/kernels")
"""Where the library is built and loaded from: ``NEREUS_KERNELS_DIR`` (relative to the repository
unless absolute) where a second PyTorch (a CUDA build beside a CPU-only install, say) keeps its own
build beside the default one."""
NAME = "nereus_kernels"
# The files whose change makes a built library stale: the sources and headers the build compiles.
SOURCE_SUFFIXES = (".h", ".cuh", ".cpp", ".cu")


def library_path() -> Path:
    return BUILD_DIR / f"{NAME}.so"


def stamp_path() -> Path:
    """Written by the build beside the library: the digest of the sources it was built from."""
    return BUILD_DIR / f"{NAME}.sources"


def source_digest(csrc: Path | None = None) -> str:
    """SHA-256 over csrc/'s sources (paths and contents): any edit, addition or removal changes it."""
    root = CSRC if csrc is None else csrc
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()
