"""The work of one PPO step, per model-stage.

PPO has four models (actor, critic, reward, reference) and three stages run in sequence:
generation (the actor samples responses), inference (old log-probabilities from the actor,
reference log-probabilities, critic values, rewards) and training (actor and critic updates).
A model-stage is one model in one stage, named ``model@stage``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from runtime.planner.catalog import ModelConfig

STAGES = ("generation", "inference", "training")
ROLES = ("actor", "critic", "reward", "ref")
MODEL_STAGES: dict[str, tuple[str, ...]] = {
    "generation": ("actor",),
    "inference": ("actor", "ref", "critic", "reward"),
    "training": ("actor", "critic"),
}
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelStage:
    """One model in one stage."""

    role: str
    stage: str
    model: ModelConfig

    @property
    def name(self) -> str:
        return f"{self.role}@{self.stage}"

    @property
    def scalar_head(self) -> bool:
        """Critic and reward models end in a scalar head instead of the vocabulary."""
        return self.role in ("critic", "reward")

    @property
    def num_params(self) -> int:
        return self.model.num_params(scalar_head=self.scalar_head)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PpoWorkload:
    """What one PPO step computes. ``gen_len`` is the signal that drifts during a run."""

    models: Mapping[str, ModelConfig]
    """The model of each role: actor, critic, reward, ref."""
    global_batch: int = 256
    """Sequences (prompt + response) per step."""
    prompt_len: int = 512
    gen_len: int = 2048
    """Generated tokens per response."""
    micro_batch: int = 4
    """Sequences per micro-batch in training and inference: the most a plan gives them."""
    adaptive_micro_batch: bool = True
    """Whether a plan may run training and inference in smaller micro-batches than
    ``micro_batch`` (to fit, or where a pipeline drains faster); False pins them to it."""
    gen_micro_batch: int = 64
    """Sequences per micro-batch in pipeline-parallel generation."""
    ppo_epochs: int = 1
    ppo_minibatches: int = 1
    """Optimizer steps per epoch."""
    precision: str = "bf16"
    recompute: bool = False
    """Full activation recomputation in training: less memory, one more forward pass."""
    distributed_optimizer: bool = False
    """Shard Adam state across data-parallel replicas (ZeRO-1)."""

    def __post_init__(self) -> None:
        missing = [role for role in ROLES if role not in self.models]
        if missing:
            raise ValueError(f"models.{missing[0]}: every role needs a model ({', '.join(ROLES)})")
        for field in (
            "global_batch",
            "prompt_len",
            "gen_len",
            "micro_batch",
            "gen_micro_batch",
            "ppo_epochs",
            "ppo_minibatches",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}: must be a positive integer, got {value!r}")
        if not isinstance(self.adaptive_micro_batch, bool):
            raise ValueError(
                f"adaptive_micro_batch: must be true or false, got {self.adaptive_micro_batch!r}"
            )
        if self.precision not in PRECISION_BYTES:
            raise ValueError(
                f"precision: expected one of {', '.join(PRECISION_BYTES)}, got {self.precision!r}"
            )

    @classmethod
    def for_model(cls, model: ModelConfig, **kwargs) -> PpoWorkload:
        """All four roles on the same architecture (the usual PPO set-up)."""
        return cls(models=dict.fromkeys(ROLES, model), **kwargs)

    @property
    def bytes_per_value(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    def model_stages(self, stage: str | None = None) -> tuple[ModelStage, ...]:
        """The model-stages of one stage, or of the whole step, in generation → training order."""
        stages = STAGES if stage is None else (stage,)
        return tuple(
            ModelStage(role=role, stage=s, model=self.models[role])
            for s in stages
            for role in MODEL_STAGES[s]
        )

    def with_gen_len(self, gen_len: int) -> PpoWorkload:
        return dataclasses.replace(self, gen_len=gen_len)
