"""On-policy and mixed distillation (GKD, Agarwal et al. 2023): a training batch's completions may be replaced by
ones the student (`lmbda`) or the teacher (`seq_kd`) samples for the same prompts, then distilled exactly like
dataset completions.

The student/dataset choice is drawn once per optimizer step from ``(seed, step)`` alone, so every rank draws the
same and a resumed run draws what the uninterrupted one did. Teacher sampling under ZeRO-3 runs with
``synced_gpus=True``: every rank keeps taking part in the teacher's forward passes until all ranks are done.
"""

from __future__ import annotations

import contextlib

import torch

# The three sources of a step's completions
DATASET, STUDENT, TEACHER = "dataset", "student", "teacher"


def completion_source(lmbda: float, seq_kd: bool, seed: int, step: int) -> str:
    """Where the completions of optimizer step `step` come from: the student with probability `lmbda`, else the
    teacher when `seq_kd`, else the dataset. A pure function of its arguments (same on every rank and on resume)."""
    if lmbda > 0:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if torch.rand((), generator=generator).item() < lmbda:
            return STUDENT
    return TEACHER if seq_kd else DATASET


def split_prompts(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's prompt: the attended tokens before its first label (a row with no label keeps all its tokens)."""
    prompts = []
    for ids, row_labels, mask in zip(input_ids, labels, attention_mask):
        ids = ids[mask.bool()]
        targets = (row_labels[mask.bool()] != -100).nonzero()
        prompts.append(ids[: int(targets[0]) if len(targets) else len(ids)])
    return prompts


def left_pad(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=prompts[0].dtype, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    return ids, mask


def completion_batch(prompts: list[torch.Tensor], completions: list[torch.Tensor], pad_id: int) -> dict:
    """A right-padded training batch: prompt + completion per row, loss on the completion tokens only."""
    rows = [torch.cat([p, c]) for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=rows[0].dtype, device=rows[0].device)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, (prompt, sequence) in enumerate(zip(prompts, rows)):
        ids[row, : len(sequence)], mask[row, : len(sequence)] = sequence, 1
        labels[row, len(prompt) : len(sequence)] = sequence[len(prompt) :]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def trim_after_eos(generated: torch.Tensor, eos_ids: set[int]) -> list[torch.Tensor]:
    """Each row's new tokens up to and including its first end-of-sequence token."""
    out = []
    for row in generated:
        ends = [i for i, token in enumerate(row.tolist()) if token in eos_ids]
        out.append(row[: ends[0] + 1] if ends else row)
    return out


@torch.no_grad()
def sample_completions(model, batch: dict, generation_kwargs: dict, pad_id: int, eos_ids: set[int],
                       synced_gpus: bool, context=contextlib.nullcontext) -> tuple[dict, list[torch.Tensor]]:
    """Replace the batch's completions by ones `model` samples for its prompts; returns the new batch and the
    sampled completions. `context` wraps the generation (e.g. a PEFT model's `disable_adapter`)."""
    prompts = split_prompts(batch["input_ids"], batch["labels"], batch["attention_mask"])
    if any(len(p) == 0 for p in prompts):
        raise ValueError(
            "Sampled completions (lmbda > 0 or seq_kd) need prompts, and a row has none: every token carries loss. "
            "Use a prompt-completion or conversational dataset (the completion / assistant turn is resampled)."
        )
    ids, mask = left_pad(prompts, pad_id)
    was_training = model.training
    model.eval()
    try:
        with context():
            out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad_id, synced_gpus=synced_gpus,
                                 **generation_kwargs)
    finally:
        model.train(was_training)
    completions = trim_after_eos(out[:, ids.shape[1] :], eos_ids)
    return completion_batch(prompts, completions, pad_id), completions
