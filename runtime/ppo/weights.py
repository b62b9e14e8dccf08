"""Loading model weights by Hugging Face name from a state dict, a safetensors file or a torch file.

The ``safetensors`` package is not a dependency of the project, so ``.safetensors`` files are read
here directly: the format is an 8-byte little-endian header length, a JSON header mapping each
tensor name to its dtype, shape and byte range, then the raw little-endian data. A folder is read
as the shards of one checkpoint. Anything else is read with ``torch.load(weights_only=True)``,
which accepts only tensors and plain containers.

Loading is strict: every parameter of the model must be present with its exact shape, and the file
must hold nothing else but derived buffers (skipped), so a checkpoint of another architecture
fails with the tensor's name instead of loading half-way. Load before applying tensor
parallelism: whole tensors are copied.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Older Hugging Face checkpoints store RoPE frequencies as buffers; they are derived, not weights.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint does not fit the model; the message names the tensor."""


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file, on the CPU.

    The file is memory-mapped copy-on-write: tensors are views of the mapping, so pages are read
    when a tensor is first used and the file is never held twice in memory.
    """
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    if len(mapped) < 8:
        raise CheckpointError(f"{path}: too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", mapped[:8])
    try:
        header = json.loads(mapped[8 : 8 + header_len])
    except ValueError as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header: {exc}") from exc
    body_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{name}: unsupported safetensors dtype {entry['dtype']}")
        shape, (start, stop) = entry["shape"], entry["data_offsets"]
        size = math.prod(shape) * dtype.itemsize
        if stop - start != size or body_start + stop > len(mapped):
            raise CheckpointError(f"{name}: byte range [{start}, {stop}) does not hold {shape}")
        if size == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(
            mapped, dtype=dtype, count=math.prod(shape), offset=body_start + start
        )
        tensors[name] = flat.reshape(shape)
    return tensors


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` file, a folder of them (a sharded Hugging Face
    checkpoint), or a ``torch.save``-d mapping of tensors."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no .safetensors files in this folder")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            for name, tensor in read_safetensors(file).items():
                if name in state:
                    raise CheckpointError(f"{name}: found in more than one file under {path}")
                state[name] = tensor
        return state
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return dict(state)


def unexpected_keys(state: Mapping[str, torch.Tensor], expected: Mapping) -> list[str]:
    """The keys of ``state`` that are not in ``expected``, sorted, but for derived buffers (RoPE
    frequencies), which a checkpoint may hold and a load skips."""
    return sorted(
        key for key in state if key not in expected and not key.endswith(_DERIVED_SUFFIXES)
    )


def load_weights(model: nn.Module, source: Mapping[str, torch.Tensor] | str | Path) -> None:
    """Copy every parameter of ``model`` from ``source`` by name, converting to the model's dtype."""
    state = source if isinstance(source, Mapping) else read_state_dict(source)
    expected = model.state_dict()
    unexpected = unexpected_keys(state, expected)
    if unexpected:
        raise CheckpointError(f"{unexpected[0]}: not a parameter of this model")
    for key, target in expected.items():
        if key not in state:
            raise CheckpointError(f"{key}: missing from the checkpoint")
        if tuple(state[key].shape) != tuple(target.shape):
            raise CheckpointError(
                f"{key}: checkpoint shape {tuple(state[key].shape)} does not match the model's "
                f"{tuple(target.shape)}"
            )
    with torch.no_grad():
        for key, target in expected.items():
            target.copy_(state[key].to(target.dtype))


def write_safetensors(path: str | Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` as a ``.safetensors`` file (header, then each tensor's raw bytes)."""
    names = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for key, tensor in tensors.items():
        blob = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        header[key] = {
            "dtype": names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))
