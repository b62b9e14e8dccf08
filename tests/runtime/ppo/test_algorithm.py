"""PPO's pieces against numbers computed by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from runtime.ppo.algorithm import (
    AdaptiveKLController,
    FixedKLController,
    PPOConfig,
    entropy,
    gae,
    kl_controller,
    kl_penalized_rewards,
    masked_whiten,
    minibatches,
    policy_loss,
    value_loss,
)


def test_gae_by_hand_with_a_padded_row():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 2.0, 99.0]])
    values = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # Row 0, gamma*lam = 0.72:
    #   t=2: delta = 2 - 1.5 = 0.5                      A = 0.5
    #   t=1: delta = 0 + 0.9*1.5 - 1.0 = 0.35           A = 0.35 + 0.72*0.5 = 0.71
    #   t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4            A = 1.4 + 0.72*0.71 = 1.9112
    # Row 1 ends at t=1 (its pad's reward and value are ignored):
    #   t=1: delta = 2 - 1 = 1                          A = 1
    #   t=0: delta = 1 + 0.9*1 - 0.5 = 1.4              A = 1.4 + 0.72*1 = 2.12
    torch.testing.assert_close(advantages, torch.tensor([[1.9112, 0.71, 0.5], [2.12, 1.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[2.4112, 1.71, 2.0], [2.62, 2.0, 0.0]]))


def test_gae_with_lambda_one_and_gamma_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 3.0]])
    values = torch.tensor([[1.0, 2.0, 0.5]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[2.0, 1.0, 2.5]]))
    torch.testing.assert_close(returns, torch.tensor([[3.0, 3.0, 3.0]]))


def test_clipped_policy_loss_by_hand():
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1, 3.0]]))
    old = torch.zeros(1, 4)
    advantages = torch.tensor([[1.0, 1.0, -2.0, 10.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clip_fraction = policy_loss(logprobs, old, advantages, mask, clip_ratio=0.2)
    # ratio 1.5, A=1:  max(-1.5, -1.2) = -1.2   (clipped)
    # ratio 0.5, A=1:  max(-0.5, -0.8) = -0.5
    # ratio 1.1, A=-2: max(2.2, 2.2)   = 2.2
    # the fourth token is padding.  (-1.2 - 0.5 + 2.2) / 3 = 1/6
    torch.testing.assert_close(loss, torch.tensor(1 / 6))
    torch.testing.assert_close(clip_fraction, torch.tensor(1 / 3))


def test_a_pad_position_whose_log_probs_diverge_leaves_the_loss_and_gradients_finite():
    logprobs = torch.tensor([[-1.0, 500.0]], requires_grad=True)  # exp(500) overflows fp32
    loss, clip_fraction = policy_loss(
        logprobs,
        torch.tensor([[-1.0, 0.0]]),
        torch.ones(1, 2),
        torch.tensor([[1, 0]]),
        clip_ratio=0.2,
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    torch.testing.assert_close(loss, torch.tensor(-1.0))  # the one real token: ratio 1, A = 1
    torch.testing.assert_close(clip_fraction, torch.tensor(0.0))


def test_policy_loss_gradient_vanishes_where_the_ratio_is_clipped():
    logprobs = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()
    loss, _ = policy_loss(
        logprobs, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), clip_ratio=0.2
    )
    loss.backward()
    # d/dlogp of -A*ratio/2 at ratio 0.5 is -0.25; the clipped first token contributes nothing.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.25]]))


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[2.0, 0.0, 1.05]])
    old = torch.tensor([[1.0, 0.5, 1.0]])
    returns = torch.tensor([[3.0, 1.0, 0.0]])
    loss, clip_fraction = value_loss(values, old, returns, torch.ones(1, 3), value_clip=0.2)
    # t0: clipped value 1.2: max((2-3)^2, (1.2-3)^2) = 3.24  (clipped)
    # t1: clipped value 0.3: max((0-1)^2, (0.3-1)^2) = 1
    # t2: within the clip:   (1.05-0)^2 = 1.1025
    # 0.5 * (3.24 + 1 + 1.1025) / 3 = 0.8904166...
    torch.testing.assert_close(loss, torch.tensor(0.5 * 5.3425 / 3))
    torch.testing.assert_close(clip_fraction, torch.tensor(1 / 3))


def test_kl_penalized_rewards_put_the_score_on_the_last_real_token():
    scores = torch.tensor([1.0, -1.0])
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-2.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards, kl = kl_penalized_rewards(scores, logprobs, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.5, 0.0, -1.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.1], [-0.1, -1.0, 0.0]]))


def test_adaptive_kl_controller_follows_ziegler_et_al():
    controller = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    controller.update(9.0, 100)  # error clipped from 0.5 to 0.2: 0.1 * (1 + 0.2 * 0.01)
    assert controller.value == pytest.approx(0.1002)
    controller.update(5.4, 1000)  # error -0.1: 0.1002 * (1 - 0.1 * 0.1)
    assert controller.value == pytest.approx(0.099198)
    fixed = FixedKLController(0.1)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.1


def test_the_config_chooses_the_kl_controller():
    assert isinstance(kl_controller(PPOConfig()), FixedKLController)
    adaptive = kl_controller(PPOConfig(kl_coef=0.2, kl_target=3.0, kl_horizon=500))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 3.0, 500)


def test_entropy_of_uniform_and_certain_distributions_over_real_tokens():
    logits = torch.stack([torch.zeros(4), torch.tensor([0.0, -1e4, -1e4, -1e4])])[None]
    assert float(entropy(logits, torch.tensor([[1, 0]]))) == pytest.approx(math.log(4))
    assert float(entropy(logits, torch.tensor([[0, 1]]))) == pytest.approx(0.0, abs=1e-6)


def test_whitening_uses_real_tokens_only():
    whitened = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]]))
    scale = math.sqrt(1.5)  # mean 2, variance 2/3
    torch.testing.assert_close(
        whitened, torch.tensor([[-scale, 0.0, scale, 0.0]]), atol=1e-6, rtol=0
    )


def test_minibatches_cover_every_row_once_per_epoch_reproducibly():
    def draw(seed):
        return [
            rows.tolist()
            for rows in minibatches(
                5, minibatch_size=2, epochs=2, generator=torch.Generator().manual_seed(seed)
            )
        ]

    batches = draw(0)
    assert [len(b) for b in batches] == [2, 2, 1, 2, 2, 1]
    assert sorted(row for rows in batches[:3] for row in rows) == list(range(5))
    assert sorted(row for rows in batches[3:] for row in rows) == list(range(5))
    assert draw(0) == batches


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("gamma", {"gamma": 1.5}),
        ("lam", {"lam": -0.1}),
        ("clip_ratio", {"clip_ratio": 0.0}),
        ("kl_coef", {"kl_coef": -1.0}),
        ("kl_target", {"kl_target": 0.0}),
        ("epochs", {"epochs": 0}),
        ("minibatch_size", {"minibatch_size": 0}),
    ],
)
def test_bad_ppo_config_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=f"^{field}:"):
        PPOConfig(**kwargs)
