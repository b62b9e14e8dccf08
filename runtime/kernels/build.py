"""Build the transition kernels of csrc/ with torch.utils.cpp_extension.

C++ for CPU always; CUDA sources join only where PyTorch is a CUDA (or ROCm, which hipifies them)
build and a compiler for them exists, so a CPU-only install always builds. ``make install`` runs
this; if it fails, the runtime uses the pure-PyTorch implementation and ``nereus doctor`` says so.
Beside the library it records what the library was built from (``paths.stamp_path()``: a digest of
csrc/'s sources and the torch version); a library whose record does not match is stale, not loaded.

    python -m runtime.kernels.build [--verbose]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from runtime.kernels import paths


def sources() -> list[str]:
    import torch
    from torch.utils import cpp_extension

    files = [paths.CSRC / "ops.cpp", *sorted((paths.CSRC / "cpu").glob("*.cpp"))]
    if builds_device_kernels(
        cuda=torch.version.cuda,
        cuda_home=cpp_extension.CUDA_HOME,
        hip=torch.version.hip,
        rocm_home=cpp_extension.ROCM_HOME,
    ):
        files += sorted((paths.CSRC / "cuda").glob("*.cu"))
    return [str(f) for f in files]


def builds_device_kernels(
    *, cuda: str | None, cuda_home: str | None, hip: str | None, rocm_home: str | None
) -> bool:
    """Whether the .cu sources join the build, given torch.version.cuda and .hip (which of them
    this PyTorch was built for, if any) and where cpp_extension found that toolkit: CUDA_HOME for
    CUDA, ROCM_HOME for ROCm (which hipifies them; CUDA_HOME is never set there)."""
    return bool((cuda and cuda_home) or (hip and rocm_home))


def compile_flags() -> list[str]:
    """The C++ flags: optimized, and OpenMP where ATen's parallel backend is OpenMP (its
    default). ``at::parallel_for`` is a header template whose ``#pragma omp parallel`` is
    compiled into the extension: without ``-fopenmp`` the pragma is ignored and every CPU kernel
    runs on one thread, while torch's own copies use them all."""
    import torch

    return ["-O3", "-fopenmp"] if torch._C.has_openmp else ["-O3"]


def build(*, verbose: bool = False) -> Path:
    """Compile (or reuse an up-to-date build of) the kernels; returns the shared library's path."""
    from torch.utils import cpp_extension

    paths.BUILD_DIR.mkdir(parents=True, exist_ok=True)
    # Taken before compiling: sources edited meanwhile make the new library stale, never current.
    record = stamp()
    files = sources()
    cpp_extension.load(
        name=paths.NAME,
        sources=files,
        build_directory=str(paths.BUILD_DIR),
        extra_cflags=compile_flags(),
        extra_ldflags=["-fopenmp"] if "-fopenmp" in compile_flags() else [],
        extra_cuda_cflags=["-O3"],
        is_python_module=False,
        with_cuda=any(f.endswith(".cu") for f in files),
        verbose=verbose,
    )
    paths.stamp_path().write_text(json.dumps(record, sort_keys=True) + "\n")
    return paths.library_path()


def stamp() -> dict[str, str]:
    """What a library built now is built from (compared with the record when it is loaded)."""
    import torch

    return {
        "sources": paths.source_digest(),
        "torch": torch.__version__,
        "flags": " ".join(compile_flags()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="Build the nereus transition kernels.")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    try:
        path = build(verbose=args.verbose)
    except Exception as exc:  # a missing compiler or headers: say so, the fallback still works
        print(
            f"kernels: not built ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "the pure-PyTorch implementation will be used",
            file=sys.stderr,
        )
        return 1
    print(f"kernels: built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
