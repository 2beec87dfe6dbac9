"""The fused loss's diagnostics (`loss.diagnostics`) against the same metrics taken from full logits in float64
(`oracles.reference_diagnostics`): chunked, at any training temperature, for a dense and a top-k teacher."""

import pytest
import torch
from oracles import reference_diagnostics

from trl_distill.loss.dense import DenseTeacherSignal
from trl_distill.loss.diagnostics import METRICS, LossDiagnostics
from trl_distill.loss.fused import fused_loss
from trl_distill.loss.settings import LossSettings
from trl_distill.loss.sparse import SparseSignalChunks, top_k_teacher_signal
from trl_distill.model.fused_forward import LMHead


def problem(n=37, hidden=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(n, hidden, generator=g)
    student = LMHead(torch.randn(vocab, hidden, generator=g) * 0.5, None, None, None)
    teacher_states = torch.randn(n, hidden, generator=g)
    teacher = LMHead(torch.randn(vocab, hidden, generator=g), None, None, None)
    labels = torch.randint(0, vocab, (n,), generator=g)
    return states, student, teacher_states, teacher, labels


def means(diagnostics: LossDiagnostics) -> dict[str, float]:
    return diagnostics.means()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_dense_diagnostics_equal_the_full_logits_metrics_at_temperature_one(temperature, divergence):
    states, student, teacher_states, teacher, labels = problem()
    settings = LossSettings(divergence, temperature=temperature, chunk_size=5, vocab_size=50)
    diagnostics = LossDiagnostics()
    signal = DenseTeacherSignal(teacher_states, teacher, 50, temperature)
    fused_loss(states.requires_grad_(), student, signal, settings, None, labels, diagnostics=diagnostics)
    reference = reference_diagnostics(states @ student.weight.T, teacher_states @ teacher.weight.T, labels)
    got = means(diagnostics)
    assert set(got) == set(reference)
    for name, values in reference.items():
        assert got[name] == pytest.approx(values.mean().item(), abs=1e-5), name
    assert diagnostics.counts[METRICS.index("top1_agreement")] == 37


def test_top_k_diagnostics_are_those_of_the_buckets_and_the_dense_ones_at_k_equal_v():
    states, student, teacher_states, teacher, labels = problem(seed=1)
    teacher_logits = teacher_states @ teacher.weight.T
    for k in (4, 50):
        diagnostics = LossDiagnostics()
        signal = SparseSignalChunks(top_k_teacher_signal(teacher_logits, k), 37, 50)
        fused_loss(states, student, signal, LossSettings(chunk_size=6), None, labels, diagnostics=diagnostics)
        reference = reference_diagnostics(states @ student.weight.T, teacher_logits, labels, top_k=k)
        got = means(diagnostics)
        for name, values in reference.items():
            assert got[name] == pytest.approx(values.mean().item(), abs=1e-5), (k, name)
        assert got["student_tail_clamped"] == 0
    dense = reference_diagnostics(states @ student.weight.T, teacher_logits, labels)
    for name in ("kl_teacher_student", "teacher_ce", "teacher_entropy"):
        assert got[name] == pytest.approx(dense[name].mean().item(), abs=1e-5)  # k = V: nothing is bucketed away
    assert got["teacher_tail_mass"] < 1e-6


def test_a_top_k_teacher_at_another_temperature_logs_only_what_its_signal_determines():
    states, student, teacher_states, teacher, labels = problem(seed=2)
    diagnostics = LossDiagnostics()
    signal = SparseSignalChunks(top_k_teacher_signal(teacher_states @ teacher.weight.T, 4, temperature=2.0), 37, 50)
    fused_loss(states, student, signal, LossSettings(temperature=2.0), None, labels, diagnostics=diagnostics)
    assert set(means(diagnostics)) == {"top1_agreement", "teacher_tail_mass", "student_tail_clamped", "student_ce",
                                       "student_entropy"}


def test_diagnostics_cost_no_gradient_change():
    states, student, teacher_states, teacher, labels = problem(seed=3)
    grads = []
    for diagnostics in (None, LossDiagnostics()):
        h = states.clone().requires_grad_()
        out = fused_loss(h, student, DenseTeacherSignal(teacher_states, teacher, 50, 1.0),
                         LossSettings(chunk_size=8), None, labels, diagnostics=diagnostics)
        (out.kd + out.ce).backward()
        grads.append((out.kd.item(), out.ce.item(), h.grad))
    assert grads[0][:2] == grads[1][:2] and torch.equal(grads[0][2], grads[1][2])


def test_diagnostics_are_fp32_under_bf16_autocast():
    """bf16 mixed precision (the Trainer's autocast) must not reach the metrics: their KL is a difference of two
    entropies, which bf16 dot products would swamp (seen: KL 0.011 logged for a KD of 0.021 at T = 1)."""
    states, student, teacher_states, teacher, labels = problem(vocab=256)
    teacher = LMHead(student.weight + 0.05 * teacher.weight, None, None, None)  # close: a KL of about 1e-2
    settings = LossSettings("forward_kl", chunk_size=8, vocab_size=256)
    diagnostics = LossDiagnostics()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kd, _ = fused_loss(states, student, DenseTeacherSignal(states, teacher, 256, 1.0), settings, None, labels,
                           diagnostics=diagnostics)
    reference = reference_diagnostics(states @ student.weight.T, states @ teacher.weight.T, labels)
    assert means(diagnostics)["kl_teacher_student"] == pytest.approx(kd.item(), rel=1e-4)
    assert kd.item() == pytest.approx(reference["kl_teacher_student"].mean().item(), rel=1e-4)
