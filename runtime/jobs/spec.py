"""What a job asks for: validated, frozen, serialisable to and from JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from runtime.planner.catalog import CPU_SLOT

JOB_KINDS = ("sft", "ppo", "ppo-sim")
VLLM_NEEDS_GPUS = (
    f"generation_backend: vllm needs GPU slots; this job runs on CPU slots (gpu={CPU_SLOT}): "
    "name a GPU kind in gpu, or use torch"
)
"""A PPO job's ``vllm`` backend on CPU slots, refused at submission (the API, form and CLI)."""


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
            raise ValueError(f"kind: expected one of {', '.join(JOB_KINDS)}, got {self.kind!r}")
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
        _require_range("seed", self.seed, 0, 2**31 - 1)
        self._check_fits()

    def params(self) -> int:
        """The TinyDecoder's parameters (runtime/jobs/sft.py): embedding and head, and per layer
        QKV, output, gate-up and down projections (10 h**2) and two norms."""
        h = self.hidden
        return 2 * self.vocab_size * h + self.num_layers * (10 * h * h + 2 * h) + h

    def slot_bytes(self) -> tuple[int, int]:
        """What training takes on each slot, in fp32 bytes: (weights, gradients and AdamW's two
        moments: 16 per parameter; the activations a step keeps for its backward: about 22
        values per token, layer and hidden unit, as a CPU forward's peak measured (hidden 256,
        4 layers, 64 sequences of 256), and the logits with their gradient)."""
        tokens = self.micro_batch * (self.seq_len - 1)
        activations = tokens * (self.num_layers * 22 * self.hidden + 3 * self.vocab_size) * 4
        return 16 * self.params(), activations

    def _check_fits(self) -> None:
        """A job whose model or micro-batch cannot fit a CPU slot's memory is refused here, as
        a PPO job's is, not when its slots run out of memory (or are killed for it)."""
        from runtime.planner.catalog import ACCELERATORS, CPU_SLOT

        capacity = ACCELERATORS[CPU_SLOT].memory_bytes
        state, activations = self.slot_bytes()
        if state + activations <= capacity:
            return
        gib = 2**30
        said = (
            f"about {(state + activations) / gib:.1f} GiB per slot to train "
            f"(weights, gradients and AdamW's state {state / gib:.1f} GiB, activations "
            f"{activations / gib:.1f} GiB), over a CPU slot's {capacity / gib:.0f} GiB"
        )
        if state > capacity / 2:
            raise ValueError(
                f"hidden: the model of hidden={self.hidden}, num_layers={self.num_layers} and "
                f"vocab_size={self.vocab_size} needs {said}"
            )
        raise ValueError(
            f"micro_batch: {self.micro_batch} sequences of seq_len={self.seq_len} need {said}"
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SftJobSpec:
        """Build from a JSON object; a bad field raises ValueError naming the field."""
        return cls(**_typed_fields(cls, data))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PpoSimJobSpec:
    """A PPO job on the simulated cluster: the real controller, planner and transitions against
    ``SimulatedEngine`` and a generated trace, paced so that a person can watch and approve.
    Everything it reports is labelled simulated."""

    kind: str = "ppo-sim"
    model: str = "llama-3.1-8b"
    gpu: str = "h100-sxm"
    gpus: int = 16
    """Slots at the start; the trace's spot-like pool changes it."""
    trace: str = "growth"
    """A trace shape of ``runtime/engine/traces.py``."""
    trace_hours: float = 2.0
    """Simulated hours over which the pool changes."""
    num_steps: int = 120
    seed: int = 0
    pace_s: float = 0.25
    """Wall seconds between steps."""
    policy: dict = dataclasses.field(default_factory=dict)
    """The controller policy (``runtime/control/policy.py``): thresholds, gamma, approval, ..."""

    def __post_init__(self) -> None:
        from runtime.engine.traces import MAX_GPUS, SHAPES, min_steps
        from runtime.planner.catalog import CatalogError, default_catalog

        if self.kind != "ppo-sim":
            raise ValueError(f"kind: expected one of {', '.join(JOB_KINDS)}, got {self.kind!r}")
        catalog = default_catalog()
        for field, lookup in (("model", catalog.model), ("gpu", catalog.accelerator)):
            try:
                lookup(getattr(self, field))
            except CatalogError as exc:  # it names the field already ("model: unknown ...")
                raise ValueError(str(exc)) from None
        if self.trace not in SHAPES:
            raise ValueError(f"trace: expected one of {', '.join(SHAPES)}, got {self.trace!r}")
        _require_range("gpus", self.gpus, 1, MAX_GPUS)
        _require_range("num_steps", self.num_steps, min_steps(self.trace), 100_000)
        _require_range("seed", self.seed, 0, 2**31 - 1)
        if not 0 <= self.pace_s <= 60:
            raise ValueError(f"pace_s: expected 0 <= pace_s <= 60, got {self.pace_s}")
        if not 0 < self.trace_hours <= 1000:
            raise ValueError(
                f"trace_hours: expected 0 < trace_hours <= 1000, got {self.trace_hours}"
            )
        _check_policy(self.policy)
        _check_sim_fits(self)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "policy": dict(self.policy)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PpoSimJobSpec:
        return cls(**_typed_fields(cls, data))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PpoJobSpec:
    """PPO on CPU slots (or GPUs) through the Ray engine: actor, critic, reference and reward on
    their own units, the controller replanning between steps, transitions moving real state.

    ``revoke_at_step`` and ``grant_at_step`` play a cluster's moves during the run (a slot taken
    away, one given): -1 leaves the pool alone."""

    kind: str = "ppo"
    model: str = "tiny-sft"
    tasks: str = "copy"
    """Comma-separated task names of ``runtime/ppo/tasks.py``."""
    reward: str = "length"
    num_slots: int = 4
    """Slots the job starts with."""
    max_slots: int = 5
    """Slot processes started (the pool a grant draws from)."""
    num_steps: int = 30
    batch_size: int = 16
    minibatch_size: int = 8
    """Sequences per optimizer step (PPO cuts each step's batch into minibatches)."""
    max_new_tokens: int = 24
    warmup_steps: int = 30
    checkpoint_every: int = 5
    revoke_at_step: int = -1
    grant_at_step: int = -1
    seed: int = 0
    pace_s: float = 0.0
    """Wall seconds between steps (for watching)."""
    gpu: str = CPU_SLOT
    """The slots' accelerator, a catalog name: ``cpu-slot`` (the default), a CPU process standing
    in for a GPU, the group over gloo; any other (``h100-sxm``, ``h200``, ...), one GPU of that
    kind per slot, the group over NCCL, which the Ray cluster must have. The planner plans for it
    and calibrates against it."""
    generation_backend: str = "torch"
    """How the actor's generation units sample: ``torch`` (the default: the units' own model, any
    layout, CPU or GPU slots) or ``vllm`` (a vLLM engine per one-slot generation unit, fed the
    actor's weights each step: GPU slots only, with vLLM installed, the ``gpu`` extra)."""
    policy: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        from runtime.planner.catalog import CatalogError, default_catalog

        if self.kind != "ppo":
            raise ValueError(f"kind: expected one of {', '.join(JOB_KINDS)}, got {self.kind!r}")
        try:
            default_catalog().accelerator(self.gpu)
        except CatalogError as exc:  # it names the field already ("gpu: unknown ...")
            raise ValueError(str(exc)) from None
        _require_range("num_slots", self.num_slots, 1, 64)
        _require_range("max_slots", self.max_slots, self.num_slots, 64)
        _require_range("num_steps", self.num_steps, 1, 1_000_000)
        _require_range("batch_size", self.batch_size, 1, 65_536)
        _require_range("minibatch_size", self.minibatch_size, 1, self.batch_size)
        _require_range("max_new_tokens", self.max_new_tokens, 1, 32_768)
        _require_range("warmup_steps", self.warmup_steps, 0, 1_000_000)
        _require_range("checkpoint_every", self.checkpoint_every, 0, 1_000_000)
        _require_range("seed", self.seed, 0, 2**31 - 1)
        for field in ("revoke_at_step", "grant_at_step"):
            _require_range(field, getattr(self, field), -1, self.num_steps - 1)
        if self.revoke_at_step >= 0 and self.num_slots < 2:
            raise ValueError("revoke_at_step: a job on one slot has none to give up")
        if not 0 <= self.pace_s <= 60:
            raise ValueError(f"pace_s: expected 0 <= pace_s <= 60, got {self.pace_s}")
        config = self.job_config()
        config.validate()  # names an unknown generation_backend
        if self.generation_backend == "vllm" and not self.uses_gpus:
            raise ValueError(VLLM_NEEDS_GPUS)
        _check_policy(self.policy)
        _check_fits(config, self.num_slots, self.gpu)

    @property
    def uses_gpus(self) -> bool:
        """Whether each slot is a GPU (else a CPU process standing in for one)."""
        return self.gpu != CPU_SLOT

    def check_pool(self, slots: Any) -> None:
        """Refuse, naming ``slots``, a pool this job cannot run on: not a whole number from 1 to
        ``max_slots``, or one its models fit in no layout (an operator's resize)."""
        if (
            isinstance(slots, bool)
            or not isinstance(slots, int)
            or not 1 <= slots <= self.max_slots
        ):
            raise ValueError(
                f"slots: expected a whole number from 1 to the job's max_slots "
                f"({self.max_slots}), got {slots!r}"
            )
        try:
            _check_fits(self.job_config(), slots, self.gpu)
        except ValueError as exc:
            raise ValueError(f"slots: {str(exc).partition(': ')[2]}") from None

    def job_config(self):
        """The PPO runtime's configuration (``runtime.ppo.job.PpoJobConfig``)."""
        from runtime.ppo.algorithm import PPOConfig
        from runtime.ppo.job import PpoJobConfig

        return PpoJobConfig(
            ppo=PPOConfig(kl_coef=0.01, epochs=2, minibatch_size=self.minibatch_size),
            model=self.model,
            tasks=tuple(t.strip() for t in self.tasks.split(",") if t.strip()),
            reward=self.reward,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            warmup_steps=self.warmup_steps,
            checkpoint_every=self.checkpoint_every,
            generation_backend=self.generation_backend,
            seed=self.seed,
        )

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "policy": dict(self.policy)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PpoJobSpec:
        return cls(**_typed_fields(cls, data))


def spec_from_json(data: Any) -> SftJobSpec | PpoJobSpec | PpoSimJobSpec:
    """A job spec of the kind ``data`` names (default ``sft``); errors name the field."""
    if not isinstance(data, Mapping):
        raise ValueError(f"spec: expected a JSON object, got {type(data).__name__}")
    kind = data.get("kind", "sft")
    if kind == "ppo-sim":
        return PpoSimJobSpec.from_json(data)
    if kind == "ppo":
        return PpoJobSpec.from_json(data)
    return SftJobSpec.from_json(data)


def _typed_fields(cls, data: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"spec: expected a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field; valid fields: {', '.join(fields)}")
    types = {"float": float, "int": int, "str": str, "dict": dict}
    values = {}
    for name, value in data.items():
        expected = types[fields[name].type]
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                raise ValueError(
                    f"{name}: out of range for a number, got an integer that large"
                ) from None
        if isinstance(value, bool) or not isinstance(value, expected):
            raise ValueError(f"{name}: expected {expected.__name__}, got {value!r}")
        values[name] = value
    return values


def _check_fits(config, num_slots: int, gpu: str = CPU_SLOT) -> None:
    """A job whose models cannot fit its slots in any layout is refused at submission, not when
    its first plan is made: the planner's memory model decides, as it will at start."""
    from runtime.planner import PlanningError, default_catalog, plan

    try:
        plan(config.workload(), default_catalog().accelerator(gpu), num_slots)
    except PlanningError as exc:
        slots = f"{num_slots} CPU slots" if gpu == CPU_SLOT else f"{num_slots} × {gpu}"
        raise ValueError(
            f"model: {config.model} does not fit {slots} in any layout ({exc})"
        ) from None


def _check_sim_fits(spec: PpoSimJobSpec) -> None:
    """A simulated job whose model fits its starting pool in no layout is refused at submission
    (it used to be accepted and then fail at its first plan): the controller's own first plan
    on the job's simulated cluster decides, as the form's preview does."""
    from runtime.jobs.sim_job import sim_job_parts
    from runtime.planner import PlanningError

    engine, controller = sim_job_parts(spec)
    try:
        controller.initial_plan(engine)
    except PlanningError as exc:
        raise ValueError(
            f"gpus: no feasible plan for {spec.model} on {spec.gpus} × {spec.gpu} ({exc})"
        ) from None


def _check_policy(policy: dict) -> None:
    """A job's controller policy, checked at submission (errors name the field)."""
    from runtime.control.policy import JobPolicy, PolicyError

    try:
        JobPolicy.from_json(policy)
    except PolicyError as exc:
        raise ValueError(str(exc)) from None


def _require_range(field: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{field}: expected {low} <= {field} <= {high}, got {value}")
