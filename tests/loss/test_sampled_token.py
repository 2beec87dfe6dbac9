"""The sampled-token objective (`loss.sampled_token`) against a hand-written float64 version: its value and its
gradients (student states and lm_head), with and without the importance ratio against an engine, its clip, the
engine's truncated importance weights instead (`vllm_importance_sampling_correction`), a task reward and a discount;
and the trainer's loss on the student's own samples against the models' own logits."""

import pytest
import torch
import torch.nn.functional as F

from trl_distill.loss.dense import DenseTeacherSignal
from trl_distill.loss.fused import fused_loss
from trl_distill.loss.rollout_correction import RolloutCorrection
from trl_distill.loss.sampled_token import (
    SampledTokenJob,
    SampledTokenSettings,
    discounted,
    ratio_reference,
    sampled_token_signal,
)
from trl_distill.loss.settings import LossSettings
from trl_distill.model.fused_forward import LMHead

B, K, H, V = 3, 5, 8, 11


def reference(h, weight, t_logits, labels, sequence, settings, old=None, rewards=None, engine_cap=None):
    """The objective written out in float64: per-token rewards, discounted advantages plus the task's, GRPO's clipped
    surrogate, averaged over the tokens. ``engine_cap``: ``(engine log-probs, cap)``, TRL GRPO's truncated importance
    weights min(π / π_engine, cap), detached, on each token's surrogate (ρ then against the student itself)."""
    s_lp = F.log_softmax(h @ weight.T, -1).gather(1, labels[:, None]).squeeze(1)
    t_lp = F.log_softmax(t_logits, -1).gather(1, labels[:, None]).squeeze(1)
    r = settings.kl_coef * (t_lp - s_lp.detach())
    advantage = torch.zeros_like(r)
    for t in range(len(r)):  # Σ_{k ≥ t, same completion} γ^{k−t} r_k
        for k in range(t, len(r)):
            if sequence[k] != sequence[t]:
                break
            advantage[t] += settings.discount ** (k - t) * r[k]
    if rewards is not None:
        advantage = advantage + settings.task_weight * (rewards - rewards.mean())[sequence]
    old = s_lp.detach() if old is None else old
    ratio = torch.exp(s_lp - old)
    clipped = ratio.clamp(1 - settings.epsilon, 1 + settings.epsilon_high)
    surrogate = torch.minimum(ratio * advantage, clipped * advantage)
    if engine_cap is not None:
        surrogate = surrogate * torch.exp(s_lp.detach() - engine_cap[0]).clamp(max=engine_cap[1])
    return -surrogate.sum() / len(r)


@pytest.mark.parametrize("case", ["plain", "engine ratio, clipped", "task reward", "discount", "all",
                                  "engine IS weights, truncated"])
def test_value_and_gradients_equal_the_float64_formula(case):
    torch.manual_seed(0)
    h = torch.randn(B * K, H, dtype=torch.float64)
    weight = torch.randn(V, H, dtype=torch.float64) * 0.5
    t_logits = torch.randn(B * K, V, dtype=torch.float64)
    labels = torch.randint(0, V, (B * K,))
    rows, sequence = torch.arange(B * K), torch.arange(B * K) // K
    settings = SampledTokenSettings(kl_coef=0.7, discount=0.9 if case in ("discount", "all") else 0.0,
                                    epsilon=0.2, epsilon_high=0.28, task_weight=0.5)
    old = rewards = correction = None
    if case in ("engine ratio, clipped", "all", "engine IS weights, truncated"):  # an engine off by up to ±0.6
        with torch.no_grad():  # nats: some ratios beyond the clip (and weights beyond the cap)
            s_lp = F.log_softmax(h @ weight.T, -1).gather(1, labels[:, None]).squeeze(1)
        old = s_lp + torch.linspace(-0.6, 0.6, B * K, dtype=torch.float64)
    if case == "engine IS weights, truncated":  # vllm_importance_sampling_correction, clip_max 1.3
        correction = RolloutCorrection(old, 1.3)
        assert ratio_reference(correction) is None and ratio_reference(RolloutCorrection(old)) is old
    if case in ("task reward", "all"):
        rewards = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    job = SampledTokenJob(settings, rewards)
    teacher = DenseTeacherSignal(t_logits, None, V, 1.0)
    weight_ours = weight.clone().requires_grad_(True)
    h_ours = h.clone().requires_grad_(True)
    head = LMHead(weight_ours, None)
    engine = old if correction is None else ratio_reference(correction)
    signal = sampled_token_signal(teacher, job, rows, labels, K, h_ours.detach(), head, V, 4, engine)
    kd, _ = fused_loss(h_ours, head, signal, LossSettings("reverse_kl", chunk_size=4, ce_grad=False), rows,
                       labels, correction=correction)
    kd.backward()
    weight_ref, h_ref = weight.clone().requires_grad_(True), h.clone().requires_grad_(True)
    want = reference(h_ref, weight_ref, t_logits, labels, sequence, settings, engine, rewards,
                     None if correction is None else (old, correction.cap))
    want.backward()
    torch.testing.assert_close(kd, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(h_ours.grad, h_ref.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(weight_ours.grad, weight_ref.grad, rtol=1e-9, atol=1e-12)
    if engine is not None:
        assert 0 < job.stats["clipped"] < B * K  # the clip binds on some tokens, not all
    if correction is not None:  # ρ = 1: nothing clipped; the cap binds on some weights, not all
        assert job.stats["clipped"] == 0
        assert 0 < int((correction.gap.double().exp() > correction.cap).sum()) < B * K
    assert job.stats["tokens"] == B * K


def test_discount_sums_the_rest_of_each_completion():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0])
    out = discounted(rewards, torch.tensor([0, 0, 0, 1, 1]), 0.5)
    torch.testing.assert_close(out, torch.tensor([1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3.0, 10 + 0.5 * 20, 20.0]))


@pytest.mark.parametrize("discount", [0.0, 0.9])
def test_a_nan_teacher_log_prob_is_not_silenced(discount):
    """Only a signal's declared uncovered tokens (a teacher of another tokenizer) get no teacher reward; a NaN from
    any other teacher reaches the loss, where the NaN guard stops the run."""
    torch.manual_seed(0)
    h, weight = torch.randn(B * K, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64)
    t_logits = torch.randn(B * K, V, dtype=torch.float64)
    t_logits[3] = float("nan")
    labels, rows = torch.randint(0, V, (B * K,)), torch.arange(B * K)
    job = SampledTokenJob(SampledTokenSettings(discount=discount))
    signal = sampled_token_signal(DenseTeacherSignal(t_logits, None, V, 1.0), job, rows, labels, K, h, LMHead(weight,
                                  None), V, 4, None)
    kd, _ = fused_loss(h, LMHead(weight, None), signal, LossSettings("reverse_kl", chunk_size=4, ce_grad=False), rows,
                       labels)
    assert torch.isnan(kd)
