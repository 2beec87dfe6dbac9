"""Several teachers' signals combined in the fused loss (`loss.combined`), against the formulas on full logits:
routing equals each teacher's loss on its own rows; the mixture is the divergence against ``Σ w_i p_i``; the sum is
``Σ w_i D(p_i ‖ q)``. Values and the student's gradients; the metrics of a mixture at temperature 1."""

import math

import pytest
import torch
import torch.nn.functional as F
from oracles import reference_diagnostics

from trl_distill.loss.chunk_pass import chunk_slices
from trl_distill.loss.combined import MixtureSignal, RoutedSignal, SumSignal, routed_order
from trl_distill.loss.dense import DenseTeacherSignal
from trl_distill.loss.diagnostics import LossDiagnostics
from trl_distill.loss.divergences import DIVERGENCES, LOSS_TYPES
from trl_distill.loss.fused import fused_loss
from trl_distill.loss.settings import LossSettings
from trl_distill.loss.sparse import SparseSignalChunks, top_k_teacher_signal
from trl_distill.model.fused_forward import LMHead

N, H, V = 23, 8, 40


def _models(seed=0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(N, H, generator=g, dtype=torch.float64)
    s_weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    teachers = [(torch.randn(N, H, generator=g, dtype=torch.float64),
                 torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7) for _ in range(2)]
    labels = torch.randint(0, V, (N,), generator=g)
    return student, s_weight, teachers, labels


def _run(signal, student, s_weight, labels, settings, rows=None):
    hidden, weight = student.clone().requires_grad_(), s_weight.clone().requires_grad_()
    out = fused_loss(hidden, LMHead(weight), signal, settings, rows, labels, num_items_in_batch=N)
    (out.kd + 0.3 * out.ce).backward()
    return out, hidden.grad, weight.grad


def _dense(states, weight, settings, picks=None):
    states = states if picks is None else states[picks]
    return DenseTeacherSignal(states, LMHead(weight), V, settings.temperature)


def test_chunks_never_straddle_a_segment():
    assert chunk_slices(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert chunk_slices(10, 4, [0, 3, 3, 10]) == [slice(0, 3), slice(3, 7), slice(7, 10)]


@pytest.mark.parametrize("divergence", LOSS_TYPES)
@pytest.mark.parametrize("sparse_second", [False, True])
def test_routing_equals_each_teacher_on_its_own_rows(divergence, sparse_second):
    student, s_weight, teachers, labels = _models()
    settings = LossSettings(divergence, temperature=2.0, chunk_size=4, vocab_size=V)
    route = torch.tensor([i % 3 == 0 for i in range(N)], dtype=torch.long)  # teacher 1 on every third row
    order, bounds = routed_order(route, 2)
    assert bounds == [0, int((route == 0).sum()), N]
    own = [order[bounds[i]:bounds[i + 1]] for i in range(2)]
    sparse = top_k_teacher_signal(teachers[1][0] @ teachers[1][1].T, 7, 2.0)
    signals = [_dense(*teachers[0], settings, own[0])]
    if sparse_second:
        signals.append(SparseSignalChunks(type(sparse)(*(t[own[1]] for t in sparse)), len(own[1]), V))
    else:
        signals.append(_dense(*teachers[1], settings, own[1]))
    routed = RoutedSignal(signals, order, bounds)
    assert routed.closed_form is not sparse_second
    out, gh, gw = _run(routed, student, s_weight, labels[order], settings, rows=order)
    # Each teacher alone on its own rows, the sums over all tokens: their sum is the routed loss
    parts = [_run(s, student, s_weight, labels[rows], settings, rows=rows)
             for s, rows in zip([_dense(*teachers[0], settings, own[0]),
                                 signals[1] if sparse_second else _dense(*teachers[1], settings, own[1])], own)]
    assert out.kd.item() == pytest.approx(sum(p[0].kd.item() for p in parts), rel=1e-6, abs=1e-12)
    assert out.ce.item() == pytest.approx(sum(p[0].ce.item() for p in parts), rel=1e-6)
    torch.testing.assert_close(gh, parts[0][1] + parts[1][1], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(gw, parts[0][2] + parts[1][2], rtol=1e-6, atol=1e-12)
    # each teacher's part is counted apart (what `kd_loss/NAME` logs)
    for counted, (alone, _, _) in zip(routed.parts, parts):
        assert (counted / N).item() == pytest.approx(alone.kd.item(), rel=1e-6, abs=1e-12)


def _reference(student, s_weight, teachers, weights, settings, mixture):
    s_logp = F.log_softmax(student @ s_weight.T / settings.temperature, -1)
    t_logps = [F.log_softmax(h @ w.T / settings.temperature, -1) for h, w in teachers]
    fn = DIVERGENCES[settings.divergence]
    if mixture:
        mixed = torch.log(sum(w * lp.exp() for w, lp in zip(weights, t_logps)))
        return fn(s_logp, mixed, settings.beta, settings.skew_alpha).sum() / N
    return sum(w * fn(s_logp, lp, settings.beta, settings.skew_alpha).sum() for w, lp in zip(weights, t_logps)) / N


@pytest.mark.parametrize("divergence", LOSS_TYPES)
@pytest.mark.parametrize("mixture", [True, False])
def test_mixing_equals_the_formula_from_both_teachers_logits(divergence, mixture):
    student, s_weight, teachers, labels = _models(1)
    settings = LossSettings(divergence, temperature=2.0, chunk_size=5, vocab_size=V)
    weights = [0.3, 0.7]
    signals = [_dense(h, w, settings) for h, w in teachers]
    signal = MixtureSignal(signals, weights) if mixture else SumSignal(signals, weights)
    out, gh, gw = _run(signal, student, s_weight, labels, settings)
    hidden, weight = student.clone().requires_grad_(), s_weight.clone().requires_grad_()
    expected = _reference(hidden, weight, teachers, weights, settings, mixture)
    ce = F.cross_entropy(hidden @ weight.T, labels, reduction="sum") / N
    (expected + 0.3 * ce).backward()
    assert out.kd.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(gh, hidden.grad, rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(gw, weight.grad, rtol=1e-5, atol=1e-10)
    if not mixture:
        assert sum(p.item() for p in signal.parts) / N == pytest.approx(expected.item(), rel=1e-6)


def test_a_mixture_refuses_a_top_k_teacher_and_a_sum_takes_it():
    student, s_weight, teachers, labels = _models(2)
    settings = LossSettings("forward_kl", chunk_size=6, vocab_size=V)
    sparse = SparseSignalChunks(top_k_teacher_signal(teachers[1][0] @ teachers[1][1].T, V), N, V)  # k = V: exact
    with pytest.raises(ValueError, match="teacher_combine='sum'"):
        MixtureSignal([_dense(*teachers[0], settings), sparse], [0.5, 0.5])
    out, _, _ = _run(SumSignal([_dense(*teachers[0], settings), sparse], [0.5, 0.5]), student, s_weight, labels,
                     settings)
    expected = _reference(student, s_weight, teachers, [0.5, 0.5], settings, mixture=False)
    assert out.kd.item() == pytest.approx(expected.item(), rel=1e-5)


def _mixed(logits, weights, temperature=1.0):
    """``log Σ w_i p_i`` of the teachers' distributions at `temperature`, from their logits."""
    return torch.logsumexp(torch.stack([F.log_softmax(z / temperature, -1) + math.log(w)
                                        for z, w in zip(logits, weights) if w]), 0)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.0, 1.0]])
@pytest.mark.parametrize("kind", [MixtureSignal, SumSignal])
def test_the_metrics_of_a_mixture_are_those_of_the_teachers_mixed_at_temperature_one(kind, weights, divergence):
    """Trained at T = 2, the metrics (teacher_ce, KL, agreement, entropy) are against ``Σ w_i p_i`` of the teachers'
    distributions at T = 1, not the mixture at 2 brought back to 1 as one teacher; measuring them changes neither
    the loss nor its gradients."""
    student, s_weight, teachers, labels = _models(3)
    settings = LossSettings(divergence, temperature=2.0, chunk_size=5, vocab_size=V)

    def run(diagnostics):
        hidden, weight = student.clone().requires_grad_(), s_weight.clone().requires_grad_()
        signal = kind([_dense(h, w, settings) for h, w in teachers], weights)
        out = fused_loss(hidden, LMHead(weight), signal, settings, None, labels, num_items_in_batch=N,
                         diagnostics=diagnostics)
        (out.kd + 0.3 * out.ce).backward()
        return signal, out, hidden.grad, weight.grad

    diagnostics = LossDiagnostics()
    signal, out, gh, gw = run(diagnostics)
    logits = [h @ w.T for h, w in teachers]
    reference = reference_diagnostics(student @ s_weight.T, _mixed(logits, weights), labels)
    got = diagnostics.means()
    for name in ("teacher_ce", "kl_teacher_student", "top1_agreement", "teacher_entropy", "student_ce"):
        assert got[name] == pytest.approx(reference[name].mean().item(), abs=1e-9), name
    if weights[0]:  # two teachers: the mixture at 2 brought back to 1 is another distribution, which this tells apart
        wrong = reference_diagnostics(student @ s_weight.T, 2.0 * _mixed(logits, weights, 2.0), labels)
        assert abs(wrong["teacher_ce"].mean() - reference["teacher_ce"].mean()) > 1e-3
        assert abs(wrong["kl_teacher_student"].mean() - reference["kl_teacher_student"].mean()) > 1e-3
    # a student whose logits are that mixture agrees with it on every row, at KL 0 (with the mixture at 2 brought
    # back to 1 it would not: another top token on some rows)
    ideal = LossDiagnostics()
    fused_loss(_mixed(logits, weights), None, kind([_dense(h, w, settings) for h, w in teachers], weights), settings,
               None, labels, diagnostics=ideal)
    assert ideal.means()["top1_agreement"] == 1.0
    assert ideal.means()["kl_teacher_student"] == pytest.approx(0.0, abs=1e-9)
    if weights[0]:
        assert (_mixed(logits, weights, 2.0).argmax(-1) != _mixed(logits, weights).argmax(-1)).any()
    if kind is SumSignal:  # each teacher's own metrics, against that teacher alone at T = 1
        for i, own in enumerate(signal.own):
            if weights[i]:
                alone = reference_diagnostics(student @ s_weight.T, logits[i], labels)
                assert own.means()["teacher_ce"] == pytest.approx(alone["teacher_ce"].mean().item(), abs=1e-9)
    # the loss is the one at T = 2, measured or not, to the bit
    _, plain, plain_gh, plain_gw = run(None)
    expected = _reference(student, s_weight, teachers, weights, settings, mixture=kind is MixtureSignal)
    assert out.kd.item() == pytest.approx(expected.item(), rel=1e-9)
    assert torch.equal(out.kd, plain.kd) and torch.equal(out.ce, plain.ce)
    assert torch.equal(gh, plain_gh) and torch.equal(gw, plain_gw)
