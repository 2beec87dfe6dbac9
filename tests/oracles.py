"""Test-side helpers that call the library's own pieces in one line (not part of the package)."""

from __future__ import annotations

from torch import Tensor

from trl_distill.cache.writer import fill_teacher_cache, open_teacher_cache
from trl_distill.loss.fused import DistillationLossOutput, fused_loss, head_shape, select_loss_rows
from trl_distill.loss.settings import LossSettings
from trl_distill.loss.sparse import SparseSignalChunks, SparseTeacherSignal
from trl_distill.model.fused_forward import LMHead


def write_teacher_cache(trainer, directory: str, *, top_k: int = 64, shard_rows: int = 1024,
                        batch_size: int | None = None, log_prob_dtype: str = "7bit", on_shard=None):
    """`open_teacher_cache` then `fill_teacher_cache`, as `trl-distill cache-teacher` runs them. Collective."""
    run = (trainer.context, trainer.teacher, trainer.train_dataset, directory)
    manifest = open_teacher_cache(*run, top_k=top_k, shard_rows=shard_rows, log_prob_dtype=log_prob_dtype,
                                  run_lock=trainer.run_lock)
    return fill_teacher_cache(*run, manifest, batch_size=batch_size, on_shard=on_shard)


def sparse_distillation_loss(
    student_hidden: Tensor,
    student_lm_head_weight: Tensor | None,
    teacher: SparseTeacherSignal,
    mask: Tensor | None = None,
    loss_type: str = "forward_kl",
    *,
    labels: Tensor | None = None,
    student_lm_head_bias: Tensor | None = None,
    num_items_in_batch: int | Tensor | None = None,
    student_logit_scale: float | None = None,
    student_softcap: float | None = None,
    **settings,
) -> DistillationLossOutput:
    """`losses.chunked_distillation_loss` with the teacher given as a sparse signal (see the module docstring).

    ``teacher`` holds one row per selected token (``mask`` True, row-major), in order; its ids index the student's
    first ``vocab_size`` logits (default: all). Everything else is as in `chunked_distillation_loss` (a None
    weight: ``student_hidden`` are the student's own logits; ``settings``: the `LossSettings` fields).
    """
    head = None if student_lm_head_weight is None else LMHead(
        student_lm_head_weight, student_lm_head_bias, student_logit_scale, student_softcap)
    vocab_size = settings.pop("vocab_size", None)
    loss = LossSettings(divergence=loss_type, vocab_size=head_shape(student_hidden, head)[0] if vocab_size is None
                        else vocab_size, **settings)
    s_flat, rows, labels = select_loss_rows(student_hidden, mask, labels)
    n = s_flat.shape[0] if rows is None else rows.numel()
    return fused_loss(s_flat, head, SparseSignalChunks(teacher, n, loss.vocab_size), loss, rows, labels,
                      num_items_in_batch)


def held_out_loss(student, teacher, tokenizer, rows, *, temperature: float = 2.0, alpha: float = 0.5) -> dict:
    """The distillation objective on prompt–completion ``rows``, measured outside any trainer from both models' own
    ``forward(...).logits`` (fp32, no grad), per completion token: ``kd`` = T² · KL_T(teacher ‖ student) over the
    shared vocabulary, ``ce`` = the student's cross-entropy on the completion, ``loss`` = alpha · kd + (1 − alpha) ·
    ce. ``teacher`` None (another tokenizer): ``kd`` is 0 and ``loss`` is ``ce``. Rows are tokenized as prompt ids
    then completion ids, as the tests' prompt–completion data is."""
    import torch
    import torch.nn.functional as F

    from trl_distill import divergence

    sums, tokens = {"kd": 0.0, "ce": 0.0}, 0
    models = [m for m in (student, teacher) if m is not None]
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        with torch.no_grad():
            for row in rows:
                prompt, completion = (tokenizer(row[k])["input_ids"] for k in ("prompt", "completion"))
                ids = torch.tensor([prompt + completion], device=student.device)
                start, target = len(prompt) - 1, ids[0, len(prompt):]  # position t predicts token t + 1
                s = student(input_ids=ids).logits[0, start:-1].float()
                sums["ce"] += F.cross_entropy(s, target, reduction="sum").item()
                if teacher is not None:
                    t = teacher(input_ids=ids.to(teacher.device)).logits[0, start:-1].float().to(s.device)
                    vocab = min(s.shape[-1], t.shape[-1], len(tokenizer))
                    kd = divergence(s[:, :vocab], t[:, :vocab], "forward_kl", temperature=temperature)
                    sums["kd"] += kd.item() * temperature**2 * target.numel()
                tokens += target.numel()
    finally:
        for m, mode in zip(models, modes, strict=True):
            m.train(mode)
    out = {key: value / tokens for key, value in sums.items()}
    out["loss"] = alpha * out["kd"] + (1 - alpha) * out["ce"] if teacher is not None else out["ce"]
    return out


def reference_diagnostics(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, *,
                          top_k: int | None = None) -> dict[str, Tensor]:
    """Per loss token, straight from the definitions in float64 (`loss.diagnostics` names): the student's and teacher's
    logits ``[n, V]`` at the same positions (the teacher's may be a server's top-k, ``(ids, log-probs)``), the
    labels ``[n]``. ``top_k``: the teacher as its top-k plus one tail bucket (a cache's signal), the student
    coarse-grained onto the same buckets."""
    import torch

    if isinstance(teacher_logits, tuple):  # a server's top-k: (ids [n, k], log-probs [n, k]), most likely first
        ids, top = teacher_logits
        tail = torch.log1p(-top.double().exp().sum(-1).clamp(max=1))
        return _bucket_reference(student_logits, ids, top.double(), tail, labels)
    s, t = (torch.log_softmax(x.double(), -1) for x in (student_logits, teacher_logits))
    out = {"student_entropy": -(s.exp() * s).sum(-1), "student_ce": -s[torch.arange(len(labels)), labels]}
    if top_k is None:
        out["top1_agreement"] = (student_logits.argmax(-1) == teacher_logits.argmax(-1)).double()
        out["kl_teacher_student"] = (t.exp() * (t - s)).sum(-1)
        out["teacher_ce"] = -t[torch.arange(len(labels)), labels]
        out["teacher_entropy"] = -(t.exp() * t).sum(-1)
        return out
    top, ids = t.topk(top_k, -1)
    return _bucket_reference(student_logits, ids, top, (1 - top.exp().sum(-1)).clamp(min=0).log(), labels)


def _bucket_reference(student_logits, ids, top, log_tail, labels):
    import torch

    s = torch.log_softmax(student_logits.double(), -1)
    out = {"student_entropy": -(s.exp() * s).sum(-1), "student_ce": -s[torch.arange(len(labels)), labels]}
    tail = log_tail.exp()
    s_top = s.gather(1, ids).exp()
    p = torch.cat([top.exp(), tail[:, None]], 1)
    q = torch.cat([s_top, (1 - s_top.sum(-1)).clamp(min=1e-300)[:, None]], 1)
    terms = torch.where(p > 0, p * (p.log() - q.log()), 0.0)
    hit = ids == labels[:, None]
    out["top1_agreement"] = (student_logits.argmax(-1) == ids[:, 0]).double()
    out["kl_teacher_student"] = terms.sum(-1)
    out["teacher_ce"] = -torch.where(hit.any(1), (top * hit).sum(-1), tail.log())
    out["teacher_entropy"] = -torch.where(p > 0, p * p.log(), 0.0).sum(-1)
    out["teacher_tail_mass"] = tail
    return out


def shared_characters_reward(prompts, completions, **columns) -> list[float]:
    """A task reward with TRL's signature (`task_reward_funcs oracles:shared_characters_reward`): the share of the
    completion's characters found in its row's reference `completion` column, so that even an untrained student's
    samples score apart."""
    scores = []
    for completion, reference in zip(completions, columns["completion"], strict=True):
        wanted = set(reference)
        scores.append(sum(c in wanted for c in completion) / max(len(completion), 1))
    return scores


def first_step_losses(student, teacher, rows: list[dict], temperature=2.0, alpha=0.5) -> dict:
    """Each rank's per-token means of T²·KL_T(teacher ‖ student) and CE on its sampled rows, from both models' own
    logits, averaged over the ranks (each rank's loss is its micro-batch's token mean; DeepSpeed and FSDP2 average
    the ranks)."""
    import torch

    kd, ce = [], []
    for row in rows:
        ids, mask, labels = (torch.tensor(row[k]) for k in ("input_ids", "attention_mask", "labels"))
        with torch.no_grad():
            s = student(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            t = teacher(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = labels[:, 1:]
        keep = target != -100
        s, t = s[keep], t[keep]
        p_log, q_log = (t / temperature).log_softmax(-1), (s / temperature).log_softmax(-1)
        kd.append(float((p_log.exp() * (p_log - q_log)).sum(-1).mean()) * temperature**2)
        ce.append(float(torch.nn.functional.cross_entropy(s, target[keep])))
    kd, ce = sum(kd) / len(kd), sum(ce) / len(ce)
    return {"kd_loss": kd, "ce_loss": ce, "loss": alpha * kd + (1 - alpha) * ce}
