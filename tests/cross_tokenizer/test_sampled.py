"""Sampled completions across tokenizers (`cross_tokenizer.sampled`): the student's sampled ids kept as sampled, the
teacher's re-rendering, groups over identical text, and the KD of an on-policy batch from both models' own logits."""

import pytest
import torch
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.cross_tokenizer.sampled import align_sampled, sampled_offsets
from trl_distill.data.batch import extras_of
from trl_distill.rollout.sampling import STUDENT
from trl_distill.testing import (
    build_sentencepiece_style_tokenizer,
    build_tokenizer,
    synthetic_prompt_completion,
    tiny_run_settings,
)


@pytest.fixture(scope="module")
def tokenizers():
    return build_tokenizer(), build_sentencepiece_style_tokenizer(vocab_size=300)


def test_each_sampled_token_gets_the_text_it_adds(tokenizers):
    student, _ = tokenizers
    ids = student("dog cat é 漢 => x")["input_ids"]
    text, offsets = sampled_offsets(student, ids)
    assert text == "dog cat é 漢 => x" and len(offsets) == len(ids)
    assert all(a <= b for a, b in offsets) and [a for a, _ in offsets] == sorted(a for a, _ in offsets)
    pieces = [text[a:b] for a, b in dict.fromkeys(offsets)]  # tokens of one character share its span
    assert "".join(pieces) == text and "漢" in pieces and "é" in pieces
    # a token sequence the tokenizer would never produce (one byte at a time) keeps its own tokens
    raw = [student.convert_tokens_to_ids(t) for t in student.convert_ids_to_tokens(ids)]
    assert sampled_offsets(student, raw)[0] == text


@pytest.mark.parametrize("seed", range(5))
def test_groups_cover_identical_text_on_both_sides(tokenizers, seed):
    student, teacher = tokenizers
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, len(student), (24,), generator=generator).tolist() + [student.eos_token_id]
    teacher_ids, groups = align_sampled(ids, True, student, teacher)
    text, s_offsets = sampled_offsets(student, ids)
    t_offsets = teacher(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert teacher_ids[-1] == teacher.eos_token_id and groups[-1].student == (24, 25)
    assert len(groups) >= 5
    for group in groups[:-1]:  # every group: the same characters on both sides, in order
        s_text = text[s_offsets[group.student[0]][0]: s_offsets[group.student[1] - 1][1]]
        t_text = text[t_offsets[group.teacher[0]][0]: t_offsets[group.teacher[1] - 1][1]]
        assert s_text.strip() == t_text.strip() and s_text
    starts = [g.student[0] for g in groups]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)


def test_bytes_that_decode_to_no_text_are_in_no_group(tokenizers):
    """A sampled lead byte of "é" with no continuation decodes to U+FFFD: the teacher would read that character, not
    the student's byte, so no group holds it; the words around it still align."""
    student, teacher = tokenizers
    lead = student.convert_tokens_to_ids(student.convert_ids_to_tokens(student("é")["input_ids"])[0])
    ids = student("dog cat")["input_ids"] + [lead] + student(" cat dog")["input_ids"]
    text, offsets = sampled_offsets(student, ids)
    assert "\ufffd" in text
    _, groups = align_sampled(ids, False, student, teacher)
    held = {i for g in groups for i in range(*g.student)}
    assert ids.index(lead) not in held and len(held) >= len(ids) - 3
    assert all("\ufffd" not in text[offsets[g.student[0]][0]: offsets[g.student[1] - 1][1]] for g in groups)


def test_an_on_policy_batch_is_scored_on_the_models_own_logits(tiny_pair, other_teacher, tmp_path):
    """lmbda = 1 across tokenizers (the student's HF generate): every sampled row aligns, each group's prefix text
    is the same for both models, and the KD equals the per-group loss on both models' own logits."""
    args = DistillationConfig(**tiny_run_settings(
        output_dir=str(tmp_path / "out"), max_steps=2, save_strategy="no", per_device_train_batch_size=4,
        use_cpu=True, teacher_model_name_or_path=other_teacher, lmbda=1.0, max_new_tokens=8, alpha=1.0))
    trainer = DistillationTrainer(tiny_pair["student"], args=args, train_dataset=synthetic_prompt_completion(32))
    trainer.train()
    assert all(v > 0 for k, v in trainer.state.log_history[0].items() if k == "kd_loss")
    assert_sampled_kd_is_the_models_own(trainer, other_teacher)


def assert_sampled_kd_is_the_models_own(trainer, other_teacher) -> None:
    """On one sampled batch (`trainer`'s own sampler: HF generate or the rollout server): every row aligns, each
    group's prefix text is the same for both models, and the KD equals the per-group loss on their own logits."""
    args = trainer.args
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    batch, completions = trainer.sampler.sample(STUDENT, batch)
    teacher_ids, teacher_mask, groups, *_ = extras_of(batch).cross_tokenizer
    rows, s_pos, t_pos = groups.unbind(1)
    assert sorted(set(rows.tolist())) == [0, 1, 2, 3]
    s_tok, t_tok = trainer.processing_class, AutoTokenizer.from_pretrained(other_teacher)
    for row, s, t in groups.tolist():  # the text each model has read before the group is the same
        before_s = s_tok.decode(batch["input_ids"][row, : s + 1], skip_special_tokens=True)
        before_t = t_tok.decode(teacher_ids[row, : t + 1], skip_special_tokens=True)
        assert before_s.replace(" ", "") == before_t.replace(" ", ""), (before_s, before_t)
    with torch.no_grad():
        _, parts = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
        student_logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        teacher_logits = trainer.teacher.module(input_ids=teacher_ids, attention_mask=teacher_mask).logits
    per_group = trainer.teacher.loss(student_logits[rows, s_pos, : trainer.vocab_size].double(),
                                   teacher_logits[rows, t_pos].double())
    loss_tokens = int((batch["labels"][:, 1:] != -100).sum())
    assert loss_tokens == sum(len(c) for c in completions)
    want = per_group.sum() / loss_tokens * args.temperature**2
    torch.testing.assert_close(parts["kd_loss"].double(), want, atol=1e-5, rtol=1e-5)


def test_seq_kd_across_tokenizers_is_one_line(tiny_pair, other_teacher, tmp_path):
    args = DistillationConfig(**tiny_run_settings(output_dir=str(tmp_path / "out"), use_cpu=True, seq_kd=True,
                                                  teacher_model_name_or_path=other_teacher))
    with pytest.raises(ValueError, match="does not support seq_kd yet: it would sample in its own tokens"):
        DistillationTrainer(tiny_pair["student"], args=args, train_dataset=synthetic_prompt_completion(8))
