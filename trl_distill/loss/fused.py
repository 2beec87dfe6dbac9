"""The distillation loss: logits -> divergence (`divergence`), and the chunked, fused lm-head path that never builds
full-vocabulary logits (`fused_loss`; functional form `chunked_distillation_loss`).

Notation: ``p`` is the teacher distribution, ``q`` the student distribution, both ``softmax(logits / T)``. The
formulas are in `trl_distill.loss.divergences`; everything about the loss that is not a tensor is one frozen
`LossSettings`, and each model's head (weight, bias, scale, softcap) travels as a `modeling.LMHead`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..model.fused_forward import LMHead, finalise_logits
from .dense import DenseTeacherSignal
from .diagnostics import LossDiagnostics
from .divergences import at_temperature, normalise_sum
from .settings import LossSettings, default_chunk_size
from .workspace import Workspace

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


def _forward_kl_closed_form(s_logits: Tensor, t_logp: Tensor, temperature: float,
                            weights: Tensor | None = None, work: Workspace | None = None,
                            labels: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Σ_rows w·KL(p ‖ q) and its gradient w.r.t. ``s_logits``, w·(q − p) / T, without autograd (autograd: q·Σp − p);
    ``weights`` None: w = 1. With `labels`, also ``log q`` at them (``[c]``; the CE's terms when T = 1), else None.

    Overwrites ``t_logp``; allocates no ``[c, V]`` temporaries beyond ``log q`` and ``p`` (in `work`, if given)."""
    tempered = at_temperature(s_logits, temperature)
    s_logp = F.log_softmax(tempered, dim=-1) if work is None else work.log_softmax("log_q", tempered)
    at_labels = None if labels is None else s_logp.gather(1, labels[:, None]).squeeze(1)
    p = t_logp.exp() if work is None else work.exp("p", t_logp)
    diff = t_logp.sub_(s_logp)  # log p − log q
    grad = s_logp.exp_().sub_(p)  # q − p
    if weights is None:
        kd = diff.mul_(p).sum()
    else:
        kd = (diff.mul_(p).sum(-1) * weights).sum()
        grad.mul_(weights[:, None])
    return kd, grad if temperature == 1.0 else grad.div_(temperature), at_labels


def _backprop(g: Tensor, hs: Tensor, weight: Tensor | None, gh: Tensor | None, gw: Tensor | None,
              gb: Tensor | None, work: Workspace) -> None:
    """From ``g`` = d(chunk loss)/d(logits) ``[c, V]``: ``gh = g @ W``, ``gw += g.T @ hs``, ``gb += g.sum(0)``.
    Matmuls run in the weight's dtype, the ``gw``/``gb`` sums in theirs (>= fp32). No weight: ``hs`` are the logits
    themselves and ``gh = g``."""
    if weight is None:
        if gh is not None:
            gh.copy_(g)
        return
    g_low, hs_low = work.cast("low", g, weight.dtype), hs.to(weight.dtype)
    if gh is not None and gh.dtype == g_low.dtype:
        torch.mm(g_low, weight, out=gh)
    elif gh is not None:
        gh.copy_(g_low @ weight)
    if gw is not None and gw.dtype == g_low.dtype:
        gw.addmm_(g_low.T, hs_low)
    elif gw is not None:
        gw.add_(torch.mm(g_low.T, hs_low, out=work.get("gw.low", *gw.shape, g_low.dtype, g_low.device)))
    if gb is not None:
        gb.add_(g.sum(0))


class _ChunkedDistillation(torch.autograd.Function):
    """Fused ``hidden @ W.T`` -> divergence (+ CE); gradients are computed chunk by chunk inside ``forward``.

    The teacher side is a signal object (`DenseTeacherSignal`, or the cached top-k one of `sparse_losses`) giving,
    per chunk of the selected rows, what its ``per_token`` divergence compares with the student's log-probs. ``head``
    carries the student's logit scale and softcap (None: ``s_hidden`` are its logits already). Outputs the *sums*
    ``(kd_sum, ce_sum)`` over the selected rows; normalisation happens in `fused_loss`.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        s_hidden: Tensor,  # [N, H_s], or the student's own logits [N, V_s] when s_weight is None
        s_weight: Tensor | None,  # [V_s, H_s]
        s_bias: Tensor | None,  # [V_s]
        rows: Tensor | None,  # [n] int64 indices of the rows carrying loss (None = all)
        labels: Tensor | None,  # [n] int64 targets for CE
        teacher: TeacherSignal,  # over the n selected rows (`loss.signal`), never differentiated
        settings: LossSettings,
        head: LMHead | None,  # the student's transform (scale, softcap); None: s_hidden are logits
        vocab: int,  # the first `vocab` logits are compared
        chunk_size: int,
        grad_enabled: bool,  # the caller's grad mode (needs_input_grad ignores it)
        correction: RolloutCorrection | None,  # the rollout engine's log-probs of the rows' tokens (with labels)
        diagnostics: LossDiagnostics | None,  # filled with agreement, KL at T = 1, CEs, entropies (`diagnostics`)
    ) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        h_s = s_hidden if rows is None else s_hidden.index_select(0, rows)
        n, temperature = h_s.shape[0], settings.temperature
        compute = torch.promote_types(h_s.dtype, torch.float32)
        # needs_input_grad ignores the caller's grad mode; under torch.no_grad() (eval) skip all grad work.
        need_h, need_w, need_b = (grad_enabled and x for x in ctx.needs_input_grad[:3])
        need_b = need_b and s_bias is not None
        has_ce = labels is not None
        # A term whose weight is 0 (alpha = 1 or 0) is still computed for logging, but gets no gradient buffers.
        kd_grad, ce_grad = settings.kd_grad, settings.ce_grad and has_ce
        want_grad = (need_h or need_w or need_b) and (kd_grad or ce_grad)
        # d kd / d logits in closed form
        closed_form = want_grad and kd_grad and settings.divergence == "forward_kl" and teacher.closed_form
        g_cols = h_s.shape[1] if s_weight is None else s_weight.shape[0]

        # Per-row grads are written once (rows never repeat); weight/bias grads are accumulated in >= fp32.
        need_h, need_w, need_b = (want_grad and x for x in (need_h, need_w, need_b))
        gh_kd = torch.empty_like(h_s) if need_h and kd_grad else None
        gh_ce = torch.empty_like(h_s) if need_h and ce_grad else None
        gw_kd = s_weight.new_zeros(s_weight.shape, dtype=compute) if need_w and kd_grad else None
        gw_ce = s_weight.new_zeros(s_weight.shape, dtype=compute) if need_w and ce_grad else None
        gb_kd = s_bias.new_zeros(s_bias.shape, dtype=compute) if need_b and kd_grad else None
        gb_ce = s_bias.new_zeros(s_bias.shape, dtype=compute) if need_b and ce_grad else None
        kd_sum = h_s.new_zeros((), dtype=compute)
        ce_sum = h_s.new_zeros((), dtype=compute)

        scale, softcap = (None, None) if head is None else (head.logit_scale, head.softcap)
        work = teacher.work or Workspace()  # chunk buffers, shared with a dense teacher's
        for rows_c in chunk_slices(n, chunk_size, teacher.bounds):
            hs = h_s[rows_c]
            signal = teacher.chunk(rows_c, compute)
            if s_weight is None:  # the model's own logits: a copy, so nothing below writes into them
                raw = hs.detach().to(compute, copy=True)
            else:  # [c, V_s] in a reused buffer, made a leaf below (out= forms: no autograd here)
                with torch.no_grad():
                    raw = work.linear("student", hs, s_weight, s_bias, compute)
            with torch.set_grad_enabled(want_grad):
                raw.requires_grad_(want_grad)
                logits = finalise_logits(raw, scale, softcap)
                if diagnostics is not None:  # before the closed form, which overwrites the signal; in fp32 even
                    # under autocast (bf16 mixed precision), whose bf16 dot products would swamp a KL of 1e-2
                    with torch.no_grad(), torch.autocast(logits.device.type, enabled=False):
                        teacher.observe(diagnostics, rows_c, logits.detach(), signal,
                                        labels[rows_c] if has_ce else None, settings)
                w = None  # per-row weights (an importance-sampling correction of rollouts), else 1
                if correction is not None and has_ce:
                    with torch.no_grad():
                        w = correction.weights(rows_c, -F.cross_entropy(logits, labels[rows_c], reduction="none"))
                # The CE read off the closed form's log q (T = 1, the same columns): one log-softmax less per chunk
                ce_from_kd = (closed_form and has_ce and not ce_grad and w is None and temperature == 1.0
                              and vocab == g_cols)  # fmt: skip
                if closed_form:
                    with torch.no_grad():
                        kd, g, log_q = _forward_kl_closed_form(logits[:, :vocab], signal, temperature, w, work,
                                                               labels[rows_c] if ce_from_kd else None)
                        g = g if vocab == g_cols else F.pad(g, (0, g_cols - vocab))  # padded columns: 0
                    if logits is not raw:  # chain through scale/softcap
                        (g,) = torch.autograd.grad(logits, raw, g, retain_graph=ce_grad)
                    outputs = []
                else:
                    with torch.set_grad_enabled(want_grad and kd_grad):
                        s_logp = F.log_softmax(at_temperature(logits[:, :vocab], temperature), dim=-1)
                        kd = teacher.per_token(s_logp, signal, settings)
                        kd = kd.sum() if w is None else (kd * w).sum()
                    outputs = [(kd, gh_kd, gw_kd, gb_kd)] if want_grad and kd_grad else []
                del signal
                if ce_from_kd:
                    ce = -log_q.sum()
                elif has_ce:
                    with torch.set_grad_enabled(want_grad and ce_grad):
                        ce = F.cross_entropy(logits, labels[rows_c], reduction="sum" if w is None else "none")
                        ce = ce if w is None else (ce * w).sum()
                    if want_grad and ce_grad:
                        outputs.append((ce, gh_ce, gw_ce, gb_ce))
            kd_sum += kd.detach()
            teacher.tally(rows_c, kd.detach())  # a signal of several teachers counts each one's part
            ce_sum += ce.detach() if has_ce else 0.0
            if not want_grad:
                continue
            if closed_form:
                _backprop(g, hs, s_weight, None if gh_kd is None else gh_kd[rows_c], gw_kd, gb_kd, work)
                del g
            for i, (out, gh, gw, gb) in enumerate(outputs):
                # d(chunk loss)/d(raw logits): [c, V_s] in the compute dtype, through scale/softcap.
                (g,) = torch.autograd.grad(out, raw, retain_graph=i + 1 < len(outputs))
                _backprop(g, hs, s_weight, None if gh is None else gh[rows_c], gw, gb, work)

        # Keep the saved grads in the input dtypes (halves the saved [V, H] buffers for bf16 models).
        gw_kd, gw_ce = (None if x is None else x.to(s_weight.dtype) for x in (gw_kd, gw_ce))
        gb_kd, gb_ce = (None if x is None else x.to(s_bias.dtype) for x in (gb_kd, gb_ce))
        ctx.save_for_backward(rows, gh_kd, gh_ce, gw_kd, gw_ce, gb_kd, gb_ce)
        ctx.hidden_shape = s_hidden.shape
        if not has_ce:
            ctx.mark_non_differentiable(ce_sum)
        return kd_sum, ce_sum

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kd: Tensor | None, grad_ce: Tensor | None):  # type: ignore[override]
        rows, gh_kd, gh_ce, gw_kd, gw_ce, gb_kd, gb_ce = ctx.saved_tensors

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
        return grad_h, combine(gw_kd, gw_ce), combine(gb_kd, gb_ce), *([None] * 11)


def chunk_slices(n: int, size: int, bounds: list[int] | None = None) -> list[slice]:
    """The loss rows ``[0, n)`` a chunk of at most `size` at a time; with `bounds` (segment starts and the end, e.g.
    each teacher's rows of a routed signal) no chunk straddles a segment's edge."""
    edges = [0, n] if bounds is None else bounds
    return [slice(start, min(start + size, stop)) for lo, stop in zip(edges, edges[1:])
            for start in range(lo, stop, size)]


def select_loss_rows(
    states: Tensor, mask: Tensor | None, labels: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Flatten ``states`` ``[B, T, F]`` (or ``[N, F]``) and pick the rows where ``mask`` ``[B, T]`` is True.

    Returns ``(flat [N, F], rows [n] int64 row-major indices or None for all, labels [n] or None)``.
    """
    lead = states.shape[:-1]
    for name, t in (("mask", mask), ("labels", labels)):
        if t is not None and t.shape != lead:
            raise ValueError(f"{name} shape {tuple(t.shape)} must equal the hidden leading shape {tuple(lead)}.")
    flat = states.reshape(-1, states.shape[-1])
    rows = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)
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
    kd_sum, ce_sum = _ChunkedDistillation.apply(student_states, weight, bias, rows, labels, teacher, settings,
                                                student_head, vocab, chunk, torch.is_grad_enabled(), correction,
                                                diagnostics)
    if diagnostics is not None:
        teacher.observe_batch(diagnostics)
    kd = normalise_sum(kd_sum, n, num_items_in_batch)
    ce = normalise_sum(ce_sum, n, num_items_in_batch) if labels is not None else None
    return DistillationLossOutput(kd, ce)


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
