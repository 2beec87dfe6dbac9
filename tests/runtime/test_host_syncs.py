"""A device check a CPU can run (issue 55): per training step, the operations that would make a GPU wait for the host
(tests/host_syncs.py), ours against TRL's GKD on the same tiny run; and the loss-token layout that removed ours,
against the masks it stands for."""

import numpy as np
import pytest
import torch
from datasets import Dataset
from host_syncs import SyncCounter  # tests/ is on sys.path
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import EXTRAS, extras_of, pop_extra
from trl_distill.data.loss_layout import HostLayout, LossTokensCollator, host_step_layout, step_layout
from trl_distill.runtime.guards import Guards

ROWS, LENGTH = 32, 48


def _data():
    """Pre-tokenized rows, each split at a random point into prompt and completion; one collator for both trainers."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (ROWS, LENGTH), generator=g)
    prompt = torch.randint(4, 12, (ROWS,), generator=g)
    completion = torch.arange(LENGTH).unsqueeze(0) >= prompt.unsqueeze(1)
    return Dataset.from_dict({"input_ids": ids.tolist(), "completion_mask": completion.int().tolist()})


def _collate(examples):
    ids = torch.tensor([e["input_ids"] for e in examples])
    completion = torch.tensor([e["completion_mask"] for e in examples], dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.masked_fill(~completion, -100)}


def _syncs_per_step(trainer_name: str, tiny_pair, tmp_path, accumulation: int) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    common = dict(output_dir=str(tmp_path / trainer_name), max_steps=4, per_device_train_batch_size=4,
                  gradient_accumulation_steps=accumulation, logging_steps=1, learning_rate=1e-4, seed=0, bf16=False,
                  report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True, remove_unused_columns=False,
                  dataset_kwargs={"skip_prepare_dataset": True}, temperature=1.0)
    if trainer_name == "ours":  # its defaults otherwise: the guards and the logged diagnostics on
        args = DistillationConfig(**common, alpha=1.0, divergence="forward_kl")
        trainer = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=args, train_dataset=_data(),
                                      processing_class=tokenizer, data_collator=_collate)
    else:
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        trainer = GKDTrainer(tiny_pair["student"], tiny_pair["teacher"], args=GKDConfig(**common, lmbda=0.0, beta=0.0),
                             train_dataset=_data(), processing_class=tokenizer, data_collator=_collate)
    counter = SyncCounter()
    trainer.add_callback(counter)
    trainer.train()
    assert len(counter.steps) == 3  # steps 2-4: whole windows
    return counter.per_step()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_training_step_makes_the_device_wait_no_more_often_than_gkd(tiny_pair, tmp_path, accumulation):
    """2755ed6 made 40 such calls a step to GKD's 29 here (guard, diagnostics, step-pass and loss-row reads);
    now the loss tokens' indices come from the collator and the guards and the logged metrics are read once."""
    ours = _syncs_per_step("ours", tiny_pair, tmp_path, accumulation)
    gkd = _syncs_per_step("gkd", tiny_pair, tmp_path, accumulation)
    assert max(ours) <= min(gkd), (ours, gkd)


def _random_masks(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    masks = []
    for rows, length in ((3, 7), (2, 11), (4, 5)):
        mask = torch.rand(rows, length, generator=g) < 0.4
        mask[0] = False  # a row without a loss token
        masks.append(mask)
    masks[2][:] = False  # a micro-batch without any
    return masks


@pytest.mark.parametrize("seed", range(3))
def test_the_layout_from_the_host_and_the_device_is_the_masks_own(seed):
    masks = _random_masks(seed)
    width = max(m.shape[1] for m in masks)
    union = torch.zeros(width, dtype=torch.bool)
    for m in masks:
        union[: m.shape[1]] |= m.any(0)
    keep_union = union.nonzero().squeeze(1)
    hosts = [HostLayout(tuple(m.shape), np.flatnonzero(m.numpy().any(0)), np.flatnonzero(m.numpy())) for m in masks]
    for layout in (step_layout(masks), host_step_layout(hosts, "cpu")):
        assert torch.equal(layout.keep, keep_union)
        assert layout.counts == [int(m.sum()) for m in masks]
        grid_rows = []
        for mask, micro in zip(masks, layout.micro, strict=True):
            keep = mask.any(0).nonzero().squeeze(1)
            assert torch.equal(micro.keep, keep)
            assert torch.equal(micro.rows, mask[:, keep].reshape(-1).nonzero().squeeze(1))  # (row, position) order
            padded = torch.zeros(mask.shape[0], width, dtype=torch.bool)
            padded[:, : mask.shape[1]] = mask
            grid_rows.append(padded[:, keep_union])
        grid = torch.cat(grid_rows)  # [R, P]: every row of the step at the union's positions
        assert torch.equal(layout.rows, grid.reshape(-1).nonzero().squeeze(1))
        assert layout.row_bounds == [0, *torch.cumsum(grid.sum(1), 0).tolist()]


def test_the_collator_finds_them_on_the_host_and_a_changed_label_stops_the_step(tiny_pair, tmp_path):
    rows = [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]},
            {"input_ids": [9, 10, 11, 12], "completion_mask": [0, 1, 1, 1]}]
    batch = LossTokensCollator(_collate)(rows)
    key, labels = extras_of(batch).loss_layout
    assert key == "labels" and labels is batch["labels"]  # the host tensor itself: read as the step starts
    host = HostLayout.of(key, labels)
    assert host.shape == (2, 3) and host.keep.tolist() == [0, 1, 2] and host.flat.tolist() == [1, 2, 3, 4, 5]
    # the run's memo takes the host's layout, and checks it on the device with the step's guards
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    trainer = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], train_dataset=_data(),
                                  args=DistillationConfig(output_dir=str(tmp_path / "out"), use_cpu=True,
                                                          report_to="none", remove_unused_columns=False,
                                                          dataset_kwargs={"skip_prepare_dataset": True}),
                                  processing_class=tokenizer, data_collator=_collate)
    held = pop_extra(batch, "loss_layout")
    batch["labels"] = batch["labels"].clone()  # another tensor after the collator, then changed
    batch["labels"][1, 1] = -100
    trainer.layouts.start_step([batch], [batch["labels"][:, 1:] != -100], [held], trainer.context.deferred)
    with pytest.raises(RuntimeError, match="do not match the labels being trained on"):
        Guards(trainer.context).check_step()


def test_a_streamed_dataset_keeps_its_batches_plain_tensors(tiny_pair, tmp_path):
    """accelerate dispatches an `IterableDataset`'s batches from rank 0 and can only concatenate tensors: no host
    layout rides along there (its loss tokens are measured on the device)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    common = dict(use_cpu=True, report_to="none", max_steps=2, remove_unused_columns=False,
                  dataset_kwargs={"skip_prepare_dataset": True})
    mapped = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], train_dataset=_data(),
                                 args=DistillationConfig(output_dir=str(tmp_path / "mapped"), **common),
                                 processing_class=tokenizer, data_collator=_collate)
    streamed = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"],
                                   train_dataset=_data().to_iterable_dataset(),
                                   args=DistillationConfig(output_dir=str(tmp_path / "streamed"), **common),
                                   processing_class=tokenizer, data_collator=_collate)
    rows = [_data()[i] for i in range(2)]
    assert extras_of(mapped.data_collator(rows)).loss_layout is not None
    assert EXTRAS not in streamed.data_collator(rows)
    streamed.train()  # measured on the device instead
    assert streamed.state.global_step == 2
