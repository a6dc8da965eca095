"""The policy loss's math, on hand-made logprobs: no model."""

import math
from pathlib import Path

import pytest
import torch

from fleetrl.config import LossConfig, load_config
from fleetrl.rundir import RUN_DEFINING
from fleetrl.trainer.loop import step_config
from fleetrl.trainer.loss import policy_loss, token_entropy

ROOT = Path(__file__).resolve().parents[2]


def no_clip(**options) -> LossConfig:
    """The PPO clip and the TIS cap off, and `options`."""
    return LossConfig(**{"clip_low": 1.0, "clip_high": math.inf, "tis_cap": math.inf, **options})


NO_CLIP = no_clip()


def grad_of(trainer_lp, inference_lp, adv, mask, cfg, num_tokens=None, **optional):
    """`optional`: reference_logprobs, entropy, as nested lists."""
    lp = torch.tensor(trainer_lp, dtype=torch.float64, requires_grad=True)
    mask_t = torch.tensor(mask, dtype=torch.float64)
    num_tokens = int(mask_t.sum()) if num_tokens is None else num_tokens
    loss, stats = policy_loss(lp, torch.tensor(inference_lp, dtype=torch.float64),
                              torch.tensor(adv, dtype=torch.float64), mask_t, num_tokens, cfg,
                              **{k: torch.tensor(v, dtype=torch.float64) for k, v in optional.items()})
    loss.backward()
    return loss, lp.grad, stats


def close(grad, expected):
    return torch.allclose(grad, torch.tensor(expected, dtype=torch.float64))


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
    assert stats.sampler_kl.item() == pytest.approx(0.0, abs=1e-12)
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
    assert other_stats.sampler_kl.item() == pytest.approx(stats.sampler_kl.item())
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


def test_k3_sampler_kl_is_zero_when_logprobs_agree_and_positive_otherwise():
    lp = [[-1.0, -2.0, -3.0]]
    _, _, same = grad_of(lp, lp, [1.0], [[1, 1, 1]], LossConfig())
    assert same.sampler_kl.item() == 0.0
    for shift in (-0.3, 0.3):
        inf = [[x + shift for x in lp[0]]]
        _, _, stats = grad_of(lp, inf, [1.0], [[1, 1, 1]], LossConfig())
        log_r = -shift
        assert stats.sampler_kl.item() / 3 == pytest.approx(math.exp(log_r) - 1 - log_r)
        assert stats.sampler_kl.item() > 0


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
    assert stats.sampler_kl.item() / tokens.numel() == pytest.approx(exact, rel=0.05)


def test_the_default_loss_is_the_one_before_the_menu_bit_for_bit():
    """The token-level loss as it was before the options of issue 28, in fp32 as the step
    computes it: the values below are what that code gave (the clip on 4 tokens, the cap on 1,
    a padded token)."""
    lp = torch.tensor([[-0.3, -1.7, -2.2, -0.05], [-1.1, -0.4, -3.0, 0.0], [-0.9, -2.5, -0.2, -1.3]],
                      requires_grad=True)
    inference = torch.tensor([[-0.8, -1.6, -1.1, -0.2], [-0.5, -0.45, -2.0, 0.0], [-1.0, -1.9, -0.9, -1.3]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    loss, stats = policy_loss(lp, inference, torch.tensor([1.25, -0.75, 0.5]), mask, 13, LossConfig())
    loss.backward()
    assert loss.item() == -0.3518151044845581
    assert lp.grad.tolist() == [[0.0, -0.08700359612703323, -0.03200683370232582, -0.11171483248472214],
                                [0.0, 0.060650259256362915, 0.0, 0.0],
                                [-0.04250657558441162, -0.02110813930630684, 0.0, -0.03846153989434242]]
    assert {k: v.item() for k, v in vars(stats).items()} == {
        "tokens": 11.0, "loss": -4.573596477508545, "ratio": 10.683961868286133, "sampler_kl": 1.5839614868164062,
        "clipped": 4.0, "truncated": 1.0, "masked": 0.0, "ref_kl": 0.0, "entropy": 0.0}


def test_sequence_tis_weighs_every_token_by_its_samples_capped_product():
    cfg = no_clip(tis_cap=2.0, tis_level="sequence")
    # Log-ratios: sample 0 [0.5, 0.4] (its padding holds 3.0), sample 1 [0.2, -0.5, 0.1].
    lp, inf = [[0.5, 0.4, 3.0], [0.2, -0.5, 0.1]], [[0.0] * 3] * 2
    loss, grad, stats = grad_of(lp, inf, [1.0, -1.0], [[1, 1, 0], [1, 1, 1]], cfg)
    w0, w1 = min(math.exp(0.5 + 0.4), 2.0), min(math.exp(0.2 - 0.5 + 0.1), 2.0)  # e^0.9 = 2.46: capped
    assert w0 == 2.0
    # Each token: the value w_i * A_i, the gradient w_i * A_i * grad log pi, over N = 5.
    assert loss.item() == pytest.approx(-(2 * w0 * 1.0 + 3 * w1 * -1.0) / 5)
    assert close(grad, [[-w0 / 5, -w0 / 5, 0.0], [w1 / 5] * 3])
    assert stats.truncated.item() == 2  # the tokens of the capped sample
    assert stats.ratio.item() == pytest.approx(sum(math.exp(x) for x in (0.5, 0.4, 0.2, -0.5, 0.1)))


def test_token_mis_drops_the_tokens_outside_the_band_and_still_counts_them():
    cfg = no_clip(mis_low=0.5, mis_high=2.0)
    # Ratios e^0.9 = 2.46 (out), e^0.3 = 1.35, e^-1 = 0.37 (out), e^-0.2 = 0.82.
    loss, grad, stats = grad_of([[0.9, 0.3], [-1.0, -0.2]], [[0.0, 0.0]] * 2, [1.0, -2.0], [[1, 1], [1, 1]], cfg)
    r1, r3 = math.exp(0.3), math.exp(-0.2)
    assert loss.item() == pytest.approx(-(r1 * 1.0 + r3 * -2.0) / 4)  # N = 4: the dropped count
    assert close(grad, [[0.0, -r1 / 4], [0.0, 2.0 * r3 / 4]])
    assert stats.masked.item() == 2 and stats.tokens.item() == 4


def test_sequence_mis_drops_a_whole_sample_with_any_token_outside_the_band():
    cfg = no_clip(mis_low=0.5, mis_high=2.0, mis_level="sequence")
    # Sample 0 holds e^0.9 = 2.46 (out): dropped whole. Sample 1: e^0.3 and e^-0.2, both in.
    loss, grad, stats = grad_of([[0.3, 0.9], [0.3, -0.2]], [[0.0, 0.0]] * 2, [1.0, 1.0], [[1, 1], [1, 1]], cfg)
    a, b = math.exp(0.3), math.exp(-0.2)
    assert loss.item() == pytest.approx(-(a + b) / 4)
    assert close(grad, [[0.0, 0.0], [-a / 4, -b / 4]])
    assert stats.masked.item() == 2


def test_geometric_mis_drops_a_sample_by_its_mean_log_ratio():
    cfg = no_clip(mis_low=0.5, mis_high=2.0, mis_level="geometric")
    # Mean log-ratios: 0.2 (e^0.2 = 1.22: in, though e^0.9 is out), 0.75 (e^0.75 = 2.12: out),
    # -0.6 (e^-0.6 = 0.55: in, though e^-1 = 0.37 is out). The kept tokens keep their own ratios.
    lr = [[0.9, -0.5], [0.9, 0.6], [-1.0, -0.2]]
    loss, grad, stats = grad_of(lr, [[0.0, 0.0]] * 3, [1.0, 1.0, -1.0], [[1, 1]] * 3, cfg)
    r = [[math.exp(x) for x in row] for row in lr]
    assert loss.item() == pytest.approx(-(r[0][0] + r[0][1] - r[2][0] - r[2][1]) / 6)
    assert close(grad, [[-r[0][0] / 6, -r[0][1] / 6], [0.0, 0.0], [r[2][0] / 6, r[2][1] / 6]])
    assert stats.masked.item() == 2


def test_icepop_is_the_token_mis_preset_and_gives_icepops_loss():
    cfg = step_config(load_config([ROOT / "configs" / "icepop.toml"], [])).loss
    assert (cfg.mis_level, cfg.mis_low, cfg.mis_high) == ("token", 0.5, 5.0)
    # IcePop's definition: token t's weight is M(k_t) = k_t if 0.5 <= k_t <= 5 else 0, k_t = pi/mu.
    ks, adv = [[6.0, 4.0], [0.4, 0.6]], [1.0, -1.0]
    weight = [[k if 0.5 <= k <= 5 else 0.0 for k in row] for row in ks]
    lp = [[math.log(k) for k in row] for row in ks]
    loss, grad, stats = grad_of(lp, [[0.0, 0.0]] * 2, adv, [[1, 1], [1, 1]], cfg)
    assert loss.item() == pytest.approx(-sum(w * a for row, a in zip(weight, adv) for w in row) / 4)
    assert close(grad, [[-w * a / 4 for w in row] for row, a in zip(weight, adv)])
    assert stats.masked.item() == 2


def test_gspo_uses_the_samples_geometric_mean_ratio_clipped_whole():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=math.inf, ratio_level="sequence")
    # Sample ratios: s0 = e^0.2 = 1.22 (A > 0, under 1.28: kept), s1 = e^0.4 = 1.49 (A > 0, past
    # 1.28: clipped), s2 = e^-0.2 = 0.82 (A < 0, above 0.8: kept). Sample 2's padding holds 5.0.
    lp = [[0.1, 0.3, 0.0], [0.6, 0.2, 0.4], [-0.4, 0.0, 5.0]]
    mask = [[1, 1, 0], [1, 1, 1], [1, 1, 0]]
    loss, grad, stats = grad_of(lp, [[0.0] * 3] * 3, [1.0, 1.0, -0.5], mask, cfg)
    s0, s2 = math.exp(0.2), math.exp(-0.2)
    assert loss.item() == pytest.approx(-(2 * s0 * 1.0 + 3 * 1.28 * 1.0 + 2 * s2 * -0.5) / 7)
    # d/dlp_t of n_i copies of s_i * A_i = n_i * s_i * A_i / n_i: the same on each of the sample's tokens.
    assert close(grad, [[-s0 / 7, -s0 / 7, 0.0], [0.0] * 3, [0.5 * s2 / 7, 0.5 * s2 / 7, 0.0]])
    assert stats.clipped.item() == 3


def test_gspo_under_the_tis_cap_weighs_by_the_capped_sample_ratio():
    cfg = LossConfig(clip_low=1.0, clip_high=math.inf, tis_cap=1.5, ratio_level="sequence")
    loss, grad, stats = grad_of([[0.2, 0.8]], [[0.0, 0.0]], [1.0], [[1, 1]], cfg)  # s = e^0.5 = 1.65 > 1.5
    assert loss.item() == pytest.approx(-2 * 1.5 / 2)
    assert close(grad, [[-1.5 / 2, -1.5 / 2]])
    assert stats.truncated.item() == 2


def test_kl_penalty_adds_k3_to_the_reference_with_its_gradient_except_on_dropped_tokens():
    cfg = no_clip(kl_coef=0.1, mis_high=2.0)
    lp, inf = [[-1.0, -2.0, -0.5]], [[-1.0, -2.0, -1.5]]  # ratios 1, 1, e^1 = 2.72 (dropped)
    ref = [[-1.3, -1.5, -0.2]]
    d = [r - p for r, p in zip(ref[0], lp[0])]  # log ref/pi: -0.3, 0.5, 0.3
    k3 = [math.exp(x) - x - 1 for x in d]
    loss, grad, stats = grad_of(lp, inf, [1.0], [[1, 1, 1]], cfg, reference_logprobs=ref)
    assert loss.item() == pytest.approx(((-1 + 0.1 * k3[0]) + (-1 + 0.1 * k3[1])) / 3)
    # d k3 / d log pi = 1 - ref/pi
    assert close(grad, [[(-1 + 0.1 * (1 - math.exp(d[0]))) / 3,
                                            (-1 + 0.1 * (1 - math.exp(d[1]))) / 3, 0.0]])
    assert stats.ref_kl.item() == pytest.approx(sum(k3))  # reported over every trained token
    assert stats.masked.item() == 1


def test_kl_needs_reference_logprobs_and_without_a_coefficient_is_only_reported():
    lp, ref = [[-1.0, -2.0]], [[-1.5, -1.0]]
    with pytest.raises(ValueError, match="kl_coef = 0.1 needs reference_logprobs"):
        grad_of(lp, lp, [1.0], [[1, 1]], LossConfig(kl_coef=0.1))
    plain, plain_grad, _ = grad_of(lp, lp, [1.0], [[1, 1]], LossConfig())
    loss, grad, stats = grad_of(lp, lp, [1.0], [[1, 1]], LossConfig(), reference_logprobs=ref)
    assert loss.item() == plain.item() and torch.equal(grad, plain_grad)
    assert stats.ref_kl.item() == pytest.approx(sum(math.exp(x) - x - 1 for x in (-0.5, 1.0)))


def test_token_entropy_by_hand_and_its_sum_over_trained_tokens():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 0.0]], dtype=torch.bfloat16))  # log 0 = -inf
    h0 = -sum(p * math.log(p) for p in (1 / 6, 2 / 6, 3 / 6))
    entropy = token_entropy(logits)
    assert entropy.dtype == torch.float32
    assert entropy.tolist() == pytest.approx([h0, math.log(2)], rel=1e-2)  # the logits are bf16
    assert token_entropy(torch.tensor([[0.5, -1.0, 2.0]]) + 100).tolist() == pytest.approx(
        token_entropy(torch.tensor([[0.5, -1.0, 2.0]])).tolist(), rel=1e-5)
    lp = [[-1.0, -2.0, 0.0]]
    _, _, stats = grad_of(lp, lp, [1.0], [[1, 1, 0]], LossConfig(), entropy=[[h0, math.log(2), math.nan]])
    assert stats.entropy.item() == pytest.approx(h0 + math.log(2))  # padding (here nan) left out


@pytest.mark.parametrize("cfg", [
    LossConfig(tis_level="sequence", tis_cap=1.2),
    LossConfig(ratio_level="sequence", clip_low=0.05, clip_high=0.05, tis_cap=1.1),
    LossConfig(mis_level="sequence", mis_low=0.7, mis_high=1.4),
    LossConfig(mis_level="geometric", mis_low=0.95, mis_high=1.05),
    LossConfig(kl_coef=0.05, mis_low=0.8),
], ids=["seq-tis", "gspo", "seq-mis", "geo-mis", "kl"])
def test_sequence_level_options_give_the_same_loss_and_gradient_however_the_rows_are_split(cfg):
    g = torch.Generator().manual_seed(1)
    lp = -2 * torch.rand(4, 5, generator=g, dtype=torch.float64)
    inference = lp + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    reference = lp + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = (torch.arange(5) < torch.tensor([5, 2, 4, 3])[:, None]).double()

    def run(rows, config=cfg):
        lp_rows = lp[rows].clone().requires_grad_()
        loss, stats = policy_loss(lp_rows, inference[rows], adv[rows], mask[rows], 14, config,
                                  reference_logprobs=reference[rows])
        loss.backward()
        return loss, lp_rows.grad, stats.stack()

    whole, grad, stats = run(slice(0, 4))
    first, second = run(slice(0, 2)), run(slice(2, 4))
    assert (first[0] + second[0]).item() == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(torch.cat([first[1], second[1]]), grad, rtol=1e-12, atol=0)
    assert torch.allclose(first[2] + second[2], stats, rtol=1e-12, atol=0)
    assert whole.item() != run(slice(0, 4), LossConfig())[0].item()  # the option did something


def test_the_step_reads_the_loss_section_as_it_is_and_a_resume_keeps_it():
    config = load_config([], [("trainer.loss.ratio_level", "sequence"), ("trainer.loss.kl_coef", "0.01")])
    assert step_config(config).loss is config.trainer.loss
    assert "trainer.loss" in RUN_DEFINING["rl"]


@pytest.mark.parametrize("cfg", [
    NO_CLIP, LossConfig(), LossConfig(tis_level="sequence"), LossConfig(ratio_level="sequence"),
    LossConfig(mis_level="geometric", mis_high=2.0), LossConfig(kl_coef=0.1),
], ids=["no-clip", "default", "seq-tis", "gspo", "geo-mis", "kl"])
def test_a_huge_logprob_gap_gives_a_finite_loss_and_gradient(cfg):
    # fp32, as the step computes it: exp(100) overflows. Token by token: a gap of 100 with a
    # zero advantage (0 x inf), with a negative one (TIS: cap / inf x -inf), an inference
    # logprob of -inf on a real token, and a gap of 100 on a masked token; the reference's
    # logprobs likewise.
    lp = torch.tensor([[0.0, -1.0], [0.0, -1.0], [0.0, -1.0], [0.0, -100.0]], requires_grad=True)
    inference = torch.tensor([[-100.0, -1.0], [-100.0, -1.0], [-math.inf, -1.0], [-1.0, 0.0]])
    adv = torch.tensor([0.0, -1.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    loss, stats = policy_loss(lp, inference, adv, mask, 7, cfg, reference_logprobs=inference.flip(0))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all(), lp.grad
    assert all(torch.isfinite(value) for value in vars(stats).values()), stats
    if cfg in (NO_CLIP, LossConfig()):
        # The ordinary tokens (equal logprobs) keep their plain gradient -A / N.
        assert lp.grad[:3, 1].tolist() == pytest.approx([0.0, 1 / 7, -1 / 7])
