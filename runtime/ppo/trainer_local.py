"""PPO in one process: the step loop of actor, critic, reward and reference without Ray.

One step is the three stages Nereus places on slots, run here back to back on one device:

1. generation: the actor samples a response to each prompt (``TorchGenerationBackend``);
2. inference: the programmatic reward scores each response, and the actor, the frozen reference
   and the critic score every response token (log-probabilities and values);
3. training: KL-penalized rewards, GAE, then ``epochs`` passes of minibatch Adam updates of the
   actor (clipped policy loss) and the critic (clipped value loss).

PPO starts from a supervised policy, as in practice: ``warmup_steps`` of teacher-forced training on
the tasks' answers make the actor (and its copy, the reference) answer briefly and end with EOS;
the critic's backbone starts from the actor's. Every random draw comes from a generator seeded
from ``seed``, so a run is reproducible.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from runtime.planner.catalog import ModelConfig
from runtime.ppo import algorithm as ppo
from runtime.ppo.algorithm import PPOConfig, StepStats
from runtime.ppo.generate import Rollout, SamplingParams, TorchGenerationBackend, left_pad
from runtime.ppo.model import LlamaForCausalLM, build_model
from runtime.ppo.tasks import EOS, PAD, TaskSet, reward_function


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LocalTrainerConfig:
    """A single-process PPO run."""

    model: ModelConfig
    """Architecture of all four models (the tiny catalog entries run in seconds on a CPU)."""
    tasks: TaskSet
    reward: str
    """A name ``runtime.ppo.tasks.reward_function`` knows."""
    sampling: SamplingParams
    """How the actor samples; its seed is replaced by one derived from ``seed`` and the step."""
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    batch_size: int = 32
    """Prompts per step."""
    actor_lr: float = 1e-3
    critic_lr: float = 1e-3
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    """Supervised steps on the tasks' answers before PPO starts."""
    warmup_lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        reward_function(self.reward, max_new_tokens=self.sampling.max_new_tokens)
        if self.tasks.vocab_size != self.model.vocab_size:
            raise ValueError(
                f"tasks.vocab_size: {self.tasks.vocab_size} != the model's {self.model.vocab_size}"
            )
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be at least 1, got {self.batch_size}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must not be negative, got {self.warmup_steps}")


def _step_seed(seed: int, step: int, stream: int) -> int:
    # Distinct, reproducible seeds per step and per use (prompts, sampling, warm-up batches).
    return (seed * 1_000_003 + step * 8_191 + stream) % 2**63


def supervised_warmup(
    model: LlamaForCausalLM, tasks: TaskSet, *, steps: int, batch_size: int, lr: float, seed: int
) -> float:
    """Teacher-forced training on ``prompt answer EOS`` (loss on answer and EOS); the last loss."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        prompts = tasks.sample(batch_size, seed=_step_seed(seed, step, 2))
        tokens, mask = left_pad(
            [(*p.tokens, *p.answer, EOS) for p in prompts], pad_token_id=PAD, device="cpu"
        )
        # With left padding each row's targets are its last len(answer) + 1 tokens.
        target_len = torch.tensor([len(p.answer) + 1 for p in prompts])
        column = torch.arange(1, tokens.shape[1])
        targets = column[None, :] >= tokens.shape[1] - target_len[:, None]
        logprobs = ppo.token_logprobs(model(tokens, attention_mask=mask)[:, :-1], tokens[:, 1:])
        loss = -ppo.masked_mean(logprobs, targets.float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def response_logprobs(model: nn.Module, rollout: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities ``(batch, response_length)`` of the rollout's response tokens at the
    sampling ``temperature``."""
    logits = model(rollout.sequences, attention_mask=rollout.attention_mask)
    start = rollout.prompt_length - 1
    return ppo.token_logprobs(logits[:, start:-1], rollout.response_tokens, temperature)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Experience:
    """One step's rollout with what inference and GAE computed for it, all ``(batch, response)``."""

    rollout: Rollout
    mask: torch.Tensor
    """1.0 on real response tokens."""
    old_logprobs: torch.Tensor
    """The actor's log-probabilities before the update (the ratio's denominator)."""
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


class LocalPPOTrainer:
    """Actor, reference and critic in one process, stepped by ``step()``."""

    def __init__(self, config: LocalTrainerConfig):
        self.config = config
        self.actor = build_model(config.model, scalar_head=False, seed=config.seed)
        self.warmup_loss = supervised_warmup(
            self.actor,
            config.tasks,
            steps=config.warmup_steps,
            batch_size=config.batch_size,
            lr=config.warmup_lr,
            seed=config.seed,
        )
        self.reference = copy.deepcopy(self.actor).requires_grad_(False)
        self.critic = build_model(config.model, scalar_head=True, seed=config.seed + 1)
        self.critic.model.load_state_dict(self.actor.model.state_dict())
        # The backend shares the actor's parameters, so no weight sync is needed in one process.
        self.backend = TorchGenerationBackend(self.actor, pad_token_id=PAD)
        self.reward = reward_function(config.reward, max_new_tokens=config.sampling.max_new_tokens)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=config.actor_lr)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=config.critic_lr)
        self.kl_controller = ppo.kl_controller(config.ppo)
        self.shuffle = torch.Generator().manual_seed(config.seed)
        self.step_index = 0

    def run(self, num_steps: int) -> list[StepStats]:
        return [self.step() for _ in range(num_steps)]

    def step(self) -> StepStats:
        """One PPO step: generate, score, estimate advantages, update; returns its statistics."""
        config, step = self.config, self.step_index
        prompts = config.tasks.sample(config.batch_size, seed=_step_seed(config.seed, step, 0))
        params = dataclasses.replace(config.sampling, seed=_step_seed(config.seed, step, 1))
        rollout = self.backend.generate([p.tokens for p in prompts], params)
        scores = torch.tensor(
            [self.reward(p, r) for p, r in zip(prompts, rollout.responses(), strict=True)]
        )
        kl_coef = self.kl_controller.value
        experience, kl = self._experience(rollout, scores, kl_coef)
        totals = self._update(experience)
        mean_kl = float(kl.sum(dim=1).mean())
        self.kl_controller.update(mean_kl, config.batch_size)
        self.step_index += 1
        return StepStats(
            step=step,
            mean_reward=float(scores.mean()),
            kl=mean_kl,
            kl_coef=kl_coef,
            mean_response_length=float(rollout.response_lengths.float().mean()),
            **totals,
        )

    @torch.no_grad()
    def _experience(
        self, rollout: Rollout, scores: torch.Tensor, kl_coef: float
    ) -> tuple[Experience, torch.Tensor]:
        """The inference stage and GAE: what the update needs, and the per-token KL."""
        mask = rollout.response_mask.float()
        temperature = self.config.sampling.temperature
        old_logprobs = response_logprobs(self.actor, rollout, temperature)
        ref_logprobs = response_logprobs(self.reference, rollout, temperature)
        old_values = self._values(rollout)
        rewards, kl = ppo.kl_penalized_rewards(
            scores, old_logprobs, ref_logprobs, mask, kl_coef=kl_coef
        )
        advantages, returns = ppo.gae(
            rewards, old_values, mask, gamma=self.config.ppo.gamma, lam=self.config.ppo.lam
        )
        if self.config.ppo.whiten_advantages:
            advantages = ppo.masked_whiten(advantages, mask)
        experience = Experience(
            rollout=rollout,
            mask=mask,
            old_logprobs=old_logprobs,
            old_values=old_values,
            advantages=advantages,
            returns=returns,
        )
        return experience, kl

    def _values(self, rollout: Rollout, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        # The value of response token t is the critic's output where that token is predicted.
        start = rollout.prompt_length - 1
        values = self.critic(rollout.sequences[rows], attention_mask=rollout.attention_mask[rows])
        return values[:, start:-1]

    def _update(self, experience: Experience) -> dict[str, float]:
        """The training stage: epochs of minibatch updates; the mean of each statistic."""
        config = self.config.ppo
        totals: dict[str, float] = {}
        count = 0
        for rows in ppo.minibatches(
            experience.mask.shape[0],
            minibatch_size=config.minibatch_size,
            epochs=config.epochs,
            generator=self.shuffle,
        ):
            for key, value in self._minibatch_update(experience, rows).items():
                totals[key] = totals.get(key, 0.0) + value
            count += 1
        return {key: total / count for key, total in totals.items()}

    def _minibatch_update(self, experience: Experience, rows: torch.Tensor) -> dict[str, float]:
        """One Adam step of the actor and one of the critic on the sequences ``rows``."""
        config, rollout = self.config.ppo, experience.rollout
        mask = experience.mask[rows]
        logits = self.actor(rollout.sequences[rows], attention_mask=rollout.attention_mask[rows])
        logits = logits[:, rollout.prompt_length - 1 : -1]
        temperature = self.config.sampling.temperature
        logprobs = ppo.token_logprobs(logits, rollout.response_tokens[rows], temperature)
        policy_loss, clip_fraction = ppo.policy_loss(
            logprobs,
            experience.old_logprobs[rows],
            experience.advantages[rows],
            mask,
            clip_ratio=config.clip_ratio,
        )
        entropy = ppo.entropy(logits, mask, temperature)
        self._optimize(
            self.actor, self.actor_optimizer, policy_loss - config.entropy_coef * entropy
        )
        values = self._values(rollout, rows)
        returns = experience.returns[rows]
        value_loss, _ = ppo.value_loss(
            values, experience.old_values[rows], returns, mask, value_clip=config.value_clip
        )
        self._optimize(self.critic, self.critic_optimizer, value_loss)
        stats = {
            "clip_fraction": clip_fraction,
            "entropy": entropy,
            "value_error": ppo.masked_mean((values - returns) ** 2, mask),
            "policy_loss": policy_loss,
            "value_loss": value_loss,
        }
        return {key: float(value.detach()) for key, value in stats.items()}

    def _optimize(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor
    ) -> None:
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), self.config.max_grad_norm)
        optimizer.step()
