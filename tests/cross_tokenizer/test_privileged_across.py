"""`teacher_prompt` with a teacher of another tokenizer: the teacher reads its own tokens of its own prompt and of the
same completion text, off and on the policy; the KD equals the per-group loss from both models' own logits on those
rows, each group covering the same completion characters on both sides; the prompt as teacher prompt changes
nothing; bad input is one line."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import extras_of
from trl_distill.rollout.sampling import STUDENT
from trl_distill.teacher import CrossTokenizerTeacher
from trl_distill.teacher.cross_tokenizer import TEACHER_IDS, TEACHER_PROMPT
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings

HINT = "{prompt} hint:{completion} =>"  # privileged: the teacher is shown the reference completion


def make(pair, teacher, tmp_path, data=None, **overrides) -> DistillationTrainer:
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                                 save_strategy="no", use_cpu=True, alpha=1.0, teacher_model_name_or_path=teacher)
    settings.update(overrides)
    return DistillationTrainer(pair["student"], args=DistillationConfig(**settings),
                               train_dataset=data if data is not None else synthetic_prompt_completion(16),
                               processing_class=AutoTokenizer.from_pretrained(pair["tokenizer"]))


def kd_from_models(trainer, batch, truncated: bool = False) -> torch.Tensor:
    """The per-group loss on both models' own logits over the batch's teacher rows, summed and divided by the loss
    tokens (float64); asserts both sides read the same text from each group on (`truncated`: the student's rows cut
    at max_length, the teacher's text goes on)."""
    teacher_ids, teacher_mask, groups, *_ = extras_of(batch).cross_tokenizer
    student_tok, teacher_tok = trainer.teacher.student_tokenizer, trainer.teacher.teacher_tokenizer
    lengths = batch["attention_mask"].sum(1).tolist(), teacher_mask.sum(1).tolist()
    for row, s_pos, t_pos in groups.tolist():  # from a group on, both sides read the same text: the completion's rest
        sides = ((student_tok, batch["input_ids"], s_pos, lengths[0]), (teacher_tok, teacher_ids, t_pos, lengths[1]))
        rest = [tok.decode(ids[row, pos + 1: length[row]], skip_special_tokens=True).strip()
                for tok, ids, pos, length in sides]
        assert rest[1].startswith(rest[0]) if truncated else rest[0] == rest[1]
    student_logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    teacher_logits = trainer.teacher.module(input_ids=teacher_ids, attention_mask=teacher_mask).logits
    rows, s_pos, t_pos = groups.unbind(1)
    per_group = trainer.teacher.loss(student_logits[rows, s_pos, : trainer.vocab_size].double(),
                                     teacher_logits[rows, t_pos].double())
    return per_group.sum() / int((batch["labels"][:, 1:] != -100).sum()) * trainer.args.temperature ** 2


@pytest.mark.parametrize("on_policy", [False, True])
def test_the_teacher_of_another_tokenizer_reads_its_own_prompt_and_the_same_completion(tiny_pair, other_teacher,
                                                                                        tmp_path, on_policy):
    trainer = make(tiny_pair, other_teacher, tmp_path, teacher_prompt=HINT,
                   **(dict(lmbda=1.0, max_new_tokens=6) if on_policy else {}))
    assert isinstance(trainer.teacher, CrossTokenizerTeacher)
    teacher_tok, eos = trainer.teacher.teacher_tokenizer, trainer.processing_class.eos_token
    for i in range(4):  # the teacher's row: its own tokens of the filled template, then of the same completion
        row = trainer.train_dataset[i]
        completion = row["completion"].removesuffix(eos)
        hint = HINT.format(prompt=row["prompt"], completion=completion)
        assert row[TEACHER_IDS] == teacher_tok(hint + completion)["input_ids"] + [teacher_tok.eos_token_id]
        assert row[TEACHER_PROMPT] == teacher_tok(hint)["input_ids"]
        assert len(row["cross_student_positions"]) >= 3  # a group per word of the completion
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    prompts = extras_of(batch).cross_tokenizer[3]
    if on_policy:
        batch, _ = trainer.sampler.sample(STUDENT, batch)
        trainer.sampler.on_policy = True
        teacher_ids = extras_of(batch).cross_tokenizer[0]
        for b, prompt in enumerate(prompts):  # the samples follow each row's own teacher prompt
            assert teacher_ids[b, : len(prompt)].tolist() == prompt
    with torch.no_grad():
        want = kd_from_models(trainer, batch)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        _, out = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    assert want.item() > 0
    torch.testing.assert_close(out["kd_loss"].double(), want, atol=1e-5, rtol=1e-5)
    trainer.train()  # and it trains
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


def test_the_prompt_as_teacher_prompt_prepares_the_rows_as_without(tiny_pair, other_teacher, tmp_path):
    plain = make(tiny_pair, other_teacher, tmp_path / "plain")
    same = make(tiny_pair, other_teacher, tmp_path / "same", teacher_prompt="prompt")
    columns = ("teacher_input_ids", "cross_student_positions", "cross_teacher_positions", TEACHER_PROMPT)
    for column in columns:
        assert same.train_dataset[column] == plain.train_dataset[column], column


def test_a_conversational_teacher_prompt_that_quotes_the_answer(tiny_pair, other_teacher, tmp_path):
    """Messages: the teacher's user turn quotes the reference answer, and the completion is still aligned on the
    assistant turn (not on its quote in the prompt): every group lies after the teacher prompt, which is the
    teacher's own chat template up to its generation prompt."""
    rows = synthetic_prompt_completion(8)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                               "completion": [{"role": "assistant", "content": r["completion"].strip()}],
                               "hinted": [{"role": "user", "content": f"{r['prompt']} answer: {r['completion']}"}]}
                              for r in rows])
    trainer = make(tiny_pair, other_teacher, tmp_path, data=data, teacher_prompt="hinted")
    teacher_tok = trainer.teacher.teacher_tokenizer
    for i in range(len(data)):
        row = trainer.train_dataset[i]
        prompt = teacher_tok.apply_chat_template(data[i]["hinted"], add_generation_prompt=True, tokenize=False)
        assert row[TEACHER_PROMPT] == teacher_tok(prompt, add_special_tokens=False)["input_ids"]
        assert len(row["cross_teacher_positions"]) >= 3
        assert min(row["cross_teacher_positions"]) >= len(row[TEACHER_PROMPT]) - 1  # in the assistant turn


def test_a_teacher_prompt_of_another_kind_than_the_prompt_is_one_line(tiny_pair, other_teacher, tmp_path):
    data = synthetic_prompt_completion(8)
    data = data.add_column("system", [[{"role": "system", "content": "answer"}]] * len(data))
    with pytest.raises(ValueError) as error:
        make(tiny_pair, other_teacher, tmp_path, data=data, teacher_prompt="system")
    assert "a teacher prompt that is a string like its prompt" in str(error.value) and "\n" not in str(error.value)
