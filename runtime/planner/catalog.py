"""Catalogs of accelerators and models, built in and extendable from a YAML or JSON file.

Accelerator figures are vendor peaks (dense bf16, HBM capacity and bandwidth, per-direction link
bandwidth per GPU); the planner never trusts them as achieved rates: the cost model multiplies each
operation class by an efficiency that calibration learns from the running job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.planner.plan import shown

GIB = 2**30
GB = 10**9
MAX_COUNT = 2**53
"""The largest integer a catalog field may hold (every count is used in float arithmetic)."""


class CatalogError(ValueError):
    """A catalog entry or file is malformed; the message names the field."""


def finite_number(value: Any, where: str) -> float:
    """``value`` as a float, or ``CatalogError`` naming ``where`` unless it is a number (not a
    bool) that a float holds and that is finite. An int past 1e308 is refused here: ``float()``
    and ``math.isfinite`` raise ``OverflowError`` on it, which would escape as a traceback."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CatalogError(f"{where}: must be a finite number, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise CatalogError(f"{where}: too large for a number ({shown(value)})") from None
    if not math.isfinite(number):
        raise CatalogError(f"{where}: must be a finite number, got {shown(value)}")
    return number


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Accelerator:
    """One kind of device slot and the links between slots."""

    name: str
    peak_flops: float
    """Dense bf16 FLOP/s."""
    memory_bytes: float
    memory_bandwidth: float
    """HBM bytes/s."""
    intra_node_bandwidth: float
    """Per-GPU, per-direction bytes/s inside a node (NVLink, Infinity Fabric)."""
    intra_node_latency: float
    """Seconds per message inside a node."""
    inter_node_bandwidth: float
    """Per-GPU, per-direction bytes/s between nodes (InfiniBand, RoCE)."""
    inter_node_latency: float
    gpus_per_node: int

    def __post_init__(self) -> None:
        for field in (
            "peak_flops",
            "memory_bytes",
            "memory_bandwidth",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            "intra_node_latency",
            "inter_node_latency",
        ):
            finite_number(getattr(self, field), f"{self.name}.{field}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int):
            raise CatalogError(
                f"{self.name}.gpus_per_node: must be an integer, got {self.gpus_per_node!r}"
            )
        for field in (
            "peak_flops",
            "memory_bytes",
            "memory_bandwidth",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
        ):
            if not getattr(self, field) > 0:
                raise CatalogError(
                    f"{self.name}.{field}: must be positive, got {getattr(self, field)}"
                )
        for field in ("intra_node_latency", "inter_node_latency"):
            if getattr(self, field) < 0:
                raise CatalogError(f"{self.name}.{field}: must not be negative")
        n = self.gpus_per_node
        if n < 1 or n & (n - 1):
            raise CatalogError(f"{self.name}.gpus_per_node: must be a power of two, got {n}")

    def link(self, num_slots_spanned: int) -> str:
        """``intra`` when a group of this many slots is placed inside one node, else ``inter``.

        Placement aligns a group whose size is a power of two up to a node to a multiple of its
        size, so such a group never straddles nodes; any other size may, and is priced as inter-node.
        """
        n = num_slots_spanned
        return "intra" if n <= self.gpus_per_node and n & (n - 1) == 0 else "inter"

    def bandwidth(self, link: str) -> float:
        return self.intra_node_bandwidth if link == "intra" else self.inter_node_bandwidth

    def latency(self, link: str) -> float:
        return self.intra_node_latency if link == "intra" else self.inter_node_latency


ROPE_SCALING_TYPES = ("llama3",)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Hugging Face's ``rope_scaling`` with ``rope_type``
    ``llama3``): wavelengths longer than ``original_max_position_embeddings / low_freq_factor``
    are stretched ``factor`` times, those shorter than ``... / high_freq_factor`` are kept, and
    those between are blended. The only kind the model layer implements; others are refused."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        _check_rope_type(self.rope_type)
        for field in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, field)
            if not finite_number(value, f"rope_scaling.{field}") > 0:
                raise CatalogError(
                    f"rope_scaling.{field}: must be a positive number, got {shown(value)}"
                )
        if self.factor < 1:
            raise CatalogError(f"rope_scaling.factor: must be at least 1, got {self.factor}")
        if not self.low_freq_factor < self.high_freq_factor:
            raise CatalogError(
                f"rope_scaling.high_freq_factor: must exceed low_freq_factor="
                f"{self.low_freq_factor}, got {self.high_freq_factor}"
            )
        value = self.original_max_position_embeddings
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            raise CatalogError(
                "rope_scaling.original_max_position_embeddings: must be a positive integer "
                f"up to {MAX_COUNT}, got {shown(value)}"
            )

    @classmethod
    def from_hf(cls, data: Any) -> RopeScaling | None:
        """Parse Hugging Face's ``rope_scaling`` (``null``, or a mapping whose ``rope_type``, or
        older ``type``, says which); a bad one raises CatalogError naming the field."""
        if data is None:
            return None
        if not isinstance(data, Mapping):
            raise CatalogError(f"rope_scaling: must be a mapping or null, got {data!r}")
        kind = data.get("rope_type", data.get("type"))
        if kind == "default":
            return None
        _check_rope_type(kind)  # before the fields: another kind has other ones
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "rope_type"]
        missing = [f for f in fields if f not in data]
        if missing:
            raise CatalogError(f"rope_scaling.{missing[0]}: required field is missing")
        return cls(rope_type=kind, **{f: data[f] for f in fields})

    def to_hf(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_rope_type(kind: Any) -> None:
    if kind not in ROPE_SCALING_TYPES:
        raise CatalogError(
            f"rope_scaling.rope_type: {kind!r} is not implemented; "
            f"supported: {', '.join(ROPE_SCALING_TYPES)}"
        )


LLAMA_3_1_ROPE = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """A Llama-architecture decoder (grouped-query attention, SwiGLU MLP, RMSNorm)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    rope_theta: float = 10_000.0
    """Hugging Face's ``config.json`` field (Llama 3 uses 500000.0); the planner never reads it,
    the model layer and the export do."""
    rms_norm_eps: float = 1e-5
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's long-context RoPE scaling where the model has it."""

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_COUNT:
                raise CatalogError(
                    f"{self.name}.{field}: must be a positive integer up to {MAX_COUNT}, "
                    f"got {shown(value)}"
                )
        if self.hidden_size % self.num_heads:
            raise CatalogError(
                f"{self.name}.hidden_size: {self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        for field in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, field)
            if not finite_number(value, f"{self.name}.{field}") > 0:
                raise CatalogError(
                    f"{self.name}.{field}: must be a positive number, got {shown(value)}"
                )
        if not isinstance(self.rope_scaling, RopeScaling | None):
            # Hugging Face's mapping, as a catalog file or a job's JSON record holds it.
            try:
                object.__setattr__(self, "rope_scaling", RopeScaling.from_hf(self.rope_scaling))
            except CatalogError as exc:
                raise CatalogError(f"{self.name}.{exc}") from None
        if self.num_heads % self.num_kv_heads:
            raise CatalogError(
                f"{self.name}.num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        h, kv = self.hidden_size, self.kv_dim
        attention = h * h + 2 * h * kv + h * h + (h + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size
        return attention + mlp + 2 * h  # two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self, *, scalar_head: bool = False) -> int:
        """The output head: the LM head (vocab logits) or a scalar head (critic value, reward)."""
        if scalar_head:  # Hugging Face's ``score``: Linear(hidden, 1, bias=False)
            return self.hidden_size
        return 0 if self.tie_embeddings else self.embedding_params

    def num_params(self, *, scalar_head: bool = False) -> int:
        """Total parameters, derived from the configuration."""
        return (
            self.embedding_params
            + self.num_layers * self.params_per_layer
            + self.hidden_size  # final norm
            + self.head_params(scalar_head=scalar_head)
        )


# Published figures used by the tests: parameter totals as the model cards and safetensors give them.
_A100 = Accelerator(
    name="a100-80gb",
    peak_flops=312e12,
    memory_bytes=80 * GIB,
    memory_bandwidth=2.039e12,
    intra_node_bandwidth=300 * GB,
    intra_node_latency=3e-6,
    inter_node_bandwidth=25 * GB,
    inter_node_latency=8e-6,
    gpus_per_node=8,
)
_H100 = Accelerator(
    name="h100-sxm",
    peak_flops=989e12,
    memory_bytes=80 * GIB,
    memory_bandwidth=3.35e12,
    intra_node_bandwidth=450 * GB,
    intra_node_latency=3e-6,
    inter_node_bandwidth=50 * GB,
    inter_node_latency=6e-6,
    gpus_per_node=8,
)
_H200 = Accelerator(
    name="h200",
    peak_flops=989e12,
    memory_bytes=141 * GB,
    memory_bandwidth=4.8e12,
    intra_node_bandwidth=450 * GB,
    intra_node_latency=3e-6,
    inter_node_bandwidth=50 * GB,
    inter_node_latency=6e-6,
    gpus_per_node=8,
)
_MI300X = Accelerator(
    name="mi300x",
    peak_flops=1307e12,
    memory_bytes=192 * GB,
    memory_bandwidth=5.3e12,
    intra_node_bandwidth=224 * GB,
    intra_node_latency=4e-6,
    inter_node_bandwidth=50 * GB,
    inter_node_latency=8e-6,
    gpus_per_node=8,
)
CPU_SLOT = "cpu-slot"
"""The accelerator of a CPU worker process standing in for a GPU on machines without one (the demo
and the tests); figures measured on a 2-core machine: see design/MACHINE_NOTES.md."""
_CPU_SLOT = Accelerator(
    name=CPU_SLOT,
    peak_flops=50e9,
    memory_bytes=4 * GIB,
    memory_bandwidth=14.6e9,
    intra_node_bandwidth=3.5e9,
    intra_node_latency=50e-6,
    inter_node_bandwidth=1e9,
    inter_node_latency=100e-6,
    gpus_per_node=8,
)

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a for a in (_A100, _H100, _H200, _MI300X, _CPU_SLOT)
}

MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig(
            name="llama-3.1-8b",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            rope_theta=500_000.0,
            rope_scaling=LLAMA_3_1_ROPE,
        ),
        ModelConfig(
            name="llama-3.1-70b",
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            rope_theta=500_000.0,
            rope_scaling=LLAMA_3_1_ROPE,
        ),
        ModelConfig(
            name="qwen2.5-7b",
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            qkv_bias=True,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
        ),
        ModelConfig(
            name="qwen2.5-32b",
            vocab_size=152064,
            hidden_size=5120,
            intermediate_size=27648,
            num_layers=64,
            num_heads=40,
            num_kv_heads=8,
            qkv_bias=True,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
        ),
        # The decoder of the CPU demo's SFT job (runtime/jobs/sft.py): 90,432 parameters.
        ModelConfig(
            name="tiny-sft",
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=4,
        ),
        ModelConfig(
            name="tiny-llama",
            vocab_size=512,
            hidden_size=128,
            intermediate_size=352,
            num_layers=8,
            num_heads=8,
            num_kv_heads=4,
        ),
    )
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Catalog:
    """The accelerators and models a planner call may name."""

    accelerators: Mapping[str, Accelerator]
    models: Mapping[str, ModelConfig]

    def accelerator(self, name: str) -> Accelerator:
        try:
            return self.accelerators[str(name).lower()]
        except KeyError:
            raise CatalogError(
                f"gpu: unknown accelerator {name!r}; choose one of {', '.join(sorted(self.accelerators))}"
            ) from None

    def model(self, name: str) -> ModelConfig:
        try:
            return self.models[str(name).lower()]
        except KeyError:
            raise CatalogError(
                f"model: unknown model {name!r}; choose one of {', '.join(sorted(self.models))}"
            ) from None

    def extended(self, path: str | Path) -> Catalog:
        """This catalog plus the entries of a YAML or JSON file (same names replace built-ins)."""
        accelerators, models = load_catalog_file(path)
        return Catalog(
            accelerators={**self.accelerators, **accelerators}, models={**self.models, **models}
        )


def default_catalog() -> Catalog:
    return Catalog(accelerators=dict(ACCELERATORS), models=dict(MODELS))


def load_catalog_file(path: str | Path) -> tuple[dict[str, Accelerator], dict[str, ModelConfig]]:
    """Read ``{"accelerators": {name: {...}}, "models": {name: {...}}}`` from YAML or JSON."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"catalog: cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise CatalogError(
            f"catalog: {path} is not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from None
    try:
        if path.suffix.lower() in {".yaml", ".yml"}:
            data = _yaml_load(text)
        else:
            data = json.loads(text, object_pairs_hook=_json_object)
    except CatalogError:
        raise
    except Exception as exc:  # yaml.YAMLError and json.JSONDecodeError have no common base
        raise CatalogError(
            f"catalog: {path.name} is not valid {path.suffix[1:].upper()}: {exc}"
        ) from exc
    if not isinstance(data, dict):
        raise CatalogError(
            f"catalog: {path.name} must hold a mapping with 'accelerators' and/or 'models'"
        )
    unknown = sorted(set(data) - {"accelerators", "models"})
    if unknown:
        raise CatalogError(
            f"catalog.{unknown[0]}: unknown section; expected 'accelerators' or 'models'"
        )
    accelerators = {
        key: _build(Accelerator, f"accelerators.{name}", name, entry)
        for key, name, entry in _named(data, "accelerators")
    }
    models = {
        key: _build(ModelConfig, f"models.{name}", name, entry)
        for key, name, entry in _named(data, "models")
    }
    return accelerators, models


def _named(data: dict, key: str) -> list[tuple[str, Any, Any]]:
    """A section's entries as (lookup name, name, entry): names are looked up whatever their
    case, so two that differ only in case are the same name, refused rather than one silently
    taking the other's place."""
    seen: dict[str, Any] = {}
    out = []
    for name, entry in _section(data, key).items():
        lookup = str(name).lower()
        if lookup in seen:
            raise CatalogError(
                f"catalog.{key}.{name}: the same name as {seen[lookup]!s} (names ignore case)"
            )
        seen[lookup] = name
        out.append((lookup, name, entry))
    return out


def _json_object(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object, refusing a key given twice (``json`` keeps the last without a word)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise CatalogError(f"catalog: {key!r} is given twice in one object")
        out[key] = value
    return out


def _yaml_load(text: str) -> Any:
    """``yaml.safe_load``, refusing a mapping key written twice (PyYAML keeps the last). The
    keys are checked as written, on the composed document, before merge keys (``<<``) copy
    any: a key a merge brings in and the mapping then sets is an override, not a repeat."""
    import yaml

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    seen_nodes: set[int] = set()
    stack = [root] if root is not None else []
    while stack:  # iterative, each node once: aliases share nodes (and may nest deeply)
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: set[tuple[str, str]] = set()
            for key_node, value_node in node.value:
                stack.extend((key_node, value_node))
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                    continue
                key = (key_node.tag, key_node.value)
                if key in keys:
                    raise CatalogError(
                        f"catalog: {key_node.value!r} is given twice "
                        f"(line {key_node.start_mark.line + 1})"
                    )
                keys.add(key)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return yaml.safe_load(text)


def _section(data: dict, key: str) -> dict:
    section = data.get(key) or {}
    if not isinstance(section, dict):
        raise CatalogError(f"catalog.{key}: must be a mapping of name to entry")
    return section


def _number(value: Any, where: str) -> float:
    # YAML 1.1 (PyYAML) reads 2.25e15 without a '+' or a '.' as text: accept numeric text too.
    number = None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = float(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            raise CatalogError(f"{where}: too large for a number ({shown(value)})") from None
    if number is None:
        raise CatalogError(f"{where}: expected a number, got {shown(value)}")
    if not math.isfinite(number):
        raise CatalogError(f"{where}: expected a finite number, got {shown(value)}")
    return number


def _build(cls, where: str, name: str, entry: Any):
    if not isinstance(entry, dict):
        raise CatalogError(f"{where}: must be a mapping of fields")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "name"}
    unknown = sorted(set(entry) - set(fields))
    if unknown:
        raise CatalogError(
            f"{where}.{unknown[0]}: unknown field; valid fields: {', '.join(fields)}"
        )
    values = {}
    for key, value in entry.items():
        kind = fields[key].type
        if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise CatalogError(f"{where}.{key}: expected an integer, got {shown(value)}")
        if kind == "int" and abs(value) > MAX_COUNT:
            raise CatalogError(f"{where}.{key}: at most {MAX_COUNT}, got {shown(value)}")
        if kind == "float":
            value = _number(value, f"{where}.{key}")
        if kind == "bool" and not isinstance(value, bool):
            raise CatalogError(f"{where}.{key}: expected true or false, got {shown(value)}")
        values[key] = value
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
    missing = [n for n in required if n not in entry]
    if missing:
        raise CatalogError(f"{where}.{missing[0]}: required field is missing")
    try:
        return cls(name=str(name).lower(), **values)
    except CatalogError as exc:
        raise CatalogError(f"{where.split('.')[0]}.{exc}") from None
