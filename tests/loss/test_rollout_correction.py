"""The rollout engine's log-probs in the fused loss: the gap it records, and the truncated importance-sampling
weights against the formula Σ_t min(π_train/π_engine, C)·(D_t, CE_t) / n, values and gradients, dense and sparse."""

import pytest
import torch
import torch.nn.functional as F

from tests.loss.test_divergences import reference_per_token
from trl_distill.loss.dense import DenseTeacherSignal
from trl_distill.loss.fused import fused_loss
from trl_distill.loss.rollout_correction import RolloutCorrection
from trl_distill.loss.settings import LossSettings
from trl_distill.loss.sparse import SparseSignalChunks, top_k_teacher_signal

N, H, V, T = 13, 8, 24, 2.0


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    teacher = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (N,), generator=g)
    trainer_lp = (hidden @ weight.T).log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    engine_lp = trainer_lp + torch.randn(N, generator=g, dtype=torch.float64) * 0.7  # an engine that differs
    return hidden, weight, teacher, labels, trainer_lp, engine_lp


def run(divergence, cap, sparse=False):
    from trl_distill.model.fused_forward import LMHead

    hidden, weight, teacher, labels, _, engine_lp = problem()
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    settings = LossSettings(divergence, temperature=1.0 if sparse else T, chunk_size=5, vocab_size=V)
    if sparse:
        signal = SparseSignalChunks(top_k_teacher_signal(teacher, 6), N, V)
    else:
        signal = DenseTeacherSignal(teacher, None, V, settings.temperature)
    correction = RolloutCorrection(engine_lp, cap)
    kd, ce = fused_loss(hidden, LMHead(weight, None, None, None), signal, settings, None, labels, None, correction)
    (kd + 0.5 * ce).backward()
    return kd, ce, hidden.grad, weight.grad, correction


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd", "reverse_kl"])
def test_weights_are_truncated_ratios_on_kd_and_ce(divergence):
    hidden, weight, teacher, labels, trainer_lp, engine_lp = problem()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h @ w.T
    ratio = (trainer_lp - engine_lp).exp().clamp(max=1.1)  # detached, as the loss takes it
    per_token = reference_per_token(logits, teacher, divergence, beta=0.5, temperature=T)
    kd_ref = (ratio * per_token).sum() / N
    ce_ref = (ratio * F.cross_entropy(logits, labels, reduction="none")).sum() / N
    (kd_ref + 0.5 * ce_ref).backward()
    kd, ce, grad_h, grad_w, correction = run(divergence, 1.1)
    assert float((ratio < 1.1).sum()) >= 2 and float((ratio == 1.1).sum()) >= 2  # both sides of the cap are tried
    torch.testing.assert_close(kd, kd_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ce, ce_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad_h, h.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad_w, w.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(correction.gap.double(), trainer_lp - engine_lp, rtol=0, atol=1e-6)


@pytest.mark.parametrize("sparse", [False, True])
def test_without_a_cap_the_loss_is_unchanged_and_the_gap_recorded(sparse):
    from trl_distill.model.fused_forward import LMHead

    hidden, weight, teacher, labels, trainer_lp, engine_lp = problem()
    settings = LossSettings("forward_kl", temperature=1.0 if sparse else T, chunk_size=5, vocab_size=V)
    signal = (SparseSignalChunks(top_k_teacher_signal(teacher, 6), N, V) if sparse
              else DenseTeacherSignal(teacher, None, V, settings.temperature))
    plain = fused_loss(hidden.clone().requires_grad_(), LMHead(weight.clone().requires_grad_(), None, None, None),
                       signal, settings, None, labels)  # with gradients: the same path as `run`
    kd, ce, _, _, correction = run("forward_kl", None, sparse)
    assert torch.equal(kd.detach(), plain.kd) and torch.equal(ce.detach(), plain.ce)
    torch.testing.assert_close(correction.gap.double(), trainer_lp - engine_lp, rtol=0, atol=1e-6)


def test_a_sparse_signal_takes_the_weights_too():
    hidden, weight, teacher, labels, trainer_lp, engine_lp = problem()
    kd_w, ce_w, *_ = run("forward_kl", 1.1, sparse=True)
    kd_1, ce_1, *_ = run("forward_kl", None, sparse=True)
    ratio = (trainer_lp - engine_lp).exp().clamp(max=1.1)
    logits = hidden @ weight.T
    torch.testing.assert_close(ce_w, (ratio * F.cross_entropy(logits, labels, reduction="none")).sum() / N)
    assert not torch.isclose(kd_w, kd_1)


def test_a_correction_for_other_rows_is_refused():
    from trl_distill.model.fused_forward import LMHead

    hidden, weight, teacher, labels, _, engine_lp = problem()
    signal = DenseTeacherSignal(teacher, None, V, 1.0)
    with pytest.raises(ValueError, match="scored 12 sampled tokens, the loss selects 13"):
        fused_loss(hidden, LMHead(weight, None, None, None), signal, LossSettings(vocab_size=V), None, labels,
                   None, RolloutCorrection(engine_lp[:12]))
