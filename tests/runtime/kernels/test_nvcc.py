"""The CUDA kernels compiled by nvcc for the NVIDIA accelerators of the planner's catalog.

No GPU exists here, but CUDA's compiler does (this machine's image carries nvcc): these tests build
csrc/cuda/kernels.cuh, which is free of ATen, for each catalogued GPU's architecture and read what
ptxas reports and the PTX it is given. They check what a GPU build's speed rests on and can be
checked without one: the device code compiles without a warning, no kernel spills registers to
local memory, and the pack/unpack copy keeps its 16-byte accesses with several loads in flight
per thread before its first store. test_cuda_emulated.py runs the same source on the CPU against
the oracle; benchmarks/device_kernels.sh builds the whole extension on a GPU machine and measures
it there.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from runtime.kernels.paths import CSRC
from runtime.planner.catalog import ACCELERATORS, CPU_SLOT

HARNESS = Path(__file__).with_name("instantiate_kernels.cu")
KERNELS = CSRC / "cuda" / "kernels.cuh"

# Each catalogued accelerator's CUDA architecture; the ones not built for CUDA say why.
ARCHITECTURES = {"a100-80gb": "sm_80", "h100-sxm": "sm_90", "h200": "sm_90"}
NOT_CUDA = {"mi300x": "ROCm: hipified by PyTorch's extension builder", CPU_SLOT: "no GPU"}

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA's compiler) is not on PATH")


def test_every_catalogued_accelerator_is_placed():
    """A GPU added to the catalog is compiled for here, or said not to be CUDA."""
    assert set(ACCELERATORS) == set(ARCHITECTURES) | set(NOT_CUDA)


def _constant(name: str) -> int:
    match = re.search(rf"constexpr \w+ {name} = ([^;]+);", KERNELS.read_text())
    assert match, f"{name} is not defined in {KERNELS}"
    return int(eval(match.group(1), {}))  # a literal or a shift such as 1 << 14


def _nvcc(tmp_path: Path, arch: str, *output: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [
            NVCC,
            "-std=c++17",
            "-O3",
            f"-arch={arch}",
            "-Werror=all-warnings",
            "-Xptxas=-v,-warn-spills,-warn-lmem-usage",
            f"-I{KERNELS.parent}",
            *output,
            str(HARNESS),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def ptxas_report(text: str) -> dict[str, dict[str, int]]:
    """Per kernel (mangled name), what ptxas says of it: stack, spills, registers, smem."""
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            current = kernels.setdefault(m.group(1), {})
        elif current is not None and (m := re.search(r"(\d+) bytes stack frame", line)):
            current["stack"] = int(m.group(1))
            current["spill_stores"] = int(re.search(r"(\d+) bytes spill stores", line).group(1))
            current["spill_loads"] = int(re.search(r"(\d+) bytes spill loads", line).group(1))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(smem.group(1)) if smem else 0
    return kernels


def test_the_report_parser_reads_ptxas():
    """Without this, an empty report below would pass every check."""
    text = (
        "ptxas info    : Function properties for _Z1kv\n"
        "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem\n"
    )
    assert ptxas_report(text) == {
        "_Z1kv": {"stack": 8, "spill_stores": 4, "spill_loads": 4, "registers": 40, "smem": 2048}
    }


@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES.values())))
def test_kernels_compile_without_spilling(tmp_path, arch):
    report = ptxas_report(_nvcc(tmp_path, arch, "-cubin", "-o", "kernels.cubin").stderr)
    copies = [name for name in report if "copy_kernel" in name]
    checksums = [name for name in report if "checksum_kernel" in name]
    assert len(copies) == 2 and len(checksums) == 4, sorted(report)
    for name, figures in report.items():
        assert figures["stack"] == 0, (name, figures)  # nothing in local memory
        assert figures["spill_stores"] == figures["spill_loads"] == 0, (name, figures)
        # registers are given out to warps in units of 8 per thread
        per_block = -(-figures["registers"] // 8) * 8 * _constant("kThreads")
        assert 65536 // per_block >= _constant("kResidentBlocks"), (name, figures)
    for name in checksums:  # one 8-byte partial sum per thread for the block's reduction
        assert report[name]["smem"] == 8 * _constant("kThreads"), (name, report[name])


def _memory_ops(ptx: str, entry: str, width: str) -> list[str]:
    """The kernel's global loads and stores of ``width`` (``v4.u32``: 16 bytes), in order."""
    body = ptx[ptx.index(f".entry {entry}") :]
    body = body[: body.index("\n}")]
    return re.findall(rf"\b(ld|st)\.global\.{re.escape(width)}\b", body)


def _longest_load_run(ops: list[str]) -> int:
    longest = run = 0
    for op in ops:
        run = run + 1 if op == "ld" else 0
        longest = max(longest, run)
    return longest


@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES.values())))
def test_the_copy_keeps_several_16_byte_loads_in_flight(tmp_path, arch):
    """A copy runs at the bytes in flight over the memory's latency: every thread issues
    kUnroll loads of 16 bytes before it stores the first, in pack and in unpack."""
    _nvcc(tmp_path, arch, "-ptx", "-o", "kernels.ptx")
    ptx = (tmp_path / "kernels.ptx").read_text()
    entries = re.findall(r"\.entry (\S*copy_kernel\S*)\(", ptx)
    assert len(entries) == 2, entries
    unroll = _constant("kUnroll")
    assert unroll >= 2
    for entry in entries:
        ops = _memory_ops(ptx, entry, "v4.u32")
        assert ops.count("st") > 0, (entry, "no 16-byte store")
        assert _longest_load_run(ops) >= unroll, (entry, ops[:16])
