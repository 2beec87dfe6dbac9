"""One process, no DeepSpeed: the same API, with a plain frozen teacher module."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import build_tiny_model, logged, synthetic_prompt_completion, tiny_run_settings


def make_config(tmp_path, **overrides) -> DistillationConfig:
    """The settings of tests/scripts/distill_worker.py, on one process with the same global batch (4)."""
    kwargs = tiny_run_settings(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, save_strategy="no", use_cpu=True
    )
    kwargs.update(overrides)
    return DistillationConfig(**kwargs)


@pytest.fixture(scope="module")
def single_run(tiny_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    dataset = synthetic_prompt_completion(64)
    trainer = DistillationTrainer(
        tiny_pair["student"],
        args=make_config(tmp, teacher_model_name_or_path=tiny_pair["teacher"]),
        train_dataset=dataset,
        eval_dataset=dataset.select(range(16)),
        processing_class=tok,
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    return trainer, before, after


def test_loss_falls_and_eval_works(single_run):
    trainer, before, after = single_run
    losses = logged(trainer.state.log_history)
    assert len(losses) == 24
    assert sum(losses[s] for s in range(20, 25)) < 0.85 * sum(losses[s] for s in range(1, 6))
    assert {"eval_loss", "eval_kd_loss", "eval_ce_loss"} <= set(before)
    assert after["eval_loss"] < before["eval_loss"]


def test_teacher_is_frozen_and_never_saved(single_run, tiny_pair, tmp_path):
    trainer, _, _ = single_run
    teacher = trainer.teacher.module
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    reference = AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"])
    for (name, p), q in zip(teacher.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name  # training did not move the teacher
    trainer.save_model(str(tmp_path / "saved"))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert sum(p.numel() for p in saved.parameters()) == sum(p.numel() for p in trainer.model.parameters())


def test_logged_losses_do_not_depend_on_process_count(single_run, zero2_zero3_runs):
    """Same data order, seed and global batch: 1 process (no DeepSpeed) vs 2 (ZeRO-2 + ZeRO-3 teacher)."""
    trainer, _, _ = single_run
    two_procs = zero2_zero3_runs["main"][0]["log_history"]
    for key in ("loss", "kd_loss", "ce_loss"):
        one, two = logged(trainer.state.log_history, key), logged(two_procs, key)
        assert sorted(one) == sorted(two)
        assert one[1] == pytest.approx(two[1], rel=1e-6), key  # the first step: same batch, same weights
        for step in one:
            assert one[step] == pytest.approx(two[step], rel=1e-4), (key, step)


def test_models_as_instances(tiny_pair, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    student = AutoModelForCausalLM.from_pretrained(tiny_pair["student"])
    teacher = AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"])
    trainer = DistillationTrainer(
        student, teacher, args=make_config(tmp_path, max_steps=2, alpha=1.0),
        train_dataset=synthetic_prompt_completion(16), processing_class=tok,
    )
    trainer.train()
    assert trainer.teacher.module is teacher and not any(p.requires_grad for p in teacher.parameters())
    kd = logged(trainer.state.log_history, "kd_loss")
    assert logged(trainer.state.log_history) == pytest.approx(kd)  # alpha = 1: the loss is the KD term


def test_missing_teacher_is_a_clear_error(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="No teacher"):
        DistillationTrainer(
            tiny_pair["student"], args=make_config(tmp_path), train_dataset=synthetic_prompt_completion(8)
        )


def test_sft_config_is_converted_and_other_args_refused(tiny_pair, tmp_path):
    from trl import SFTConfig

    sft = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, learning_rate=7e-4, eos_token="</s>")
    trainer = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=sft,
                                  train_dataset=synthetic_prompt_completion(8))
    assert isinstance(trainer.args, DistillationConfig)
    assert (trainer.args.learning_rate, trainer.args.eos_token) == (7e-4, "</s>")  # to_dict masks *_token fields
    assert trainer.args.dataset_kwargs is None  # an SFT script's data is prepared by SFT, as before
    with pytest.raises(TypeError, match="DistillationConfig or TrainingArguments"):
        DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args={"output_dir": str(tmp_path)},
                            train_dataset=synthetic_prompt_completion(8))


def test_teacher_fsdp_config_without_an_fsdp2_student(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="^`teacher_fsdp_config` is set but the student does not use FSDP2"):
        DistillationTrainer(
            tiny_pair["student"], tiny_pair["teacher"],
            args=make_config(tmp_path, teacher_fsdp_config={"reshard_after_forward": True}),
            train_dataset=synthetic_prompt_completion(8),
            processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]),
        )


def test_teacher_deepspeed_without_student_deepspeed(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="student does not use DeepSpeed"):
        DistillationTrainer(
            tiny_pair["student"], tiny_pair["teacher"],
            args=make_config(tmp_path, teacher_deepspeed={"zero_optimization": {"stage": 3}}),
            train_dataset=synthetic_prompt_completion(8),
            processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]),
        )


def test_vocabulary_mismatch_names_both_sizes(tiny_pair, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    small_teacher = build_tiny_model(tok, "teacher", vocab_size=len(tok) - 10)
    with pytest.raises(ValueError, match=rf"{len(tok)}.*{len(tok) - 10}|{len(tok) - 10}.*{len(tok)}"):
        DistillationTrainer(
            tiny_pair["student"], small_teacher, args=make_config(tmp_path),
            train_dataset=synthetic_prompt_completion(8), processing_class=tok,
        )


def test_padded_teacher_vocabulary_is_compared_on_the_tokenizer_length(tiny_pair, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    padded_teacher = build_tiny_model(tok, "teacher", vocab_size=len(tok) + 64)  # e.g. 152064 vs 151936 rows
    trainer = DistillationTrainer(
        tiny_pair["student"], padded_teacher, args=make_config(tmp_path, max_steps=2),
        train_dataset=synthetic_prompt_completion(16), processing_class=tok,
    )
    assert trainer.vocab_size == len(tok)
    trainer.train()
    assert all(v == v and v > 0 for v in logged(trainer.state.log_history, "kd_loss").values())


def test_gradient_accumulation_normalises_by_loss_tokens(tiny_pair, tmp_path):
    """2 micro-batches of 2 samples (with different token counts) equal one batch of 4: the loss is a sum over
    completion tokens divided by their count over the accumulated batch (`num_items_in_batch`)."""
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    runs = {}
    for batch, accumulation in ((4, 1), (2, 2)):
        trainer = DistillationTrainer(
            tiny_pair["student"], tiny_pair["teacher"],
            args=make_config(tmp_path / f"{batch}x{accumulation}", max_steps=4, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation),
            train_dataset=synthetic_prompt_completion(64), processing_class=tok,
        )
        trainer.train()
        runs[batch] = trainer.state.log_history
    for key in ("loss", "kd_loss", "ce_loss"):
        one, accumulated = logged(runs[4], key), logged(runs[2], key)
        assert sorted(one) == sorted(accumulated) == [1, 2, 3, 4]
        for step in one:
            assert accumulated[step] == pytest.approx(one[step], rel=1e-5), (key, step)


def test_predict_and_eval_metrics_weighted_like_eval_loss(tiny_pair, tmp_path):
    """predict() prepares the teacher too; eval_kd_loss/eval_ce_loss average samples exactly like eval_loss,
    also with an uneven last batch (18 samples, batches of 4)."""
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    dataset = synthetic_prompt_completion(18, seed=5)
    trainer = DistillationTrainer(
        tiny_pair["student"], tiny_pair["teacher"], args=make_config(tmp_path, alpha=0.25),
        train_dataset=dataset, eval_dataset=dataset, processing_class=tok,
    )
    output = trainer.predict(trainer.eval_dataset)  # SFT prepares train/eval datasets; predict takes one
    assert output.metrics["test_loss"] > 0
    metrics = trainer.evaluate()
    mixed = 0.25 * metrics["eval_kd_loss"] + 0.75 * metrics["eval_ce_loss"]
    assert metrics["eval_loss"] == pytest.approx(mixed, rel=1e-6)


def _conversations(n=8):
    return synthetic_prompt_completion(n).map(
        lambda r: {"messages": [{"role": "user", "content": r["prompt"]},
                                {"role": "assistant", "content": r["completion"]}]},
        remove_columns=["prompt", "completion"],
    )


def _assistant_tokens(tok, row) -> int:
    """Tokens rendered inside the template's generation block: the assistant's content and its `</s>`."""
    return len(tok(row["messages"][1]["content"] + "</s>", add_special_tokens=False)["input_ids"])


def test_conversational_data_trains_on_assistant_tokens_by_default(tiny_pair, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    data = _conversations()
    trainer = DistillationTrainer(
        tiny_pair["student"], tiny_pair["teacher"], args=make_config(tmp_path), train_dataset=data,
        processing_class=tok,
    )
    assert trainer.args.assistant_only_loss is True
    for row, prepared in zip(data, trainer.train_dataset):
        labelled = sum(label != -100 for label in prepared["labels"])
        assert labelled == _assistant_tokens(tok, row) < len(prepared["input_ids"])


def test_template_without_generation_markers_trains_on_every_token_and_warns(tiny_pair, tmp_path, caplog):
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '</s>' }}{% endfor %}"
    with caplog.at_level("WARNING", logger="trl_distill.data.prepare"):
        trainer = DistillationTrainer(
            tiny_pair["student"], tiny_pair["teacher"], args=make_config(tmp_path), train_dataset=_conversations(),
            processing_class=tok,
        )
    assert trainer.args.assistant_only_loss is False
    assert "no `{% generation %}` markers" in caplog.text
    prepared = trainer.train_dataset[0]
    assert all(label != -100 for label in prepared["labels"])


def test_stock_training_arguments_are_converted(tiny_pair, tmp_path):
    """A `Trainer` script's `TrainingArguments` keep their values; SFT's dataset preparation is skipped."""
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    data = synthetic_prompt_completion(16).map(
        lambda r: tok(r["prompt"] + r["completion"]), remove_columns=["prompt", "completion"]
    )
    stock = TrainingArguments(output_dir=str(tmp_path / "o"), learning_rate=1e-3, max_steps=3, use_cpu=True,
                              report_to="none", per_device_train_batch_size=4, logging_steps=1)
    trainer = DistillationTrainer(
        model=tiny_pair["student"], teacher_model=tiny_pair["teacher"], args=stock, train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False), processing_class=tok,
    )
    assert isinstance(trainer.args, DistillationConfig)
    assert (trainer.args.learning_rate, trainer.args.max_steps, trainer.args.divergence) == (1e-3, 3, "forward_kl")
    assert trainer.train_dataset.column_names == data.column_names  # untouched, as the stock Trainer leaves it
    trainer.train()
    assert len(logged(trainer.state.log_history, "kd_loss")) == 3


def test_training_arguments_in_the_teacher_slot_are_refused(tiny_pair, tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(TypeError, match="the second positional argument is the teacher"):
        DistillationTrainer(tiny_pair["student"], TrainingArguments(output_dir=str(tmp_path)))


@pytest.mark.distributed  # DeepSpeed in a process of its own (one rank, no torchrun)
def test_on_one_process_the_teacher_is_held_whole_unless_zero3_is_asked(tiny_pair, tmp_path):
    """Issue 55: ZeRO-3 over one process partitions nothing, and its per-module hooks cost host time on a GPU. Beside
    a one-process ZeRO-2 student the teacher is held whole (said in one line), and trains exactly as a ZeRO-3 teacher
    asked for with `teacher_deepspeed`."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).parent / "scripts" / "whole_teacher_worker.py"
    proc = subprocess.run([sys.executable, str(worker), str(Path(tiny_pair["teacher"]).parent), str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    runs = json.loads((tmp_path / "whole_teacher.json").read_text())
    whole, zero3 = runs["whole"], runs["zero3"]
    assert whole["engine"] == whole["module"] == "LlamaForCausalLM" and not whole["partitioned"]
    assert len(whole["said"]) == 1 and "held whole on cpu" in whole["said"][0]
    assert zero3["engine"] == "DeepSpeedEngine" and zero3["partitioned"] and not zero3["said"]
    assert list(whole["losses"]) == ["1", "2", "3", "4"]
    for step, loss in whole["losses"].items():
        assert loss == pytest.approx(zero3["losses"][step], rel=1e-6)
