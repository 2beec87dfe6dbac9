"""Precision that fits the machine (this one has no GPU): a config with no precision flag works, explicit flags the
machine cannot run are one clear error, and building a config raises no warning the user cannot act on."""

import logging
import warnings
from pathlib import Path

import pytest

from trl_distill import DistillationConfig
from trl_distill.model import precision as precision_module
from trl_distill.model.precision import cpu_supports_bf16


def test_a_config_without_precision_flags_works_on_a_cpu_machine(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = DistillationConfig(output_dir=str(tmp_path))
    assert args.use_cpu and not args.dataloader_pin_memory  # the Trainer's CPU path: no pin_memory warning
    assert args.bf16 is cpu_supports_bf16() and not args.fp16
    assert args.activation_checkpointing and args.gradient_checkpointing  # SFT's default, under its new name
    assert not [w for w in caught if "deprecated" in str(w.message)], [str(w.message) for w in caught]


def test_without_native_bf16_the_default_is_fp32_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(precision_module, "cpu_supports_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="trl_distill.model.precision"):
        args = DistillationConfig(output_dir=str(tmp_path))
    assert args.bf16 is False and args.use_cpu
    assert [r.getMessage() for r in caplog.records] == [
        "No GPU, and this CPU has no native bf16: training in fp32 (bf16=False)."
    ]


def test_explicit_precision_the_machine_cannot_run_names_the_flag(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"fp16=True needs a GPU.*--bf16 false"):
        DistillationConfig(output_dir=str(tmp_path), fp16=True)
    monkeypatch.setattr(precision_module, "cpu_supports_bf16", lambda: False)
    with pytest.raises(ValueError, match=r"bf16=True, but this machine has no GPU .* Pass --bf16 false"):
        DistillationConfig(output_dir=str(tmp_path), bf16=True)
    assert DistillationConfig(output_dir=str(tmp_path), bf16=False).bf16 is False  # explicit fp32: kept, no error


def test_with_a_gpu_the_default_is_trls_bf16_and_the_gpu_path(tmp_path, monkeypatch):
    """With a GPU that runs bf16, nothing is chosen for the user: TRL's default (bf16 unless fp16; trl 1.16's
    `BaseConfig`) and transformers' GPU path (no use_cpu, pinned memory). The GPU is simulated: `has_accelerator` and
    transformers' bf16 probe say yes, so nothing here touches a device."""
    import transformers.training_args

    monkeypatch.setattr(precision_module, "has_accelerator", lambda: True)
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    args = DistillationConfig(output_dir=str(tmp_path))
    assert args.bf16 and not args.fp16 and not args.use_cpu and args.dataloader_pin_memory
    assert args.mixed_precision == "bf16"
    fp16 = DistillationConfig(output_dir=str(tmp_path), fp16=True)  # fp16 asked for: TRL turns bf16 off
    assert fp16.fp16 and not fp16.bf16 and not fp16.use_cpu


@pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16")
def test_explicit_bf16_runs_on_a_cpu_that_has_it(tmp_path):
    args = DistillationConfig(output_dir=str(tmp_path), bf16=True)
    assert args.bf16 and args.use_cpu and args.mixed_precision == "bf16"


@pytest.fixture(scope="module")
def bf16_and_fp32_runs(tiny_pair, tmp_path_factory) -> dict:
    """tests/scripts/precision_worker.py in both precisions: ZeRO-2 student, ZeRO-3 teacher on the exact path."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, HyperCLOVAXConfig

    from trl_distill.testing import launch

    out = tmp_path_factory.mktemp("precision")
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["student"])
    config = HyperCLOVAXConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, logits_scaling=4.0, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    teacher = str(out / "teacher")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    worker = Path(__file__).parents[1] / "scripts" / "precision_worker.py"
    runs = {}
    for mode in ("fp32", "bf16") if cpu_supports_bf16() else ("fp32",):  # bf16 needs the CPU's native units
        launch(worker, tiny_pair["student"], teacher, str(out), mode, timeout=300)
        runs[mode] = [json.loads((out / mode / f"rank{r}.json").read_text()) for r in (0, 1)]
    return runs


@pytest.mark.distributed
def test_exact_teacher_path_under_zero3_equals_the_models_own_logits(bf16_and_fp32_runs):
    rank0, rank1 = bf16_and_fp32_runs["fp32"]
    first = rank0["log_history"][0]
    assert first["kd_loss"] == pytest.approx(rank0["reference"]["kd_loss"], rel=1e-5)
    assert first["ce_loss"] == pytest.approx(rank0["reference"]["ce_loss"], rel=1e-5)
    assert rank0["paths"] == rank1["paths"] == {"student": False, "teacher": True}  # the same path on every rank
    assert rank0["teacher_share"] == rank1["teacher_share"] == 0.5  # still partitioned


@pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16")
@pytest.mark.distributed
def test_bf16_trains_with_deepspeed_on_cpu_and_matches_fp32(bf16_and_fp32_runs):
    """Both engines run in bf16; the divergence is accumulated in fp32. The first step's logged losses match the fp32
    run's to about 2.5x the relative deviations measured here (2.3e-4 for kd_loss, 3e-6 for ce_loss)."""
    bf16, fp32 = bf16_and_fp32_runs["bf16"][0], bf16_and_fp32_runs["fp32"][0]
    assert (bf16["student_dtype"], bf16["teacher_dtype"]) == ("torch.bfloat16", "torch.bfloat16")
    assert (fp32["student_dtype"], fp32["teacher_dtype"]) == ("torch.float32", "torch.float32")
    # measured relative deviations: loss 1.2e-5 (2.88947 vs 2.88951), kd_loss 2.3e-4 (0.223314 vs 0.223366),
    # ce_loss 2.9e-6 (5.555628 vs 5.555645); tolerances ~2.5x those
    for key, rel in (("loss", 3e-5), ("kd_loss", 6e-4), ("ce_loss", 8e-6)):
        assert bf16["log_history"][0][key] == pytest.approx(fp32["log_history"][0][key], rel=rel), key
    losses = [h["loss"] for h in bf16["log_history"] if "loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it trains
