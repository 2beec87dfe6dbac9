"""`teacher_prompt` at its boundaries, on the student's tokenizer: a teacher prompt of one token, one longer than
`max_length` (the teacher reads it whole) and a student prompt that is empty (its completion starts at position 0):
the KD equals the divergence computed by hand from ``teacher(teacher prompt + completion).logits``, each student
position paired with the teacher's position before the same completion token. An empty teacher prompt is refused
(tests/teacher/test_teacher_prompt_bad_input.py); with a tokenizer that starts every text with BOS it is BOS, and
the teacher predicts the completion's first token from it."""

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from tokenizers import processors
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import extras_of
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings

MAX_LENGTH = 64  # (the tiny models hold 128 positions; this tokenizer gives about a token a character)


def rows(tokenizer) -> Dataset:
    """Four rows: a one-token teacher prompt, an empty student prompt, a teacher prompt of more than MAX_LENGTH
    tokens, and an ordinary one."""
    data = synthetic_prompt_completion(4).to_list()
    one = next(word for word in ("a", "the", "x", "1") if len(tokenizer(word)["input_ids"]) == 1)
    data[0]["hint"] = one
    data[1]["prompt"], data[1]["hint"] = "", f"{data[1]['completion']} again:"
    data[2]["hint"] = ((data[2]["prompt"] + " ") * 2)[:70]
    data[3]["hint"] = f"{data[3]['prompt']} hint:{data[3]['completion']} =>"
    return Dataset.from_list(data)


def make(pair, tmp_path, tokenizer, data: Dataset | None = None) -> DistillationTrainer:
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1,
                                 save_strategy="no", use_cpu=True, kd_temperature_scaling=False, alpha=1.0,
                                 divergence="forward_kl", temperature=1.0, max_length=MAX_LENGTH, shuffle_dataset=False,
                                 teacher_prompt="hint")
    return DistillationTrainer(pair["student"], pair["teacher"], args=DistillationConfig(**settings),
                               train_dataset=rows(tokenizer) if data is None else data, processing_class=tokenizer)


def hand_kd(student, teacher, batch, prompts: list[list[int]]) -> float:
    """Forward KL (float64) averaged over the student's loss positions: position t of row b predicts token t + 1;
    the completion starts at the row's first label s, so the teacher reads ``prompts[b] + ids[s:]`` and predicts
    the same token at ``len(prompts[b]) + t - s``."""
    total, count = 0.0, 0
    for b in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][b].sum())
        ids, labels = batch["input_ids"][b, :length], batch["labels"][b, :length]
        s = int((labels != -100).nonzero()[0])
        s_logits = student(ids[None]).logits[0].double()
        t_logits = teacher(torch.cat([torch.tensor(prompts[b]), ids[s:]])[None]).logits[0].double()
        for t in range(max(s - 1, 0), length - 1):
            p = F.log_softmax(t_logits[len(prompts[b]) + t - s], -1)
            q = F.log_softmax(s_logits[t], -1)
            total, count = total + float((p.exp() * (p - q)).sum()), count + 1
    return total / count


def kd_and_hand(trainer) -> tuple[float, float, list[list[int]], dict]:
    trainer.get_train_dataloader()  # (loads the teacher)
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))  # in order
    prompts = [p.tolist() for p in extras_of(batch).teacher_prompts]
    with torch.no_grad():
        want = hand_kd(trainer.model, trainer.teacher.inner.module, batch, prompts)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        _, out = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    return out["kd_loss"].item(), want, prompts, batch


def test_one_token_a_long_teacher_prompt_and_an_empty_student_prompt_align(tiny_pair, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    kd, want, prompts, batch = kd_and_hand(make(tiny_pair, tmp_path, tokenizer))
    assert len(prompts[0]) == 1 and len(prompts[2]) > MAX_LENGTH  # read whole, not cut at max_length
    assert int((batch["labels"][1] != -100).nonzero()[0]) == 0  # the empty student prompt: completion from 0
    # before the fix the teacher's row of the empty-prompt row began at the completion's second token: 0.019534
    # against 0.019524 by hand
    assert kd == pytest.approx(want, rel=1e-5)


def test_an_empty_teacher_prompt_is_bos_where_the_tokenizer_adds_it(tiny_pair, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)])
    data = synthetic_prompt_completion(4).add_column("hint", [""] * 4)
    kd, want, prompts, _ = kd_and_hand(make(tiny_pair, tmp_path, tokenizer, data))
    assert prompts == [[bos]] * 4
    assert kd == pytest.approx(want, rel=1e-5)
