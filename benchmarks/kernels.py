"""Throughput of the transition kernels beside the per-slice torch baseline and a plain copy.

pack/unpack: many small slices (4,096 tensors, half of each) and a few large ones (8 tensors, half
of each); the baseline is one torch copy per slice into (or out of) the buffer: both write into
the same preallocated buffer (pack) or tensors (unpack). checksum: the compiled kernel against its
pure-PyTorch reference. memcpy: torch copy_ of one large buffer. All in one run; prints a table and
writes benchmarks/results/kernels.json (CPU) or kernels_cuda.json (GPU).

    python benchmarks/kernels.py                 # CPU: 8 KiB and 32 MiB slices
    python benchmarks/kernels.py --device cuda   # GPU: 8 KiB and 256 MiB slices, CUDA events

On a GPU, "of peak" is bytes read plus bytes written per second against the accelerator's
catalogued memory bandwidth (the planner's catalog, where the device is in it).
"""

from __future__ import annotations

import argparse
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
    """Fastest of ``repeats`` runs after a warm-up, in seconds (CUDA work timed by events)."""
    fn()
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) / 1e3)
        else:
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


def _memcpy_bandwidth(nbytes: int, device: str) -> float:
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _best(lambda: dst.copy_(src))


def _peak_bandwidth(device: str) -> tuple[str, float] | None:
    """The catalog entry this GPU's name matches and its memory bandwidth, or None (CPU, or a GPU
    not in the catalog). The match is by model (``h200`` in ``NVIDIA H200``): the entry is printed,
    since an H100 PCIe would match the catalogue's SXM part."""
    if device != "cuda":
        return None
    from runtime.planner.catalog import default_catalog

    name = torch.cuda.get_device_name().lower()
    for acc in default_catalog().accelerators.values():
        if acc.name.split("-")[0] in name:
            return acc.name, acc.memory_bandwidth
    return None


CASES = {
    # device: {case: (number of tensors, rows, columns)}; each slice is half of a tensor's rows
    "cpu": {
        "small: 4096 x 8 KiB slices": (4096, 64, 64),
        "large: 8 x 32 MiB slices": (8, 4096, 4096),
    },
    "cuda": {
        "small: 4096 x 8 KiB slices": (4096, 64, 64),
        "large: 8 x 256 MiB slices": (8, 16384, 8192),
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    device = parser.parse_args().device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    print(f"kernels backend: {kernels.backend()}, torch threads: {torch.get_num_threads()}")
    memcpy = _memcpy_bandwidth((1024 if device == "cuda" else 256) * MIB, device)
    matched = _peak_bandwidth(device)
    peak = matched[1] if matched else None
    rows, records = [], {"device": device, "memcpy_bytes_per_s": memcpy, "cases": []}
    if device == "cuda":
        records["device_name"] = torch.cuda.get_device_name()
        records["peak_bytes_per_s"] = peak
        records["catalog_entry"] = matched[0] if matched else None

    def of_peak(nbytes: float, seconds: float) -> str:
        return f"{2 * nbytes / seconds / peak:.0%}" if peak else "-"

    for name, (count, height, width) in CASES[device].items():
        tensors = [torch.randn(height, width, device=device) for _ in range(count)]
        slices = _slices(tensors)
        nbytes = sum(t.numel() * t.element_size() // 2 for t in tensors)
        packed = kernels.pack(tensors, slices)
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
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
                "of_peak": 2 * nbytes / kern / peak if peak else None,
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
                    of_peak(nbytes, kern),
                ]
            )
        del tensors, packed, out
    side = 16384 if device == "cuda" else 4096
    records["checksum"] = []
    for dtype in (torch.float32, torch.bfloat16):
        data = torch.randn(side, side, device=device).to(dtype)
        nbytes = data.numel() * data.element_size()
        fast = _best(lambda d=data: kernels.checksum(d, d.shape, (0, 0)))
        # The reference is slow: timed on a 64 MiB part (its rate does not depend on size).
        part = data[: max(1, 64 * MIB // (side * data.element_size()))]
        part_bytes = part.numel() * part.element_size()
        slow = (
            _best(lambda p=part, g=data.shape: reference.checksum(p, g, (0, 0)), repeats=1)
            * nbytes
            / part_bytes
        )
        records["checksum"].append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "bytes": nbytes,
                "kernel_gbps": nbytes / fast / 1e9,
                "reference_gbps": nbytes / slow / 1e9,
                "speedup": slow / fast,
                "of_peak": nbytes / fast / peak if peak else None,
            }
        )
        rows.append(
            [
                f"{nbytes // MIB} MiB {str(dtype).removeprefix('torch.')} tensor",
                "checksum",
                f"{nbytes / fast / 1e9:.2f}",
                f"{nbytes / slow / 1e9:.2f} (torch ref)",
                f"{slow / fast:.1f}x",
                f"{nbytes / fast / memcpy:.0%}",
                f"{nbytes / fast / peak:.0%}" if peak else "-",
            ]
        )
        del data
    print(
        f"memcpy (torch copy_): {memcpy / 1e9:.2f} GB/s"
        + (f", peak {peak / 1e9:.0f} GB/s (catalog: {matched[0]})" if matched else "")
    )
    _report.print_table(
        ["case", "op", "kernel GB/s", "per-slice GB/s", "speedup", "of memcpy", "of peak"], rows
    )
    print(f"wrote {_report.write('kernels' if device == 'cpu' else 'kernels_cuda', records)}")


if __name__ == "__main__":
    main()
