"""The built library's status, and what ``nereus doctor`` says of it: compiled (with or without
CUDA kernels), not built, stale (built from other sources or for another torch) or failing to load.

Found by review: a library built before csrc/ changed was still loaded and reported OK, one that
would not load was reported "not built", and a build without CUDA kernels on a GPU machine was
reported "compiled" while CUDA tensors used the reference."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nereus import doctor
from runtime import kernels
from runtime.kernels import build, paths
from tests.support.services import require


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A csrc/ and a build folder of their own, inspected afresh by the doctor (never loaded: no
    case here is a library that is both current and loadable)."""
    csrc = tmp_path / "csrc"
    shutil.copytree(paths.CSRC, csrc)
    monkeypatch.setattr(paths, "CSRC", csrc)
    monkeypatch.setattr(paths, "BUILD_DIR", tmp_path / "build")
    paths.BUILD_DIR.mkdir()
    monkeypatch.setattr(kernels, "library_status", kernels._inspect_library)
    return tmp_path


def _library(record: dict | None) -> None:
    paths.library_path().write_bytes(b"not a shared library")
    if record is not None:
        paths.stamp_path().write_text(json.dumps(record))


def test_a_library_missing_is_not_built(elsewhere):
    assert kernels.library_status() == kernels.LibraryStatus("not built")
    found = doctor.check_kernels()
    assert found.status == doctor.WARN and found.detail.startswith("not built")


def test_a_library_that_will_not_load_says_why(elsewhere):
    _library(build.stamp())  # current: the loader is tried, and refuses it
    status = kernels.library_status()
    assert status.state == "failed" and str(paths.library_path()) in status.detail
    found = doctor.check_kernels()
    assert found.status == doctor.WARN
    assert found.detail.startswith(f"failed to load: {status.detail}")
    assert "make kernels" in found.hint


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("source", "csrc/ changed since it was built"),
        ("torch", "built for torch 0.0.1, this is torch"),
        ("record", "no record of what nereus_kernels.so was built from"),
        ("flags", "built with flags '-O3', this build uses"),
    ],
)
def test_a_stale_library_is_not_loaded_and_says_so(elsewhere, change, why):
    record = build.stamp()
    if change == "source":
        header = paths.CSRC / "geometry.h"
        header.write_text(
            header.read_text().replace("0x9E3779B97F4A7C15ULL", "0x9E3779B97F4A7C17ULL")
        )
    elif change == "torch":
        record["torch"] = "0.0.1"
    elif change == "flags":
        if "-fopenmp" not in build.compile_flags():
            pytest.skip("this torch has no OpenMP: its flags are -O3 alone")  # not in CI's
        record["flags"] = "-O3"  # a library built before the kernels were parallel
    _library(None if change == "record" else record)
    status = kernels.library_status()
    # Not even tried: the loader would have said the file is no library ("failed").
    assert status.state == "stale" and status.detail.startswith(why)
    found = doctor.check_kernels()
    assert found.status == doctor.WARN
    assert found.detail.startswith(f"stale ({status.detail})") and "make kernels" in found.hint


def test_only_sources_make_a_library_stale(elsewhere):
    _library(build.stamp())
    (paths.CSRC / "README.md").write_text("documentation only\n")
    assert kernels.library_status().state == "failed"  # current: loaded (and refused)
    (paths.CSRC / "cpu" / "extra.cpp").write_text("// a new source\n")
    assert kernels.library_status().state == "stale"


def test_the_build_records_what_it_built_from_only_when_it_succeeds(elsewhere, monkeypatch):
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    assert build.build() == paths.library_path()
    assert calls[0]["build_directory"] == str(paths.BUILD_DIR)
    assert json.loads(paths.stamp_path().read_text()) == build.stamp()
    paths.stamp_path().unlink()

    def fail(**kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.raises(RuntimeError, match="no compiler"):
        build.build()
    assert not paths.stamp_path().exists()


def test_the_library_in_use_matches_its_record():
    require(kernels.library_status().state == "compiled", "the kernels are not compiled here")
    assert json.loads(paths.stamp_path().read_text()) == build.stamp()


def test_the_cpu_kernels_run_on_atens_threads():
    """``at::parallel_for`` compiles its ``#pragma omp parallel`` into the extension: built
    without ``-fopenmp`` the pragma was ignored and every CPU kernel ran on one thread (found by
    comparing pack's throughput with torch's own copy). A library parallel with OpenMP calls
    libgomp's entry point for a parallel region."""
    require(kernels.library_status().state == "compiled", "the kernels are not compiled here")
    require(torch._C.has_openmp, "this torch's parallel backend is not OpenMP")
    assert b"GOMP_parallel" in paths.library_path().read_bytes()


def test_doctor_says_when_a_gpu_has_no_compiled_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "library_status", lambda: kernels.LibraryStatus("compiled"))
    monkeypatch.setattr(kernels, "has_kernels_for", lambda device_type: device_type == "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    found = doctor.check_kernels()
    assert found.status == doctor.WARN and "without CUDA kernels" in found.detail
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    found = doctor.check_kernels()
    assert found.status == doctor.OK and found.detail.startswith("compiled (csrc/, CPU)")
    monkeypatch.setattr(kernels, "has_kernels_for", lambda device_type: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    found = doctor.check_kernels()
    assert found.status == doctor.OK and "CPU and CUDA" in found.detail


def test_has_kernels_for_reads_the_op_registry():
    if kernels.backend() != "compiled":
        assert not kernels.has_kernels_for("cpu")
        return
    assert kernels.has_kernels_for("cpu")
    assert kernels.has_kernels_for("cuda") == torch._C._dispatch_has_kernel_for_dispatch_key(
        "nereus::unpack", "CUDA"
    )


@pytest.mark.parametrize(
    ("cuda", "cuda_home", "hip", "rocm_home", "expected"),
    [
        ("12.4", "/usr/local/cuda", None, None, True),
        ("12.4", None, None, None, False),  # no toolkit: the CPU kernels still build
        (None, None, "6.2.41133", "/opt/rocm", True),  # ROCm: CUDA_HOME is never set
        (None, None, "6.2.41133", None, False),
        (None, "/usr/local/cuda", None, "/opt/rocm", False),  # a CPU build of torch
    ],
)
def test_the_device_sources_join_the_build_for_cuda_and_rocm(
    monkeypatch, cuda, cuda_home, hip, rocm_home, expected
):
    """Found by review: the .cu sources joined only where cpp_extension.CUDA_HOME was set, never
    the case with a ROCm build of torch, so ROCm builds had no GPU kernels."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cuda_home)
    monkeypatch.setattr(cpp_extension, "ROCM_HOME", rocm_home)
    chosen = [Path(f).relative_to(paths.CSRC).as_posix() for f in build.sources()]
    assert ("cuda/ops_cuda.cu" in chosen) == expected
    assert {"ops.cpp", "cpu/ops_cpu.cpp"} <= set(chosen)
    # The rule itself, apart from torch.
    found = build.builds_device_kernels(
        cuda=cuda, cuda_home=cuda_home, hip=hip, rocm_home=rocm_home
    )
    assert found == expected


def test_a_second_pytorch_keeps_its_build_in_its_own_folder(tmp_path):
    """NEREUS_KERNELS_DIR: a CUDA build of PyTorch beside the CPU one (benchmarks/device_kernels.sh)
    builds and loads its library there, and leaves the default build alone."""
    show = "from runtime.kernels import paths; print(paths.library_path(), paths.stamp_path())"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(paths.REPO)}
    default = subprocess.run(
        [sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    moved = subprocess.run(
        [sys.executable, "-c", show],
        env={**env, "NEREUS_KERNELS_DIR": str(tmp_path / "cuda")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [Path(p).parent for p in default] == [paths.REPO / "build" / "kernels"] * 2
    assert [Path(p).parent for p in moved] == [tmp_path / "cuda"] * 2
