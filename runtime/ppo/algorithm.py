"""The PPO algorithm on token tensors: rewards with a KL penalty, GAE, the clipped losses.

Everything here is a pure function of ``(batch, response_length)`` tensors and a 0/1 ``mask`` of
real response tokens, so the same code serves the local trainer and the distributed one and is
checked against hand-computed numbers. Conventions (those of Ziegler et al. 2019 and Ouyang et al.
2022):

- each response token is an action; its reward is ``-kl_coef * (log π(a) - log π_ref(a))``, plus
  the sequence's score on the last real token;
- advantages come from generalized advantage estimation over the response, with no bootstrap
  after its last token; returns are advantages plus values;
- the policy loss is PPO's clipped surrogate, the value loss the clipped squared error, both
  averaged over real tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PPOConfig:
    """Hyper-parameters of the PPO update."""

    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
    """GAE's lambda: 0 is one-step TD, 1 is Monte Carlo."""
    clip_ratio: float = 0.2
    """The policy ratio is clipped to ``[1 - clip_ratio, 1 + clip_ratio]``."""
    value_clip: float = 0.2
    """New values may move at most this far from the rollout's values before the loss clips."""
    kl_coef: float = 0.05
    """Initial (or fixed) weight of the per-token KL penalty against the reference."""
    kl_target: float | None = None
    """None: the KL weight stays fixed; a number: the adaptive controller steers KL to it."""
    kl_horizon: int = 10_000
    """The adaptive controller's horizon, in samples."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the policy loss."""
    epochs: int = 2
    """Passes over each rollout batch."""
    minibatch_size: int = 16
    """Sequences per optimizer step."""
    whiten_advantages: bool = True
    """Normalize advantages to zero mean and unit variance over the batch's real tokens."""

    def __post_init__(self) -> None:
        for field in ("gamma", "lam"):
            if not 0 <= getattr(self, field) <= 1:
                raise ValueError(f"{field}: must be in [0, 1], got {getattr(self, field)}")
        for field in ("clip_ratio", "value_clip"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field}: must be positive, got {getattr(self, field)}")
        for field in ("kl_coef", "entropy_coef"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field}: must not be negative, got {getattr(self, field)}")
        if self.kl_target is not None and not self.kl_target > 0:
            raise ValueError(f"kl_target: must be positive or None, got {self.kl_target}")
        for field in ("kl_horizon", "epochs", "minibatch_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}: must be at least 1, got {getattr(self, field)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is 1."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``values`` shifted and scaled to zero mean and unit variance over the masked positions."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards and the per-token KL estimate ``log π - log π_ref`` (both masked)."""
    kl = (logprobs - ref_logprobs) * mask
    rewards = -kl_coef * kl
    # The last real token is where the running count of real tokens first reaches its total.
    last = mask.long().cumsum(dim=1).argmax(dim=1, keepdim=True)
    rewards = rewards.scatter_add(1, last, scores[:, None].to(rewards.dtype))
    return rewards * mask, kl


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimates and returns of right-padded responses.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, with
    ``V`` and ``A`` taken as 0 past a response's last real token.
    """
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value, next_advantage = values[:, t], advantages[:, t]
    return advantages, (advantages + values) * mask


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate loss and the fraction of tokens where clipping was active. The
    ratio is taken only where ``mask`` is set: a pad position's log-probs may be anything, and
    an overflowing ``exp`` there times its zero mask would be NaN in the loss and gradients."""
    ratio = torch.exp(torch.where(mask.bool(), logprobs - old_logprobs, 0.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio, 1 + clip_ratio)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    value_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half the clipped squared error of the values, and the fraction of tokens clipped."""
    moved = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped = (values - returns) ** 2
    clipped = (moved - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask)


def tempered(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``logits`` as fp32, divided by the sampling temperature: the distribution the responses
    were drawn from, which the ratio, the KL and the entropy must all be taken under (greedy
    decoding, temperature 0, has no such distribution: its logits are taken as they are)."""
    logits = logits.float()
    return logits if temperature in (0, 1) else logits / temperature


def entropy(logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean entropy of the ``(batch, seq, vocab)`` distributions over the masked positions."""
    logp = tempered(logits, temperature).log_softmax(dim=-1)
    return masked_mean(-(logp.exp() * logp).sum(dim=-1), mask)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each of ``tokens`` (``(batch, seq)``) under ``(batch, seq, vocab)``
    logits at the sampling ``temperature``."""
    logp = tempered(logits, temperature).log_softmax(dim=-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1)


class FixedKLController:
    """A constant KL weight."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, num_samples: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller: steers the observed KL towards a target.

    ``e = clip(KL / target - 1, -0.2, 0.2)`` and ``beta <- beta * (1 + e * n / horizon)`` after a
    batch of ``n`` samples.
    """

    def __init__(self, kl_coef: float, *, target: float, horizon: int):
        self.value = kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, num_samples: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * num_samples / self.horizon


def kl_controller(config: PPOConfig) -> FixedKLController | AdaptiveKLController:
    """The controller ``config`` asks for: adaptive when it names a KL target."""
    if config.kl_target is None:
        return FixedKLController(config.kl_coef)
    return AdaptiveKLController(config.kl_coef, target=config.kl_target, horizon=config.kl_horizon)


def minibatches(
    batch_size: int, *, minibatch_size: int, epochs: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Row indices of each minibatch: every epoch is a fresh shuffle cut into equal parts.

    A last part smaller than ``minibatch_size`` is kept, so every sequence counts every epoch.
    """
    for _ in range(epochs):
        yield from torch.randperm(batch_size, generator=generator).split(minibatch_size)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    """What one PPO step reports."""

    step: int
    mean_reward: float
    """Mean sequence score (the task reward, before the KL penalty)."""
    kl: float
    """Mean over sequences of the summed per-token KL to the reference."""
    kl_coef: float
    """The KL weight used for this step's rewards."""
    clip_fraction: float
    """Fraction of tokens where the policy ratio was clipped, over all minibatches."""
    entropy: float
    """Mean per-token entropy of the policy during the update."""
    value_error: float
    """Mean squared error of the critic's values against the returns during the update."""
    policy_loss: float
    value_loss: float
    mean_response_length: float
    """Tokens per response, EOS included."""

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)
