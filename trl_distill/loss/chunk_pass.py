"""One fused loss call's pass over its loss rows, a chunk at a time: the student's logits of the chunk, the KD against
the teacher signal and the CE, and their gradients with respect to the student's hidden states, lm_head weight and
bias, written into buffers as the chunk is done (the `fused._ChunkedDistillation` autograd function saves them for
its backward). Nothing here builds full-vocabulary logits for more than one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.fused_forward import LMHead, finalise_logits
from .divergences import at_temperature
from .workspace import Workspace

if TYPE_CHECKING:
    from .diagnostics import LossDiagnostics
    from .rollout_correction import RolloutCorrection
    from .settings import LossSettings
    from .signal import TeacherSignal


@dataclass(frozen=True)
class LossJob:
    """Everything of one fused loss call that is not the student's differentiated tensors."""

    rows: Tensor | None
    """``[n]`` int64 indices of the rows carrying loss (None: all)."""
    labels: Tensor | None
    """``[n]`` int64 targets for the CE (None: no CE)."""
    teacher: TeacherSignal
    """Over the n selected rows (`loss.signal`), never differentiated."""
    settings: LossSettings
    head: LMHead | None
    """The student's transform (scale, softcap); None: the states are its logits."""
    vocab: int
    """The first `vocab` logits are compared."""
    chunk_size: int
    grad_enabled: bool
    """The caller's grad mode (autograd's ``needs_input_grad`` ignores it)."""
    correction: RolloutCorrection | None = None
    """The rollout engine's log-probs of the rows' tokens (with labels)."""
    diagnostics: LossDiagnostics | None = None
    """Filled with agreement, KL at T = 1, CEs, entropies (`loss.diagnostics`)."""


class TermGradients:
    """One term's (KD's or CE's) gradients: per selected row of the hidden states (written once, rows never repeat),
    and the lm_head's weight and bias (accumulated in >= fp32)."""

    def __init__(self, wanted: bool, hidden: Tensor, weight: Tensor | None, bias: Tensor | None,
                 need: tuple[bool, bool, bool], compute: torch.dtype):
        need_h, need_w, need_b = (wanted and x for x in need)
        self.hidden = torch.empty_like(hidden) if need_h else None
        self.weight = weight.new_zeros(weight.shape, dtype=compute) if need_w else None
        self.bias = bias.new_zeros(bias.shape, dtype=compute) if need_b else None

    def add(self, g: Tensor, hs: Tensor, rows_c: slice, weight: Tensor | None, work: Workspace) -> None:
        """Backpropagate ``g`` = d(chunk term)/d(logits) ``[c, V]`` of the chunk `rows_c` into the buffers."""
        backprop(g, hs, weight, None if self.hidden is None else self.hidden[rows_c], self.weight, self.bias, work)

    def saved(self, weight: Tensor | None, bias: Tensor | None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(hidden, weight, bias)`` gradients, the lm_head's in the input dtypes (halves a bf16 model's)."""
        return (self.hidden, None if self.weight is None else self.weight.to(weight.dtype),
                None if self.bias is None else self.bias.to(bias.dtype))


def forward_kl_closed_form(s_logits: Tensor, t_logp: Tensor, temperature: float,
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


def backprop(g: Tensor, hs: Tensor, weight: Tensor | None, gh: Tensor | None, gw: Tensor | None,
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


class ChunkPass:
    """The selected student rows `h_s` ``[n, H_s]`` (or their logits, without a weight) through the lm_head and the
    loss, chunk after chunk (`run`); `need` says which of (hidden, weight, bias) want a gradient."""

    def __init__(self, h_s: Tensor, weight: Tensor | None, bias: Tensor | None, job: LossJob,
                 need: tuple[bool, bool, bool]):
        self.h_s, self.weight, self.bias, self.job = h_s, weight, bias, job
        settings = job.settings
        self.compute = torch.promote_types(h_s.dtype, torch.float32)
        self.has_ce = job.labels is not None
        # A term whose weight is 0 (alpha = 1 or 0) is still computed for logging, but gets no gradient buffers.
        self.kd_grad, self.ce_grad = settings.kd_grad, settings.ce_grad and self.has_ce
        need = (need[0], need[1], need[2] and bias is not None)
        self.want_grad = any(need) and (self.kd_grad or self.ce_grad)
        # d kd / d logits in closed form
        self.closed_form = (self.want_grad and self.kd_grad and settings.divergence == "forward_kl"
                            and job.teacher.closed_form)  # fmt: skip
        self.columns = h_s.shape[1] if weight is None else weight.shape[0]
        self.kd = TermGradients(self.want_grad and self.kd_grad, h_s, weight, bias, need, self.compute)
        self.ce = TermGradients(self.want_grad and self.ce_grad, h_s, weight, bias, need, self.compute)
        self.kd_sum = h_s.new_zeros((), dtype=self.compute)
        self.ce_sum = h_s.new_zeros((), dtype=self.compute)
        self.work = job.teacher.work or Workspace()  # chunk buffers, shared with a dense teacher's
        self.transform = (None, None) if job.head is None else (job.head.logit_scale, job.head.softcap)

    def run(self) -> ChunkPass:
        for rows_c in chunk_slices(self.h_s.shape[0], self.job.chunk_size, self.job.teacher.bounds):
            self.chunk(rows_c)
        return self

    def chunk(self, rows_c: slice) -> None:
        """One chunk: its logits, KD and CE added to the sums, their gradients to the buffers."""
        job, hs = self.job, self.h_s[rows_c]
        signal = job.teacher.chunk(rows_c, self.compute)
        raw = self.raw_logits(hs)
        labels = job.labels[rows_c] if self.has_ce else None
        with torch.set_grad_enabled(self.want_grad):
            raw.requires_grad_(self.want_grad)
            logits = finalise_logits(raw, *self.transform)
            if job.diagnostics is not None:  # before the closed form, which overwrites the signal; in fp32 even
                # under autocast (bf16 mixed precision), whose bf16 dot products would swamp a KL of 1e-2
                with torch.no_grad(), torch.autocast(logits.device.type, enabled=False):
                    job.teacher.observe(job.diagnostics, rows_c, logits.detach(), signal, labels, job.settings)
            w = None  # per-row weights (an importance-sampling correction of rollouts), else 1
            if job.correction is not None and self.has_ce:
                with torch.no_grad():
                    w = job.correction.weights(rows_c, -F.cross_entropy(logits, labels, reduction="none"))
            kd, g, log_q, outputs = self.kd_term(logits, raw, signal, labels, w)
            del signal
            ce = self.ce_term(logits, labels, w, log_q, outputs)
        self.kd_sum += kd.detach()
        job.teacher.tally(rows_c, kd.detach())  # a signal of several teachers counts each one's part
        self.ce_sum += ce.detach() if ce is not None else 0.0
        if not self.want_grad:
            return
        if g is not None:  # the closed form's gradient
            self.kd.add(g, hs, rows_c, self.weight, self.work)
            del g
        for i, (out, term) in enumerate(outputs):
            # d(chunk loss)/d(raw logits): [c, V_s] in the compute dtype, through scale/softcap.
            (g,) = torch.autograd.grad(out, raw, retain_graph=i + 1 < len(outputs))
            term.add(g, hs, rows_c, self.weight, self.work)

    def raw_logits(self, hs: Tensor) -> Tensor:
        """The chunk's logits before scale and softcap, a leaf the chunk's gradients are taken against."""
        if self.weight is None:  # the model's own logits: a copy, so nothing below writes into them
            return hs.detach().to(self.compute, copy=True)
        with torch.no_grad():  # [c, V_s] in a reused buffer (out= forms: no autograd here)
            return self.work.linear("student", hs, self.weight, self.bias, self.compute)

    def ce_from_kd(self, w: Tensor | None) -> bool:
        """Whether the CE is read off the closed form's log q (T = 1, the same columns): one log-softmax less."""
        return (self.closed_form and self.has_ce and not self.ce_grad and w is None
                and self.job.settings.temperature == 1.0 and self.job.vocab == self.columns)  # fmt: skip

    def kd_term(self, logits: Tensor, raw: Tensor, signal, labels: Tensor | None, w: Tensor | None):
        """The chunk's KD; the closed form's gradient w.r.t. `raw` (else None); log q at the labels when the CE
        comes from it (else None); the outputs still to differentiate, each with its term's buffers."""
        job, temperature, vocab = self.job, self.job.settings.temperature, self.job.vocab
        if not self.closed_form:
            with torch.set_grad_enabled(self.want_grad and self.kd_grad):
                s_logp = F.log_softmax(at_temperature(logits[:, :vocab], temperature), dim=-1)
                kd = job.teacher.per_token(s_logp, signal, job.settings)
                kd = kd.sum() if w is None else (kd * w).sum()
            return kd, None, None, [(kd, self.kd)] if self.want_grad and self.kd_grad else []
        with torch.no_grad():
            kd, g, log_q = forward_kl_closed_form(logits[:, :vocab], signal, temperature, w, self.work,
                                                  labels if self.ce_from_kd(w) else None)
            g = g if vocab == self.columns else F.pad(g, (0, self.columns - vocab))  # padded columns: 0
        if logits is not raw:  # chain through scale/softcap
            (g,) = torch.autograd.grad(logits, raw, g, retain_graph=self.ce_grad)
        return kd, g, log_q, []

    def ce_term(self, logits: Tensor, labels: Tensor | None, w: Tensor | None, log_q: Tensor | None,
                outputs: list) -> Tensor | None:
        """The chunk's CE (None without labels); appended to `outputs` when it wants a gradient."""
        if log_q is not None:
            return -log_q.sum()
        if not self.has_ce:
            return None
        with torch.set_grad_enabled(self.want_grad and self.ce_grad):
            ce = F.cross_entropy(logits, labels, reduction="sum" if w is None else "none")
            ce = ce if w is None else (ce * w).sum()
        if self.want_grad and self.ce_grad:
            outputs.append((ce, self.ce))
        return ce


def chunk_slices(n: int, size: int, bounds: list[int] | None = None) -> list[slice]:
    """The loss rows ``[0, n)`` a chunk of at most `size` at a time; with `bounds` (segment starts and the end, e.g.
    each teacher's rows of a routed signal) no chunk straddles a segment's edge."""
    edges = [0, n] if bounds is None else bounds
    return [slice(start, min(start + size, stop)) for lo, stop in zip(edges, edges[1:])
            for start in range(lo, stop, size)]
