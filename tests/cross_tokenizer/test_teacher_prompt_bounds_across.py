"""`teacher_prompt` with a teacher of another tokenizer, at its boundaries: a teacher prompt of one of the teacher's
tokens, and one longer than `max_length` (the teacher reads it whole and the completion keeps its groups: they
used to be cut off with it, every row training on CE alone under a warning that blamed the alignment), off and on
the policy, the KD equal to the per-group loss on both models' own logits; an empty teacher prompt is one line."""

import pytest
import torch
from datasets import Dataset
from test_privileged_across import kd_from_models, make

from trl_distill.data.batch import extras_of
from trl_distill.rollout.sampling import STUDENT
from trl_distill.teacher.cross_tokenizer import STUDENT_POSITIONS, TEACHER_PROMPT
from trl_distill.testing import synthetic_prompt_completion

MAX_LENGTH = 64  # student tokens (about one a character); the teacher's tokenizer gives about one a word


def rows(hints: list[str] | None = None) -> Dataset:
    data = synthetic_prompt_completion(4).to_list()
    hints = hints or ["dog", (data[1]["prompt"] + " ") * 10, f"{data[2]['prompt']} hint:{data[2]['completion']} =>",
                      data[3]["prompt"]]  # one token, about 80 tokens, a hint, the prompt itself
    return Dataset.from_list([{**row, "hint": hint} for row, hint in zip(data, hints, strict=True)])


@pytest.mark.parametrize("on_policy", [False, True])
def test_one_token_and_a_long_teacher_prompt_keep_the_completions_groups(tiny_pair, other_teacher, tmp_path,
                                                                         on_policy):
    trainer = make(tiny_pair, other_teacher, tmp_path, data=rows(), teacher_prompt="hint", max_length=MAX_LENGTH,
                   **(dict(lmbda=1.0, max_new_tokens=6) if on_policy else {}))
    prepared = [trainer.train_dataset[i] for i in range(4)]
    assert len(prepared[0][TEACHER_PROMPT]) == 1 and len(prepared[1][TEACHER_PROMPT]) > MAX_LENGTH
    assert all(len(row[STUDENT_POSITIONS]) >= 3 for row in prepared)  # (the long one had none: 0)
    trainer.get_train_dataloader()  # (loads the teacher)
    batch = trainer._prepare_inputs(trainer.data_collator(prepared))
    if on_policy:
        batch, _ = trainer.sampler.sample(STUDENT, batch)
        trainer.sampler.on_policy = True
        assert 1 in extras_of(batch).cross_tokenizer[2][:, 0].tolist()  # the long one's sample keeps its groups
    with torch.no_grad():
        want = kd_from_models(trainer, batch, truncated=not on_policy)  # (row 0's completion is cut)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        _, out = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    assert want.item() > 0
    torch.testing.assert_close(out["kd_loss"].double(), want, atol=1e-5, rtol=1e-5)


def test_an_empty_teacher_prompt_across_tokenizers_is_one_line(tiny_pair, other_teacher, tmp_path):
    with pytest.raises(ValueError) as error:
        make(tiny_pair, other_teacher, tmp_path, data=rows([""] * 4), teacher_prompt="hint")
    assert str(error.value) == (
        "--teacher_prompt 'hint': row 0 of the train dataset (and 3 more of its 4 rows) gives an empty teacher "
        "prompt, so the teacher has no token before the completion to predict its first token from: fill the "
        "column, or drop those rows.")
