"""What a job asks for: validated, frozen, serialisable to and from JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

JOB_KINDS = ("sft",)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SftJobSpec:
    """Data-parallel supervised fine-tuning of a tiny decoder on a synthetic task.

    The smallest real job the runtime runs: real slots, a real gloo/NCCL group, real gradient
    all-reduce. PPO jobs join it as another kind.
    """

    kind: str = "sft"
    num_slots: int = 2
    """Device slots (data-parallel replicas)."""
    num_steps: int = 30
    micro_batch: int = 16
    """Sequences per slot per step."""
    seq_len: int = 32
    vocab_size: int = 64
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind != "sft":
            raise ValueError(f"kind: expected one of {JOB_KINDS}, got {self.kind!r}")
        _require_range("num_slots", self.num_slots, 1, 64)
        _require_range("num_steps", self.num_steps, 1, 1_000_000)
        _require_range("micro_batch", self.micro_batch, 1, 4096)
        _require_range("seq_len", self.seq_len, 4, 8192)
        _require_range("vocab_size", self.vocab_size, 8, 1_000_000)
        _require_range("num_layers", self.num_layers, 1, 256)
        _require_range("num_heads", self.num_heads, 1, 256)
        _require_range("hidden", self.hidden, 8, 65536)
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden: {self.hidden} is not divisible by num_heads={self.num_heads}"
            )
        if not 0 < self.lr < 1:
            raise ValueError(f"lr: expected 0 < lr < 1, got {self.lr}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SftJobSpec:
        """Build from a JSON object; a bad field raises ValueError naming the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"spec: expected a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field; valid fields: {', '.join(fields)}")
        values = {}
        for name, value in data.items():
            expected = (
                float
                if fields[name].type == "float"
                else int
                if fields[name].type == "int"
                else str
            )
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if isinstance(value, bool) or not isinstance(value, expected):
                raise ValueError(f"{name}: expected {expected.__name__}, got {value!r}")
            values[name] = value
        return cls(**values)


def _require_range(field: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{field}: expected {low} <= {field} <= {high}, got {value}")
