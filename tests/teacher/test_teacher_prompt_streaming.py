"""`teacher_prompt` on a streamed dataset (an `IterableDataset`, not read ahead): each row's teacher prompt is
tokenized as the row is read (it was the whole stream read ahead, then a TypeError), the same ids and the same loss
as the map-style dataset's; a row without a usable teacher prompt is the same one line, naming the row of the
stream."""

from itertools import islice

import pytest
import torch
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import extras_of
from trl_distill.teacher.privileged import TEACHER_PROMPT
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings

HINT = "{prompt} hint:{completion} =>"


def make(pair, tmp_path, dataset, name: str, **overrides) -> DistillationTrainer:
    settings = tiny_run_settings(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=2,
                                 save_strategy="no", use_cpu=True, kd_temperature_scaling=False, alpha=1.0,
                                 divergence="forward_kl", temperature=1.0, teacher_prompt=HINT)
    settings.update(overrides)
    return DistillationTrainer(pair["student"], pair["teacher"], args=DistillationConfig(**settings),
                               train_dataset=dataset,
                               processing_class=AutoTokenizer.from_pretrained(pair["tokenizer"]))


def kd_loss(trainer, batch) -> float:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        _, out = trainer.compute_loss(trainer.model, dict(trainer._prepare_inputs(batch)), return_outputs=True)
    return out["kd_loss"].item()


def test_a_streamed_dataset_gets_the_map_style_teacher_prompts_and_loss(tiny_pair, tmp_path):
    data = synthetic_prompt_completion(8)
    mapped = make(tiny_pair, tmp_path, data, "mapped")
    streamed = make(tiny_pair, tmp_path, data.to_iterable_dataset(), "streamed")
    rows = list(islice(streamed.train_dataset, 8))
    assert [row[TEACHER_PROMPT] for row in rows] == mapped.train_dataset[TEACHER_PROMPT]
    batch = next(iter(streamed.get_train_dataloader()))  # a stream's first 4 rows, in order
    assert [p.tolist() for p in extras_of(batch).teacher_prompts] == mapped.train_dataset[TEACHER_PROMPT][:4]
    next(iter(mapped.get_train_dataloader()))  # (the teacher is prepared with the first dataloader)
    same_rows = mapped.data_collator([mapped.train_dataset[i] for i in range(4)])
    assert kd_loss(streamed, batch) == pytest.approx(kd_loss(mapped, same_rows), rel=1e-6)


@pytest.mark.parametrize("value, why", [
    (None, "has a null in the column 'golden': give every row its teacher prompt, or drop those rows."),
    ("", "gives an empty teacher prompt, so the teacher has no token before the completion to predict its first "
         "token from: fill the column, or drop those rows."),
])
def test_a_streamed_row_without_a_teacher_prompt_is_one_line(tiny_pair, tmp_path, value, why):
    data = synthetic_prompt_completion(6)
    data = data.add_column("golden", [value if i == 2 else f"{p} hint:{c}" for i, (p, c) in
                                      enumerate(zip(data["prompt"], data["completion"], strict=True))])
    before = data.to_list()
    trainer = make(tiny_pair, tmp_path, data.to_iterable_dataset(), "streamed", teacher_prompt="golden")
    with pytest.raises(ValueError) as error:
        next(iter(trainer.get_train_dataloader()))
    assert str(error.value) == f"--teacher_prompt 'golden': row 2 of the streamed train dataset {why}"
    assert data.to_list() == before
