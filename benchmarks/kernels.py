"""Throughput of the transition kernels on CPU beside the per-slice torch baseline and memcpy.

pack/unpack: many small slices (4,096 tensors of 16 KiB, half of each) and a few large ones (8
tensors of 64 MiB, half of each); the baseline is one torch copy per slice into (or out of) the
buffer: both write into the same preallocated buffer (pack) or tensors (unpack).
checksum: the compiled kernel against its pure-PyTorch reference. memcpy: torch copy_ of
256 MiB. All in one run; prints a table and writes benchmarks/results/kernels.json.

    python benchmarks/kernels.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import _report
from runtime import kernels
from runtime.kernels import reference

MIB = 2**20


def _best(fn, repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return min(samples)


def _slices(tensors):
    return torch.tensor(
        [[i, 0, 0, t.shape[0] // 2] for i, t in enumerate(tensors)], dtype=torch.int64
    )


def _per_slice_pack(tensors, slices, out):
    offset = 0
    for i, dim, start, length in slices.tolist():
        view = tensors[i].narrow(dim, start, length)
        n = view.numel() * view.element_size()
        out[offset : offset + n].view(view.dtype).view(view.shape).copy_(view)
        offset += n


def _per_slice_unpack(buffer, tensors, slices):
    offset = 0
    for i, dim, start, length in slices.tolist():
        view = tensors[i].narrow(dim, start, length)
        n = view.numel() * view.element_size()
        view.copy_(buffer[offset : offset + n].view(view.dtype).view(view.shape))
        offset += n


def _memcpy_bandwidth(nbytes: int) -> float:
    dst, src = torch.empty(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
    return nbytes / _best(lambda: dst.copy_(src))


def main() -> None:
    print(f"kernels backend: {kernels.backend()}, torch threads: {torch.get_num_threads()}")
    memcpy = _memcpy_bandwidth(256 * MIB)
    rows, records = [], {"memcpy_bytes_per_s": memcpy, "cases": []}
    cases = {
        "small: 4096 x 8 KiB slices": [torch.randn(64, 64) for _ in range(4096)],
        "large: 8 x 32 MiB slices": [torch.randn(4096, 4096) for _ in range(8)],
    }
    for name, tensors in cases.items():
        slices = _slices(tensors)
        nbytes = sum(t.numel() * t.element_size() // 2 for t in tensors)
        packed = kernels.pack(tensors, slices)
        out = torch.empty(nbytes, dtype=torch.uint8)
        baseline_pack = _best(lambda t=tensors, s=slices, o=out: _per_slice_pack(t, s, o))
        kernel_pack = _best(lambda t=tensors, s=slices, o=out: kernels.pack(t, s, out=o))
        baseline_unpack = _best(lambda t=tensors, s=slices, b=packed: _per_slice_unpack(b, t, s))
        kernel_unpack = _best(lambda t=tensors, s=slices, b=packed: kernels.unpack(b, t, s))
        for op, base, kern in (
            ("pack", baseline_pack, kernel_pack),
            ("unpack", baseline_unpack, kernel_unpack),
        ):
            record = {
                "case": name,
                "op": op,
                "bytes": nbytes,
                "kernel_gbps": nbytes / kern / 1e9,
                "per_slice_gbps": nbytes / base / 1e9,
                "speedup": base / kern,
                "of_memcpy": nbytes / kern / memcpy,
            }
            records["cases"].append(record)
            rows.append(
                [
                    name,
                    op,
                    f"{record['kernel_gbps']:.2f}",
                    f"{record['per_slice_gbps']:.2f}",
                    f"{record['speedup']:.1f}x",
                    f"{record['of_memcpy']:.0%}",
                ]
            )
    data = torch.randn(4096, 4096)
    nbytes = data.numel() * data.element_size()
    fast = _best(lambda: kernels.checksum(data, data.shape, (0, 0)))
    slow = statistics.fmean(
        [_best(lambda: reference.checksum(data, data.shape, (0, 0)), repeats=1)]
    )
    records["checksum"] = {
        "bytes": nbytes,
        "kernel_gbps": nbytes / fast / 1e9,
        "reference_gbps": nbytes / slow / 1e9,
        "speedup": slow / fast,
    }
    rows.append(
        [
            "64 MiB fp32 tensor",
            "checksum",
            f"{nbytes / fast / 1e9:.2f}",
            f"{nbytes / slow / 1e9:.2f} (torch ref)",
            f"{slow / fast:.1f}x",
            f"{nbytes / fast / memcpy:.0%}",
        ]
    )
    print(f"memcpy (torch copy_, 256 MiB): {memcpy / 1e9:.2f} GB/s")
    _report.print_table(
        ["case", "op", "kernel GB/s", "per-slice GB/s", "speedup", "of memcpy"], rows
    )
    print(f"wrote {_report.write('kernels', records)}")


if __name__ == "__main__":
    main()
