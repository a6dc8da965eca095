"""The policy loss's math, on hand-made logprobs: no model."""

import math

import pytest
import torch

from fleetrl.trainer.loss import LossConfig, policy_loss

NO_CLIP = LossConfig(clip_low=1.0, clip_high=math.inf, tis_cap=math.inf)


def grad_of(trainer_lp, inference_lp, adv, mask, cfg, num_tokens=None):
    lp = torch.tensor(trainer_lp, dtype=torch.float64, requires_grad=True)
    mask_t = torch.tensor(mask, dtype=torch.float64)
    num_tokens = int(mask_t.sum()) if num_tokens is None else num_tokens
    loss, stats = policy_loss(lp, torch.tensor(inference_lp, dtype=torch.float64),
                              torch.tensor(adv, dtype=torch.float64), mask_t, num_tokens, cfg)
    loss.backward()
    return loss, lp.grad, stats


@pytest.mark.parametrize("cfg", [NO_CLIP, LossConfig()])
def test_equal_logprobs_give_the_plain_policy_gradient(cfg):
    lp = [[-1.0, -2.0, -0.5], [-0.3, -0.7, -4.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    adv = [0.5, -2.0]
    loss, grad, stats = grad_of(lp, lp, adv, mask, cfg)
    # d/dlp of -(1/N) sum_t A * exp(lp - sg(lp)) at ratio 1 is -A/N on each completion token.
    expected = -torch.tensor([[0.5] * 3, [-2.0, -2.0, 0.0]], dtype=torch.float64) / 5
    assert torch.allclose(grad, expected)
    assert loss.item() == pytest.approx(-(3 * 0.5 + 2 * -2.0) / 5)
    assert stats.tokens.item() == 5
    assert stats.mismatch_kl.item() == pytest.approx(0.0, abs=1e-12)
    assert stats.ratio.item() / 5 == pytest.approx(1.0)
    assert stats.clipped.item() == stats.truncated.item() == 0


def test_masked_tokens_contribute_nothing_whatever_they_hold():
    mask = [[1, 1, 0, 0]]
    base, grad, stats = grad_of([[-1.0, -2.0, 0.0, 0.0]], [[-1.1, -1.9, 0.0, 0.0]], [1.0], mask, LossConfig())
    # Garbage (even -inf) in the padded positions changes neither loss, gradient nor stats.
    other, other_grad, other_stats = grad_of([[-1.0, -2.0, 5.0, -3.0]], [[-1.1, -1.9, -math.inf, 7.0]],
                                             [1.0], mask, LossConfig())
    assert other.item() == pytest.approx(base.item())
    assert torch.equal(other_grad[:, 2:], torch.zeros(1, 2, dtype=torch.float64))
    assert torch.allclose(other_grad, grad)
    assert other_stats.mismatch_kl.item() == pytest.approx(stats.mismatch_kl.item())
    assert other_stats.tokens.item() == 2


def test_the_normalizer_is_the_whole_batch_token_count():
    lp, mask = [[-1.0, -2.0]], [[1, 1]]
    loss, grad, _ = grad_of(lp, lp, [1.0], mask, NO_CLIP, num_tokens=8)
    assert loss.item() == pytest.approx(-2 / 8)
    assert torch.allclose(grad, torch.full((1, 2), -1 / 8, dtype=torch.float64))


def test_importance_ratio_weights_the_gradient():
    # ratio = e^0.5 on the first token, e^-0.5 on the second; no clip, no cap: weight = ratio.
    loss, grad, stats = grad_of([[-1.0, -2.0]], [[-1.5, -1.5]], [1.0], [[1, 1]], NO_CLIP)
    r = torch.tensor([[math.exp(0.5), math.exp(-0.5)]], dtype=torch.float64)
    assert torch.allclose(grad, -r / 2)
    assert stats.ratio.item() == pytest.approx(r.sum().item())


def test_ppo_clip_removes_the_gradient_only_past_the_bound_in_the_advantage_direction():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=math.inf)
    up, down = math.log(1.5), math.log(0.5)  # ratios 1.5 and 0.5
    lp = [[up, down], [up, down]]
    inf = [[0.0, 0.0], [0.0, 0.0]]
    _, grad, stats = grad_of(lp, inf, [1.0, -1.0], [[1, 1], [1, 1]], cfg)
    # A > 0: ratio 1.5 > 1.28 is clipped (no gradient); ratio 0.5 keeps its gradient.
    # A < 0: ratio 1.5 keeps its gradient; ratio 0.5 < 0.8 is clipped.
    assert grad[0, 0] == 0 and grad[1, 1] == 0
    assert grad[0, 1].item() == pytest.approx(-1.0 * 0.5 / 4)
    assert grad[1, 0].item() == pytest.approx(1.0 * 1.5 / 4)
    assert stats.clipped.item() == 2


def test_truncated_importance_sampling_caps_the_weight_and_keeps_the_direction():
    cfg = LossConfig(clip_low=1.0, clip_high=math.inf, tis_cap=2.0)
    lp, inf = [[math.log(5.0), math.log(1.5)]], [[0.0, 0.0]]
    loss, grad, stats = grad_of(lp, inf, [-1.0], [[1, 1]], cfg)
    # weight min(5, 2) = 2 on the first token, 1.5 (under the cap) on the second.
    assert grad[0, 0].item() == pytest.approx(2.0 / 2)
    assert grad[0, 1].item() == pytest.approx(1.5 / 2)
    assert loss.item() == pytest.approx((2.0 + 1.5) / 2)
    assert stats.truncated.item() == 1
    assert stats.ratio.item() == pytest.approx(6.5)  # the metric reports the true ratio


def test_clip_and_cap_together_bound_negative_advantages_with_large_ratios():
    lp, inf = [[math.log(5.0)]], [[0.0]]
    _, grad, stats = grad_of(lp, inf, [-1.0], [[1]], LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=3.0))
    assert grad.item() == pytest.approx(3.0)  # PPO alone would weigh it 5
    assert stats.clipped.item() == 0 and stats.truncated.item() == 1


def test_k3_mismatch_kl_is_zero_when_logprobs_agree_and_positive_otherwise():
    lp = [[-1.0, -2.0, -3.0]]
    _, _, same = grad_of(lp, lp, [1.0], [[1, 1, 1]], LossConfig())
    assert same.mismatch_kl.item() == 0.0
    for shift in (-0.3, 0.3):
        inf = [[x + shift for x in lp[0]]]
        _, _, stats = grad_of(lp, inf, [1.0], [[1, 1, 1]], LossConfig())
        log_r = -shift
        assert stats.mismatch_kl.item() / 3 == pytest.approx(math.exp(log_r) - 1 - log_r)
        assert stats.mismatch_kl.item() > 0


def test_k3_estimates_the_kl_of_the_sampling_distribution():
    # Sample from mu; the mean k3 over samples approaches KL(mu || pi) computed exactly.
    g = torch.Generator().manual_seed(0)
    mu = torch.softmax(torch.randn(16, generator=g, dtype=torch.float64), 0)
    pi = torch.softmax(torch.log(mu) + 0.3 * torch.randn(16, generator=g, dtype=torch.float64), 0)
    tokens = torch.multinomial(mu, 200_000, replacement=True, generator=g)
    inf_lp, train_lp = torch.log(mu)[tokens][None], torch.log(pi)[tokens][None]
    _, stats = policy_loss(train_lp, inf_lp, torch.ones(1, dtype=torch.float64),
                           torch.ones_like(inf_lp), tokens.numel(), LossConfig())
    exact = (mu * (mu.log() - pi.log())).sum().item()
    assert stats.mismatch_kl.item() / tokens.numel() == pytest.approx(exact, rel=0.05)


def test_invalid_bounds_are_refused():
    with pytest.raises(ValueError):
        LossConfig(clip_low=1.5)
    with pytest.raises(ValueError):
        LossConfig(clip_high=-0.1)
    with pytest.raises(ValueError):
        LossConfig(tis_cap=0.0)


@pytest.mark.parametrize("cfg", [NO_CLIP, LossConfig()], ids=["no-clip", "default"])
def test_a_huge_logprob_gap_gives_a_finite_loss_and_gradient(cfg):
    # fp32, as the step computes it: exp(100) overflows. Token by token: a gap of 100 with a
    # zero advantage (0 x inf), with a negative one (TIS: cap / inf x -inf), an inference
    # logprob of -inf on a real token, and a gap of 100 on a masked token.
    lp = torch.tensor([[0.0, -1.0], [0.0, -1.0], [0.0, -1.0], [0.0, -100.0]], requires_grad=True)
    inference = torch.tensor([[-100.0, -1.0], [-100.0, -1.0], [-math.inf, -1.0], [-1.0, 0.0]])
    adv = torch.tensor([0.0, -1.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    loss, stats = policy_loss(lp, inference, adv, mask, 7, cfg)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all(), lp.grad
    assert all(torch.isfinite(value) for value in vars(stats).values()), stats
    # The ordinary tokens (equal logprobs) keep their plain gradient -A / N.
    assert lp.grad[:3, 1].tolist() == pytest.approx([0.0, 1 / 7, -1 / 7])
