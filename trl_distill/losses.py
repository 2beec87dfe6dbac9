"""Token-level distillation divergences and a chunked, fused lm-head + divergence loss.

Notation: ``p`` is the teacher distribution, ``q`` the student distribution, both ``softmax(logits / T)``.
All per-token functions take fp32 (or fp64) log-probabilities ``[N, V]`` and return ``[N]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .modeling import finalise_logits

__all__ = [
    "LOSS_TYPES",
    "DistillationLossOutput",
    "chunked_distillation_loss",
    "chunked_divergence",
    "default_chunk_size",
    "divergence",
    "forward_kl",
    "jsd",
    "per_token_divergence",
    "reverse_kl",
    "skew_forward_kl",
    "skew_reverse_kl",
    "tvd",
]

LOSS_TYPES = ("forward_kl", "reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tvd")

# One chunk's fp32 logits hold about this many elements when ``chunk_size`` is None.
_AUTO_CHUNK_ELEMENTS = 1 << 25


# ----------------------------------------------------------------------------------------------------
# Per-token divergences: log-probs [N, V] -> [N]
# ----------------------------------------------------------------------------------------------------
def _kl(logp_a: Tensor, logp_b: Tensor) -> Tensor:
    """KL(a ‖ b) = Σ_v a·(log a − log b). ``[N, V]`` x2 -> ``[N]``."""
    return (logp_a.exp() * (logp_a - logp_b)).sum(-1)


def _log_mixture(logp_a: Tensor, logp_b: Tensor, weight_a: float) -> Tensor:
    """log(w·a + (1−w)·b), computed stably with logaddexp. ``[N, V]`` x2 -> ``[N, V]``."""
    if weight_a == 0.0:
        return logp_b
    if weight_a == 1.0:
        return logp_a
    return torch.logaddexp(logp_a + math.log(weight_a), logp_b + math.log1p(-weight_a))


def forward_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(p ‖ q). ``[N, V]`` x2 -> ``[N]``."""
    return _kl(teacher_logp, student_logp)


def reverse_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(q ‖ p). ``[N, V]`` x2 -> ``[N]``."""
    return _kl(student_logp, teacher_logp)


def jsd(student_logp: Tensor, teacher_logp: Tensor, beta: float = 0.5) -> Tensor:
    """Generalized JSD_β = β·KL(p ‖ m) + (1−β)·KL(q ‖ m) with m = β·p + (1−β)·q. ``[N, V]`` x2 -> ``[N]``.

    As in TRL's ``GKDTrainer.generalized_jsd_loss``, the endpoints are special-cased: β == 0 returns the
    forward KL(p ‖ q) and β == 1 the reverse KL(q ‖ p) (the literal formula would give 0 there).
    """
    if beta == 0.0:
        return forward_kl(student_logp, teacher_logp)
    if beta == 1.0:
        return reverse_kl(student_logp, teacher_logp)
    log_m = _log_mixture(teacher_logp, student_logp, beta)
    return beta * _kl(teacher_logp, log_m) + (1.0 - beta) * _kl(student_logp, log_m)


def skew_forward_kl(student_logp: Tensor, teacher_logp: Tensor, alpha: float = 0.1) -> Tensor:
    """DistiLLM skew KL(p ‖ α·p + (1−α)·q). ``[N, V]`` x2 -> ``[N]``."""
    return _kl(teacher_logp, _log_mixture(teacher_logp, student_logp, alpha))


def skew_reverse_kl(student_logp: Tensor, teacher_logp: Tensor, alpha: float = 0.1) -> Tensor:
    """DistiLLM skew KL(q ‖ (1−α)·p + α·q). ``[N, V]`` x2 -> ``[N]``."""
    return _kl(student_logp, _log_mixture(student_logp, teacher_logp, alpha))


def tvd(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """Total variation ½·Σ_v |p − q|. ``[N, V]`` x2 -> ``[N]``."""
    return 0.5 * (teacher_logp.exp() - student_logp.exp()).abs().sum(-1)


_PER_TOKEN: dict[str, Callable[..., Tensor]] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "jsd": jsd,
    "skew_forward_kl": skew_forward_kl,
    "skew_reverse_kl": skew_reverse_kl,
    "tvd": tvd,
}


def _check_args(loss_type: str, beta: float, skew_alpha: float, temperature: float) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; valid choices are {', '.join(LOSS_TYPES)}.")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}.")
    if not 0.0 <= skew_alpha <= 1.0:
        raise ValueError(f"skew_alpha must be in [0, 1], got {skew_alpha}.")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")


def per_token_divergence(
    student_logp: Tensor, teacher_logp: Tensor, loss_type: str, *, beta: float = 0.5, skew_alpha: float = 0.1
) -> Tensor:
    """Dispatch to the per-token divergence named ``loss_type``. Log-probs ``[N, V]`` x2 -> ``[N]``."""
    _check_args(loss_type, beta, skew_alpha, 1.0)
    if loss_type == "jsd":
        return jsd(student_logp, teacher_logp, beta)
    if loss_type.startswith("skew_"):
        return _PER_TOKEN[loss_type](student_logp, teacher_logp, skew_alpha)
    return _PER_TOKEN[loss_type](student_logp, teacher_logp)


def _div(logits: Tensor, temperature: float) -> Tensor:
    """``logits / T``; the identical tensor at T == 1 (saves a full-size copy and its backward pass)."""
    return logits if temperature == 1.0 else logits / temperature


def _normalise(total: Tensor, num_rows: int, num_items_in_batch: int | Tensor | None) -> Tensor:
    """Sum -> per-item loss: divide by ``num_items_in_batch`` if given, else by the row count (both >= 1)."""
    if num_items_in_batch is None:
        return total / max(num_rows, 1)
    if isinstance(num_items_in_batch, Tensor):
        return total / num_items_in_batch.to(total.device).clamp_min(1)
    return total / max(num_items_in_batch, 1)


# ----------------------------------------------------------------------------------------------------
# Logits -> loss
# ----------------------------------------------------------------------------------------------------
def divergence(
    student_logits: Tensor,
    teacher_logits: Tensor,
    loss_type: str,
    *,
    beta: float = 0.5,
    skew_alpha: float = 0.1,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    num_items_in_batch: int | Tensor | None = None,
) -> Tensor:
    """Scalar loss from student/teacher logits ``[..., V]`` and an optional bool ``mask [...]`` (True = loss).

    Returns Σ over unmasked tokens / ``num_items_in_batch`` if given, else the mean over unmasked tokens.
    Computed in ``promote_types(dtype, float32)``; ``teacher_logits`` are not detached; no T² scaling.
    """
    _check_args(loss_type, beta, skew_alpha, temperature)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits {tuple(teacher_logits.shape)} "
            "must have the same shape; slice both to the shared vocabulary first."
        )
    vocab = student_logits.shape[-1]
    if mask is not None:
        student_logits, teacher_logits = student_logits[mask], teacher_logits[mask]
    s = student_logits.reshape(-1, vocab)
    t = teacher_logits.reshape(-1, vocab)
    dtype = torch.promote_types(s.dtype, torch.float32)
    s_logp = F.log_softmax(_div(s.to(dtype), temperature), dim=-1)
    t_logp = F.log_softmax(_div(t.to(dtype), temperature), dim=-1)
    per_token = per_token_divergence(s_logp, t_logp, loss_type, beta=beta, skew_alpha=skew_alpha)
    return _normalise(per_token.sum(), s.shape[0], num_items_in_batch)


# ----------------------------------------------------------------------------------------------------
# Chunked fused lm-head + divergence (+ CE)
# ----------------------------------------------------------------------------------------------------
class DistillationLossOutput(NamedTuple):
    """``kd``: distillation loss (scalar); ``ce``: student cross-entropy (scalar) when labels were given."""

    kd: Tensor
    ce: Tensor | None


def _forward_kl_closed_form(s_logits: Tensor, t_logp: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Σ_rows KL(p ‖ q) and its gradient w.r.t. ``s_logits``, (q − p) / T, without autograd (autograd: q·Σp − p).

    Overwrites ``t_logp``; allocates no ``[c, V]`` temporaries beyond ``log q`` and ``p``."""
    s_logp = F.log_softmax(_div(s_logits, temperature), dim=-1)
    p = t_logp.exp()
    diff = t_logp.sub_(s_logp)  # log p − log q
    grad = s_logp.exp_().sub_(p)  # q − p
    kd = diff.mul_(p).sum()
    return kd, grad if temperature == 1.0 else grad.div_(temperature)


def _backprop(g: Tensor, hs: Tensor, weight: Tensor | None, gh: Tensor | None, gw: Tensor | None,
              gb: Tensor | None) -> None:
    """From ``g`` = d(chunk loss)/d(logits) ``[c, V]``: ``gh = g @ W``, ``gw += g.T @ hs``, ``gb += g.sum(0)``.
    Matmuls run in the weight's dtype, the ``gw``/``gb`` sums in theirs (>= fp32). No weight: ``hs`` are the logits
    themselves and ``gh = g``."""
    if weight is None:
        if gh is not None:
            gh.copy_(g)
        return
    g_low, hs_low = g.to(weight.dtype), hs.to(weight.dtype)
    if gh is not None and gh.dtype == g_low.dtype:
        torch.mm(g_low, weight, out=gh)
    elif gh is not None:
        gh.copy_(g_low @ weight)
    if gw is not None and gw.dtype == g_low.dtype:
        gw.addmm_(g_low.T, hs_low)
    elif gw is not None:
        gw.add_(g_low.T @ hs_low)
    if gb is not None:
        gb.add_(g.sum(0))


class DenseTeacherSignal:
    """The teacher side of the chunked loss from its hidden states: log-probs ``[c, vocab]`` one chunk at a time.

    ``hidden`` ``[n, H_t]`` holds the selected rows only; the lm_head's first ``vocab`` rows are used. Without a
    weight, ``hidden`` ``[n, V_t]`` are the teacher's own logits."""

    closed_form = True  # the chunk is full log-probs: the forward KL gradient has a closed form

    def __init__(self, hidden, weight, bias, vocab, scale, softcap, temperature, compute):
        self.hidden, self.vocab = hidden, vocab
        self.weight = None if weight is None else weight[:vocab]
        self.bias = None if bias is None else bias[:vocab]
        self.scale, self.softcap, self.temperature, self.compute = scale, softcap, temperature, compute

    def chunk(self, rows: slice) -> Tensor:
        if self.weight is None:
            logits = self.hidden[rows, : self.vocab].to(self.compute)
        else:
            logits = F.linear(self.hidden[rows], self.weight, self.bias).to(self.compute)
        return F.log_softmax(_div(finalise_logits(logits, self.scale, self.softcap), self.temperature), dim=-1)

    @staticmethod
    def per_token(student_logp: Tensor, teacher_logp: Tensor, cfg: dict) -> Tensor:
        return per_token_divergence(
            student_logp, teacher_logp, cfg["loss_type"], beta=cfg["beta"], skew_alpha=cfg["skew_alpha"]
        )


class _ChunkedDistillation(torch.autograd.Function):
    """Fused ``hidden @ W.T`` -> divergence (+ CE); gradients are computed chunk by chunk inside ``forward``.

    The teacher side is a signal object (`DenseTeacherSignal`, or the cached top-k one of `sparse_losses`) giving,
    per chunk of the selected rows, what its ``per_token`` divergence compares with the student's log-probs.
    Outputs the *sums* ``(kd_sum, ce_sum)`` over the selected rows; normalisation happens outside.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        s_hidden: Tensor,  # [N, H_s], or the student's own logits [N, V_s] when s_weight is None
        s_weight: Tensor | None,  # [V_s, H_s]
        s_bias: Tensor | None,  # [V_s]
        rows: Tensor | None,  # [n] int64 indices of the rows carrying loss (None = all)
        labels: Tensor | None,  # [n] int64 targets for CE
        teacher,  # a teacher signal over the n selected rows, never differentiated
        cfg: dict,
    ) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        h_s = s_hidden if rows is None else s_hidden.index_select(0, rows)
        n, vocab, temperature = h_s.shape[0], cfg["vocab_size"], cfg["temperature"]
        compute = torch.promote_types(h_s.dtype, torch.float32)
        # needs_input_grad ignores the caller's grad mode; under torch.no_grad() (eval) skip all grad work.
        need_h, need_w, need_b = (cfg["grad_enabled"] and x for x in ctx.needs_input_grad[:3])
        need_b = need_b and s_bias is not None
        has_ce = labels is not None
        # A term whose weight is 0 (alpha = 1 or 0) is still computed for logging, but gets no gradient buffers.
        kd_grad, ce_grad = cfg["kd_grad"], cfg["ce_grad"] and has_ce
        want_grad = (need_h or need_w or need_b) and (kd_grad or ce_grad)
        # d kd / d logits in closed form
        closed_form = want_grad and kd_grad and cfg["loss_type"] == "forward_kl" and teacher.closed_form
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

        for start in range(0, n, cfg["chunk_size"]):
            rows_c = slice(start, start + cfg["chunk_size"])
            hs = h_s[rows_c]
            signal = teacher.chunk(rows_c)
            if s_weight is None:  # the model's own logits: a copy, so nothing below writes into them
                raw = hs.detach().to(compute, copy=True)
            else:
                raw = F.linear(hs, s_weight, s_bias).to(compute)  # [c, V_s], made a leaf below
            with torch.set_grad_enabled(want_grad):
                raw.requires_grad_(want_grad)
                logits = finalise_logits(raw, cfg["s_scale"], cfg["s_softcap"])
                if closed_form:
                    with torch.no_grad():
                        kd, g = _forward_kl_closed_form(logits[:, :vocab], signal, temperature)
                        g = g if vocab == g_cols else F.pad(g, (0, g_cols - vocab))  # padded columns: 0
                    if logits is not raw:  # chain through scale/softcap
                        (g,) = torch.autograd.grad(logits, raw, g, retain_graph=ce_grad)
                    outputs = []
                else:
                    with torch.set_grad_enabled(want_grad and kd_grad):
                        s_logp = F.log_softmax(_div(logits[:, :vocab], temperature), dim=-1)
                        kd = teacher.per_token(s_logp, signal, cfg).sum()
                    outputs = [(kd, gh_kd, gw_kd, gb_kd)] if want_grad and kd_grad else []
                del signal
                if has_ce:
                    with torch.set_grad_enabled(want_grad and ce_grad):
                        ce = F.cross_entropy(logits, labels[rows_c], reduction="sum")
                    if want_grad and ce_grad:
                        outputs.append((ce, gh_ce, gw_ce, gb_ce))
            kd_sum += kd.detach()
            ce_sum += ce.detach() if has_ce else 0.0
            if not want_grad:
                continue
            if closed_form:
                _backprop(g, hs, s_weight, None if gh_kd is None else gh_kd[rows_c], gw_kd, gb_kd)
                del g
            for i, (out, gh, gw, gb) in enumerate(outputs):
                # d(chunk loss)/d(raw logits): [c, V_s] in the compute dtype, through scale/softcap.
                (g,) = torch.autograd.grad(out, raw, retain_graph=i + 1 < len(outputs))
                _backprop(g, hs, s_weight, None if gh is None else gh[rows_c], gw, gb)

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
        return grad_h, combine(gw_kd, gw_ce), combine(gb_kd, gb_ce), None, None, None, None


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
    beta: float = 0.5,
    skew_alpha: float = 0.1,
    temperature: float = 1.0,
    num_items_in_batch: int | Tensor | None = None,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    student_logit_scale: float | None = None,
    teacher_logit_scale: float | None = None,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    kd_grad: bool = True,
    ce_grad: bool = True,
) -> DistillationLossOutput:
    """Distillation loss straight from hidden states, never materialising full ``[N, V]`` logits.

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
    logits ``[..., V]`` (a model's own, see `trl_distill.logit_check`): they are used as they are (no bias, scale or
    softcap is applied), chunk by chunk all the same.
    """
    _check_args(loss_type, beta, skew_alpha, temperature)
    v_s, h_s_dim = _head_shape(student_hidden, student_lm_head_weight)
    v_t, h_t_dim = _head_shape(teacher_hidden, teacher_lm_head_weight)
    if student_hidden.shape[-1] != h_s_dim or teacher_hidden.shape[-1] != h_t_dim:
        raise ValueError(
            f"hidden sizes {student_hidden.shape[-1]} / {teacher_hidden.shape[-1]} do not match the lm_head "
            f"weights {(v_s, h_s_dim)} / {(v_t, h_t_dim)}."
        )
    lead = student_hidden.shape[:-1]
    if teacher_hidden.shape[:-1] != lead:
        raise ValueError(
            f"student/teacher hidden leading shapes differ: {tuple(lead)} vs {tuple(teacher_hidden.shape[:-1])}."
        )
    for name, t in (("mask", mask), ("labels", labels)):
        if t is not None and t.shape != lead:
            raise ValueError(f"{name} shape {tuple(t.shape)} must equal the hidden leading shape {tuple(lead)}.")
    if vocab_size is None:
        vocab_size = min(v_s, v_t)
    elif vocab_size > min(v_s, v_t) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, min(student vocab {v_s}, teacher vocab {v_t})].")
    for name, cap in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap)):
        if cap is not None and not cap > 0:
            raise ValueError(f"{name} must be > 0, got {cap}.")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")

    s_flat = student_hidden.reshape(-1, h_s_dim)
    t_flat = teacher_hidden.detach().reshape(-1, h_t_dim)
    rows = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)
    if labels is not None:
        labels = labels.reshape(-1) if rows is None else labels.reshape(-1).index_select(0, rows)
    t_rows = t_flat if rows is None else t_flat.index_select(0, rows)
    t_bias = None if teacher_lm_head_bias is None else teacher_lm_head_bias.detach()
    compute = torch.promote_types(s_flat.dtype, torch.float32)
    t_weight = None if teacher_lm_head_weight is None else teacher_lm_head_weight.detach()
    teacher = DenseTeacherSignal(t_rows, t_weight, t_bias, vocab_size, teacher_logit_scale, teacher_softcap,
                                 temperature, compute)
    return _run_chunked(
        s_flat, student_lm_head_weight, student_lm_head_bias, rows, labels, teacher, num_items_in_batch,
        loss_type=loss_type, beta=beta, skew_alpha=skew_alpha, temperature=temperature, vocab_size=vocab_size,
        chunk_size=chunk_size, s_scale=student_logit_scale, s_softcap=student_softcap, kd_grad=kd_grad,
        ce_grad=ce_grad,
    )  # fmt: skip


def _head_shape(hidden: Tensor, weight: Tensor | None) -> tuple[int, int]:
    """``(V, H)`` of an lm_head weight; without one, ``hidden`` are logits: ``(V, V)``."""
    return (hidden.shape[-1], hidden.shape[-1]) if weight is None else tuple(weight.shape)


def default_chunk_size(vocab: int) -> int:
    """Rows per chunk so that one chunk of fp32 logits holds about 2^25 elements (128 MiB)."""
    return max(1, _AUTO_CHUNK_ELEMENTS // vocab)


def _run_chunked(s_flat, weight, bias, rows, labels, teacher, num_items_in_batch, *, chunk_size, **settings):
    """Run `_ChunkedDistillation` over the selected rows of ``s_flat`` ``[N, H]`` against a teacher signal and
    normalise its sums (see `chunked_distillation_loss`). ``settings``: the cfg keys the Function reads."""
    n = s_flat.shape[0] if rows is None else rows.numel()
    if chunk_size is None:
        chunk_size = default_chunk_size(s_flat.shape[1] if weight is None else weight.shape[0])
    cfg = {"grad_enabled": torch.is_grad_enabled(), "chunk_size": min(chunk_size, max(n, 1)), **settings}
    kd_sum, ce_sum = _ChunkedDistillation.apply(s_flat, weight, bias, rows, labels, teacher, cfg)
    kd = _normalise(kd_sum, n, num_items_in_batch)
    ce = _normalise(ce_sum, n, num_items_in_batch) if labels is not None else None
    return DistillationLossOutput(kd, ce)


def chunked_divergence(
    student_hidden: Tensor,
    student_lm_head_weight: Tensor | None,
    teacher_hidden: Tensor,
    teacher_lm_head_weight: Tensor | None,
    mask: Tensor | None = None,
    loss_type: str = "forward_kl",
    *,
    student_lm_head_bias: Tensor | None = None,
    teacher_lm_head_bias: Tensor | None = None,
    beta: float = 0.5,
    skew_alpha: float = 0.1,
    temperature: float = 1.0,
    num_items_in_batch: int | Tensor | None = None,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    student_logit_scale: float | None = None,
    teacher_logit_scale: float | None = None,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
) -> Tensor:
    """KD-only :func:`chunked_distillation_loss` (no labels); returns the scalar ``kd`` loss."""
    return chunked_distillation_loss(
        student_hidden, student_lm_head_weight, teacher_hidden, teacher_lm_head_weight, mask, loss_type,
        student_lm_head_bias=student_lm_head_bias, teacher_lm_head_bias=teacher_lm_head_bias, beta=beta,
        skew_alpha=skew_alpha, temperature=temperature, num_items_in_batch=num_items_in_batch,
        chunk_size=chunk_size, vocab_size=vocab_size, student_logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale, student_softcap=student_softcap, teacher_softcap=teacher_softcap,
    ).kd  # fmt: skip
