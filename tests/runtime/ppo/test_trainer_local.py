"""The single-process PPO loop learns on tiny models: rewards rise, responses grow, runs repeat."""

import dataclasses
import statistics

import pytest
import torch

from runtime.planner.catalog import default_catalog
from runtime.ppo.algorithm import PPOConfig
from runtime.ppo.generate import SamplingParams
from runtime.ppo.tasks import EOS, TaskSet
from runtime.ppo.trainer_local import LocalPPOTrainer, LocalTrainerConfig

MODEL = default_catalog().model("tiny-sft")


def _config(reward: str, *, max_new_tokens: int, **overrides) -> LocalTrainerConfig:
    values = {
        "model": MODEL,
        "tasks": TaskSet(tasks=("copy",), vocab_size=MODEL.vocab_size),
        "reward": reward,
        "sampling": SamplingParams(max_new_tokens=max_new_tokens, eos_token_id=EOS),
        "ppo": PPOConfig(kl_coef=0.01, epochs=2, minibatch_size=16),
        "batch_size": 32,
        "warmup_steps": 60,
        **overrides,
    }
    return LocalTrainerConfig(**values)


def _mean(stats, field: str) -> float:
    return statistics.fmean(getattr(s, field) for s in stats)


def test_length_reward_makes_responses_grow():
    trainer = LocalPPOTrainer(_config("length", max_new_tokens=16))
    stats = trainer.run(30)
    first, last = stats[:5], stats[-5:]
    # The supervised start answers 1-3 symbols and EOS; the length reward pushes EOS away.
    assert _mean(first, "mean_response_length") < 5
    assert _mean(last, "mean_response_length") > 2 * _mean(first, "mean_response_length")
    assert _mean(last, "mean_reward") > _mean(first, "mean_reward") + 0.3
    assert _mean(last, "kl") > _mean(first, "kl"), "the policy moved away from the reference"
    assert all(0 <= s.clip_fraction <= 1 and s.entropy > 0 for s in stats)


def test_correctness_reward_rises():
    trainer = LocalPPOTrainer(_config("correct", max_new_tokens=8, warmup_steps=30))
    stats = trainer.run(40)
    assert _mean(stats[-10:], "mean_reward") > _mean(stats[:10], "mean_reward") + 0.1


def test_a_run_repeats_exactly_for_a_seed():
    config = _config("partial", max_new_tokens=6, warmup_steps=5)
    first, again = (LocalPPOTrainer(config).run(3) for _ in range(2))
    assert first == again
    other = LocalPPOTrainer(dataclasses.replace(config, seed=1)).run(3)
    assert other != first


def test_the_adaptive_controller_steers_the_kl_weight_each_step():
    ppo = PPOConfig(kl_coef=0.1, kl_target=0.01, kl_horizon=100)
    trainer = LocalPPOTrainer(_config("length", max_new_tokens=8, warmup_steps=5, ppo=ppo))
    stats = trainer.run(4)
    # Step 0's KL is 0 (actor = reference): error -0.2, weight * (1 - 0.2 * 32/100) = 0.0936.
    # Steps 1 and 2 are far above the target: error +0.2, weight * 1.064 each.
    assert stats[0].kl == 0 and stats[1].kl > 0.012 and stats[2].kl > 0.012
    assert [s.kl_coef for s in stats] == pytest.approx(
        [0.1, 0.0936, 0.0936 * 1.064, 0.0936 * 1.064**2]
    )


def test_the_critic_starts_from_the_actor_backbone_and_the_reference_is_frozen():
    trainer = LocalPPOTrainer(_config("length", max_new_tokens=4, warmup_steps=3))
    actor, critic = trainer.actor.model.state_dict(), trainer.critic.model.state_dict()
    assert all(torch.equal(actor[k], critic[k]) for k in actor)
    reference = {k: v.clone() for k, v in trainer.reference.state_dict().items()}
    trainer.run(1)
    assert all(torch.equal(reference[k], v) for k, v in trainer.reference.state_dict().items())
    assert not torch.equal(trainer.actor.lm_head.weight, reference["lm_head.weight"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"reward": "speed"}, "reward: unknown reward"),
        ({"tasks": TaskSet(tasks=("copy",), vocab_size=512)}, "tasks.vocab_size: 512"),
        ({"batch_size": 0}, "batch_size:"),
        ({"warmup_steps": -1}, "warmup_steps:"),
    ],
)
def test_bad_trainer_config_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(_config("length", max_new_tokens=4), **overrides)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_old_logprobs_are_those_of_the_distribution_the_responses_were_sampled_from(temperature):
    """At a temperature other than 1 the responses come from the tempered policy, so the ratio's
    denominator, the KL and the entropy must be taken under it too (found by review: they were
    untempered, and the first update's ratio was not 1)."""
    sampling = SamplingParams(max_new_tokens=6, eos_token_id=EOS, temperature=temperature)
    trainer = LocalPPOTrainer(
        _config("length", max_new_tokens=6, warmup_steps=3, sampling=sampling)
    )
    prompts = trainer.config.tasks.sample(8, seed=5)
    rollout = trainer.backend.generate(
        [p.tokens for p in prompts], dataclasses.replace(sampling, seed=2)
    )
    experience, kl = trainer._experience(rollout, torch.zeros(8), kl_coef=0.1)
    mask = experience.mask.bool()
    torch.testing.assert_close(
        experience.old_logprobs[mask], rollout.logprobs[mask], atol=1e-5, rtol=1e-4
    )
    assert float(kl.abs().max()) == 0.0  # the actor is still the reference
