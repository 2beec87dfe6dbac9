"""trl_distill.compat: every private API we use still exists and behaves as relied on in the installed versions, and
the installed versions are the ones pyproject.toml pins (an upgrade that moves one fails here)."""

import importlib
from importlib.metadata import version

import pytest
import torch

from trl_distill import DistillationConfig, DistillationTrainer, compat
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings


def test_installed_versions_are_the_checked_ones():
    for package, checked in compat.CHECKED_AGAINST.items():
        assert version(package).startswith(checked), (package, version(package), checked)


@pytest.mark.parametrize("owner, hooks", [*compat.OVERRIDDEN_HOOKS.items(), *compat.RELIED_ON.items()])
def test_the_hooks_we_override_still_exist(owner, hooks):
    module, name = owner.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    for hook in hooks:
        assert hasattr(cls, hook), f"{owner}.{hook}"


@pytest.fixture(scope="module")
def trainer(tiny_pair, tmp_path_factory):
    from transformers import AutoTokenizer

    args = DistillationConfig(output_dir=str(tmp_path_factory.mktemp("compat")), **tiny_run_settings(max_steps=1))
    return DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=args,
                               train_dataset=synthetic_prompt_completion(8),
                               processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]))


def test_trainer_privates(trainer):
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    prepared = compat.prepare_inputs(trainer, batch)
    assert prepared["input_ids"].device == trainer.args.device and torch.equal(prepared["labels"], batch["labels"])
    assert trainer._loss_shifts_labels is True  # set by the trainer through compat; transformers defines it
    trainer._set_signature_columns_if_needed()
    compat.keep_dataset_column(trainer, "extra")
    assert "extra" in trainer._signature_columns and "input_ids" in trainer._signature_columns
    values = compat.eval_metric_values(trainer, "kd_loss")
    values.append(1.0)
    assert trainer._metrics["eval"]["kd_loss"] == [1.0]
    values.clear()
    with compat.deepspeed_hidden_from(trainer):
        assert trainer.is_deepspeed_enabled is False
    assert trainer.is_deepspeed_enabled is True


def test_accelerate_privates(trainer):
    accelerator = trainer.accelerator
    assert isinstance(compat.prepared_models(accelerator), list)
    assert compat.partial_state_fields()["num_processes"] == 1


def test_zero3_privates_on_a_plain_and_a_faked_parameter():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    plain = torch.nn.Parameter(torch.randn(3))
    assert not compat.is_zero3_partitioned(plain) and compat.zero3_partition(plain) is None
    plain.ds_id, plain.ds_status = 0, ZeroParamStatus.NOT_AVAILABLE
    assert compat.is_zero3_partitioned(plain)
    assert isinstance(compat.cpu_has_bf16_units(), bool)
