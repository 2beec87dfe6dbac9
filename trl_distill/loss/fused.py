"""The distillation loss: logits -> divergence (`divergence`), and the chunked, fused lm-head path that never builds
full-vocabulary logits (`fused_loss`; functional form `chunked_distillation_loss`).

Notation: ``p`` is the teacher distribution, ``q`` the student distribution, both ``softmax(logits / T)``. The
formulas are in `trl_distill.loss.divergences`; everything about the loss that is not a tensor is one frozen
`LossSettings`, and each model's head (weight, bias, scale, softcap) travels as a `modeling.LMHead`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..model.fused_forward import LMHead, LossFeatures, gathered
from .chunk_pass import ChunkPass, LossJob
from .dense import DenseTeacherSignal
from .diagnostics import LossDiagnostics
from .divergences import normalise_sum
from .sampled_token import SampledTokenJob, ratio_reference, sampled_token_signal
from .settings import LossSettings, default_chunk_size

if TYPE_CHECKING:
    from .rollout_correction import RolloutCorrection
    from .signal import TeacherSignal

__all__ = ["DistillationLossOutput", "chunked_distillation_loss", "chunked_divergence", "fused_loss",
           "select_loss_rows"]

# ----------------------------------------------------------------------------------------------------
# Chunked fused lm-head + divergence (+ CE)
# ----------------------------------------------------------------------------------------------------
class DistillationLossOutput(NamedTuple):
    """``kd``: distillation loss (scalar); ``ce``: student cross-entropy (scalar) when labels were given."""

    kd: Tensor
    ce: Tensor | None


class _ChunkedDistillation(torch.autograd.Function):
    """Fused ``hidden @ W.T`` -> divergence (+ CE); gradients are computed chunk by chunk inside ``forward``.

    The teacher side is a signal object (`DenseTeacherSignal`, or the cached top-k one of `sparse_losses`) giving,
    per chunk of the selected rows, what its ``per_token`` divergence compares with the student's log-probs. ``head``
    carries the student's logit scale and softcap (None: ``s_hidden`` are its logits already). Outputs the *sums*
    ``(kd_sum, ce_sum)`` over the selected rows; normalisation happens in `fused_loss`.
    """

    @staticmethod
    def forward(ctx, s_hidden: Tensor, s_weight: Tensor | None, s_bias: Tensor | None,  # type: ignore[override]
                job: LossJob) -> tuple[Tensor, Tensor]:
        """`s_hidden` ``[N, H_s]`` (or the student's own logits ``[N, V_s]`` when `s_weight` is None), its lm_head
        `s_weight` ``[V_s, H_s]`` and `s_bias` ``[V_s]``; the rest of the call in `job`."""
        ctx.set_materialize_grads(False)
        h_s = s_hidden if job.rows is None else s_hidden.index_select(0, job.rows)
        # needs_input_grad ignores the caller's grad mode; under torch.no_grad() (eval) skip all grad work.
        need = tuple(job.grad_enabled and x for x in ctx.needs_input_grad[:3])
        done = ChunkPass(h_s, s_weight, s_bias, job, need).run()
        ctx.save_for_backward(job.rows, *(grads for term in (done.kd, done.ce)
                                          for grads in term.saved(s_weight, s_bias)))
        ctx.hidden_shape = s_hidden.shape
        if not done.has_ce:
            ctx.mark_non_differentiable(done.ce_sum)
        return done.kd_sum, done.ce_sum

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kd: Tensor | None, grad_ce: Tensor | None):  # type: ignore[override]
        rows, gh_kd, gw_kd, gb_kd, gh_ce, gw_ce, gb_ce = ctx.saved_tensors

        def combine(kd_part: Tensor | None, ce_part: Tensor | None) -> Tensor | None:
            out = None
            for part, scale in ((kd_part, grad_kd), (ce_part, grad_ce)):
                if part is not None and scale is not None:
                    term = part * scale.to(part.dtype)
                    out = term if out is None else out + term
            return out

        grad_h = combine(gh_kd, gh_ce)
        if grad_h is not None and rows is not None:
            grad_h = grad_h.new_zeros(ctx.hidden_shape).index_copy_(0, rows, grad_h)
        return grad_h, combine(gw_kd, gw_ce), combine(gb_kd, gb_ce), None


def select_loss_rows(
    states: Tensor, mask: Tensor | None, labels: Tensor | None = None, rows: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Flatten ``states`` ``[B, T, F]`` (or ``[N, F]``) and pick the rows where ``mask`` ``[B, T]`` is True (`rows`:
    their row-major indices when already known, `data.loss_layout`: then the mask is not read, and nothing waits).

    Returns ``(flat [N, F], rows [n] int64 row-major indices or None for all, labels [n] or None)``.
    """
    lead = states.shape[:-1]
    for name, t in (("mask", mask), ("labels", labels)):
        if t is not None and t.shape != lead:
            raise ValueError(f"{name} shape {tuple(t.shape)} must equal the hidden leading shape {tuple(lead)}.")
    flat = states.reshape(-1, states.shape[-1])
    if rows is None and mask is not None:
        rows = mask.reshape(-1).nonzero().squeeze(1)
    if labels is not None:
        labels = labels.reshape(-1) if rows is None else labels.reshape(-1).index_select(0, rows)
    return flat, rows, labels


def head_shape(states: Tensor, head: LMHead | None) -> tuple[int, int]:
    """``(V, H)`` of a head's weight; without a head, ``states`` are logits: ``(V, V)``."""
    return (states.shape[-1], states.shape[-1]) if head is None else tuple(head.weight.shape)


def fused_loss(
    student_states: Tensor,
    student_head: LMHead | None,
    teacher: TeacherSignal,
    settings: LossSettings,
    rows: Tensor | None,
    labels: Tensor | None = None,
    num_items_in_batch: int | Tensor | None = None,
    correction: RolloutCorrection | None = None,
    diagnostics: LossDiagnostics | None = None,
) -> DistillationLossOutput:
    """KD (and CE with ``labels``) over the selected ``rows`` of ``student_states`` ``[N, F]``, a chunk at a time.

    ``student_head`` projects the states to logits (None: the states are the student's logits); ``teacher`` is a
    signal over the same rows, in order (`DenseTeacherSignal`, `sparse_losses.SparseSignalChunks`). Both terms are
    sums over the rows / ``num_items_in_batch`` (else / the row count), in >= fp32, without T² scaling.
    ``correction`` (rows sampled by a rollout engine, with ``labels``): records each row's trainer-vs-engine
    log-prob gap and, with its cap, weights each row's KD and CE (`loss.rollout_correction`). ``diagnostics``: the
    teacher signal adds each chunk's agreement, KL at T = 1, CEs and entropies to it (`loss.diagnostics`).
    """
    v_s, h_dim = head_shape(student_states, student_head)
    if student_states.shape[-1] != h_dim:
        raise ValueError(f"hidden size {student_states.shape[-1]} does not match the lm_head {(v_s, h_dim)}.")
    vocab = settings.vocab_size or v_s
    if vocab > v_s:
        raise ValueError(f"vocab_size={vocab} must be in [1, the student's vocabulary {v_s}].")
    n = student_states.shape[0] if rows is None else rows.numel()
    chunk = min(settings.chunk_size or default_chunk_size(v_s), max(n, 1))
    if correction is not None and correction.engine.numel() != n:
        raise ValueError(f"The rollout engine scored {correction.engine.numel()} sampled tokens, the loss selects {n}: "
                         "the batch's completions are not the ones the engine sampled.")
    weight = None if student_head is None else student_head.weight
    bias = None if student_head is None else student_head.bias
    job = LossJob(rows, labels, teacher, settings, student_head, vocab, chunk, torch.is_grad_enabled(), correction,
                  diagnostics)
    kd_sum, ce_sum = _ChunkedDistillation.apply(student_states, weight, bias, job)
    if diagnostics is not None:
        teacher.observe_batch(diagnostics)
    kd = normalise_sum(kd_sum, n, num_items_in_batch)
    ce = normalise_sum(ce_sum, n, num_items_in_batch) if labels is not None else None
    return DistillationLossOutput(kd, ce)


def features_loss(student: LossFeatures, *, teacher, target: Tensor, mask: Tensor, settings: LossSettings,
                  num_items_in_batch=None, correction: RolloutCorrection | None = None,
                  diagnostics: LossDiagnostics | None = None,
                  sampled: SampledTokenJob | None = None,
                  rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """One micro-batch's ``(kd, ce, aux)``, run inside the student's patched forward (`model.fused_forward`, so
    DeepSpeed's hooks wrap it): the student's `LossFeatures` at the kept positions, the loss tokens `mask` ``[B, K]``
    and their `target` ``[B, K]``, and the teacher over them (a `teacher.base.TeacherBatch`: its `heads`, gathered
    around the loss, and its `signal`; a routed signal's `order` reorders the rows teacher by teacher). ``aux``: a
    Mixture-of-Experts student's router load-balancing loss of the same forward (None: not asked for). `sampled`: the
    rows are the student's own samples and the KD term is the sampled-token objective (`loss.sampled_token`), its
    ratio against the engine's log-probs in `correction` when an engine sampled. `rows`: the loss tokens' indices
    in ``[B, K]`` (`data.loss_layout.LossLayout.rows`; None: found from `mask`)."""
    s_flat, rows, labels = select_loss_rows(student.states, mask, target.clamp(min=0), rows)
    heads = [head for head in (student.head, *teacher.heads) if head is not None]
    with gathered(*(param for head in heads for param in head.params)):
        signal = teacher.signal(rows, len(labels), settings)
        if signal.order is not None:  # routed: the rows teacher by teacher (`loss.combined`)
            rows, labels = rows.index_select(0, signal.order), labels.index_select(0, signal.order)
            if correction is not None:  # the engine's log-probs, in the same order
                correction.engine = correction.engine.index_select(0, signal.order.to(correction.engine.device))
                correction.gap = torch.zeros_like(correction.engine, dtype=torch.float32)
        if sampled is not None:
            vocab = settings.vocab_size or head_shape(s_flat, student.head)[0]
            chunk = settings.chunk_size or default_chunk_size(vocab)
            signal = sampled_token_signal(signal, sampled, rows, labels, mask.shape[1], s_flat, student.head, vocab,
                                          chunk, ratio_reference(correction))
        kd, ce = fused_loss(s_flat, student.head, signal, settings, rows, labels, num_items_in_batch, correction,
                            diagnostics)
    return kd, ce, student.aux_loss


def chunked_distillation_loss(
    student_hidden: Tensor,
    student_lm_head_weight: Tensor | None,
    teacher_hidden: Tensor,
    teacher_lm_head_weight: Tensor | None,
    mask: Tensor | None = None,
    loss_type: str = "forward_kl",
    *,
    labels: Tensor | None = None,
    student_lm_head_bias: Tensor | None = None,
    teacher_lm_head_bias: Tensor | None = None,
    num_items_in_batch: int | Tensor | None = None,
    student_logit_scale: float | None = None,
    teacher_logit_scale: float | None = None,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    **settings,
) -> DistillationLossOutput:
    """Distillation loss straight from hidden states, never materialising full ``[N, V]`` logits (functional form
    of `fused_loss`).

    Shapes: hidden ``[B, T, H_s]`` / ``[B, T, H_t]`` with mask/labels ``[B, T]``, or ``[N, H]`` with ``[N]``;
    weights ``[V_s, H_s]`` / ``[V_t, H_t]``, biases ``[V_s]`` / ``[V_t]``. Rows where ``mask`` is True are
    selected first, then projected ``chunk_size`` rows at a time (auto: ~2^25 fp32 logits per chunk). KD
    compares the first ``vocab_size`` logits (default ``min(V_s, V_t)``) at ``temperature``; with ``labels``
    (already shifted, aligned with the rows) the student's CE over its full vocabulary at T=1 is also returned
    (label -100 rows add 0). Both are sums over selected rows / ``num_items_in_batch`` (else / row count), in
    >= fp32. Grads reach the student hidden (and weight/bias if they require grad); teacher inputs never get
    grads. A frozen student weight (``requires_grad=False``) gets no weight-grad buffer. ``kd_grad=False`` /
    ``ce_grad=False``: that term is returned for logging but gets no gradient (and no gradient buffers), for a
    loss that weights it 0 (``alpha`` = 0 or 1). A weight of None means that side's "hidden" states are already its
    logits ``[..., V]`` (a model's own, see `trl_distill.model.logit_check`): they are used as they are (no bias,
    scale or softcap is applied), chunk by chunk all the same. ``settings``: the `LossSettings` fields (``beta``,
    ``skew_alpha``, ``temperature``, ``chunk_size``, ``vocab_size``, ``kd_grad``, ``ce_grad``).
    """
    student_head = _head("student", student_lm_head_weight, student_lm_head_bias, student_logit_scale, student_softcap)
    teacher_head = _head("teacher", teacher_lm_head_weight, teacher_lm_head_bias, teacher_logit_scale, teacher_softcap)
    (v_s, h_s_dim), (v_t, h_t_dim) = head_shape(student_hidden, student_head), head_shape(teacher_hidden, teacher_head)
    if student_hidden.shape[-1] != h_s_dim or teacher_hidden.shape[-1] != h_t_dim:
        raise ValueError(
            f"hidden sizes {student_hidden.shape[-1]} / {teacher_hidden.shape[-1]} do not match the lm_head "
            f"weights {(v_s, h_s_dim)} / {(v_t, h_t_dim)}."
        )
    if teacher_hidden.shape[:-1] != student_hidden.shape[:-1]:
        raise ValueError(f"student/teacher hidden leading shapes differ: {tuple(student_hidden.shape[:-1])} vs "
                         f"{tuple(teacher_hidden.shape[:-1])}.")
    vocab_size = settings.pop("vocab_size", None)
    if vocab_size is not None and not 1 <= vocab_size <= min(v_s, v_t):
        raise ValueError(f"vocab_size={vocab_size} must be in [1, min(student vocab {v_s}, teacher vocab {v_t})].")
    loss = LossSettings(divergence=loss_type, vocab_size=vocab_size or min(v_s, v_t), **settings)
    s_flat, rows, labels = select_loss_rows(student_hidden, mask, labels)
    teacher = DenseTeacherSignal(_rows(teacher_hidden.detach(), rows), teacher_head, loss.vocab_size, loss.temperature)
    return fused_loss(s_flat, student_head, teacher, loss, rows, labels, num_items_in_batch)


def chunked_divergence(*args, **kwargs) -> Tensor:
    """KD-only `chunked_distillation_loss` (same arguments, no labels); returns the scalar ``kd`` loss."""
    if kwargs.get("labels") is not None:
        raise TypeError("chunked_divergence takes no labels; use chunked_distillation_loss for KD and CE.")
    return chunked_distillation_loss(*args, **kwargs).kd


def _head(side: str, weight: Tensor | None, bias: Tensor | None, scale: float | None,
          softcap: float | None) -> LMHead | None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{side}_softcap must be > 0, got {softcap}.")
    return None if weight is None else LMHead(weight, bias, scale, softcap)


def _rows(states: Tensor, rows: Tensor | None) -> Tensor:
    flat = states.reshape(-1, states.shape[-1])
    return flat if rows is None else flat.index_select(0, rows)
