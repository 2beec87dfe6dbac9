"""LoRA students: beside a ZeRO-3 teacher (2 processes), adapter-only checkpoints, exact resume, merge, self-
distillation without a second copy of the base, no lm_head gradient buffer, and QLoRA refused without a GPU."""

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.cli import main as cli_main
from trl_distill.run_plan import resolve
from trl_distill.testing import build_tiny_model, build_tokenizer, launch, logged, synthetic_prompt_completion

WORKER = Path(__file__).parent / "scripts" / "lora_worker.py"
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


@pytest.fixture(scope="module")
def lora_student(tmp_path_factory) -> str:
    """A student of ~2.8M parameters, large enough that per-rank byte counts mean something."""
    path = tmp_path_factory.mktemp("lora_student")
    tok = build_tokenizer()
    build_tiny_model(tok, "student", seed=3, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def lora_runs(lora_student, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lora_runs")
    launch(WORKER, lora_student, str(out), "base_teacher", timeout=300)
    launch(WORKER, lora_student, str(out), "resume", str(out / "base_teacher" / "checkpoint-4"), timeout=300)
    launch(WORKER, lora_student, str(out), "self", timeout=300)
    runs = {m: [json.loads((out / m / f"rank{r}.json").read_text()) for r in (0, 1)]
            for m in ("base_teacher", "resume", "self")}
    runs["dir"] = out
    return runs


@pytest.mark.distributed
def test_checkpoints_hold_the_adapter_only(lora_runs, lora_student):
    checkpoint = lora_runs["dir"] / "base_teacher" / "checkpoint-4"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.json"} <= files
    assert not files & {"model.safetensors", "pytorch_model.bin"}
    with safe_open(checkpoint / "adapter_model.safetensors", "pt") as f:
        names = list(f.keys())
    assert len(names) == 16 and all("lora_A" in n or "lora_B" in n for n in names)  # 4 layers x (q, v) x (A, B)
    states = torch.load(checkpoint / "global_step4" / "mp_rank_00_model_states.pt", weights_only=False)
    assert sorted(states["module"]) == sorted(lora_runs["base_teacher"][0]["trainable"])  # no frozen base weights
    assert (checkpoint / "adapter_model.safetensors").stat().st_size < 0.01 * (
        Path(lora_student) / "model.safetensors").stat().st_size


@pytest.mark.distributed
def test_resume_from_an_adapter_checkpoint_is_exact(lora_runs):
    full, resumed = (logged(lora_runs[m][0]["log_history"], k) for m in ("base_teacher", "resume") for k in ("loss",))
    assert sorted(full) == sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step


@pytest.mark.distributed
def test_self_distillation_shares_the_base_and_matches_a_separate_copy(lora_runs):
    self_run, copy_run = lora_runs["self"], lora_runs["base_teacher"]
    for rank in (0, 1):
        assert self_run[rank]["teacher_is_student_base"] and self_run[rank]["teacher_shares_student_storage"]
        assert self_run[rank]["teacher_param_bytes"] == 0
        # the separate copy of the same base is ZeRO-3 partitioned: each rank holds half of it
        assert copy_run[rank]["teacher_param_bytes"] == copy_run[rank]["student_param_bytes"] // 2
    for key in ("loss", "kd_loss", "ce_loss"):
        mine, separate = logged(self_run[0]["log_history"], key), logged(copy_run[0]["log_history"], key)
        for step in separate:
            assert mine[step] == pytest.approx(separate[step], rel=1e-5, abs=1e-7), (key, step)
    assert logged(self_run[0]["log_history"], "kd_loss")[1] == 0.0  # LoRA starts as the identity: student == base


@pytest.mark.distributed
def test_frozen_lm_head_never_gets_a_gradient(lora_runs):
    for mode in ("base_teacher", "self"):
        for rank in (0, 1):
            assert lora_runs[mode][rank]["lm_head_grad_is_none"] == [True] * 8


@pytest.mark.distributed
def test_merge_writes_a_model_with_the_adapter_model_logits(lora_runs, tmp_path):
    adapter = lora_runs["dir"] / "base_teacher" / "checkpoint-8"
    cli_main(["merge", "--adapter", str(adapter), "--output", str(tmp_path / "merged")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    config = json.loads((adapter / "adapter_config.json").read_text())
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), adapter
    ).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    ids = tok(["reverse: cat dog => dog cat", "reverse: the red fast model =>"], return_tensors="pt", padding=True)
    with torch.no_grad():
        a, b = merged(**ids).logits, with_adapter(**ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_merge_refuses_a_directory_without_an_adapter(tiny_pair, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["merge", "--adapter", tiny_pair["student"], "--output", str(tmp_path / "m")])
    assert exit_info.value.code == 2
    assert "no adapter_config.json" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


class _VxHBytes(TorchDispatchMode):
    """Bytes of every `[V, H]`-shaped tensor produced by an aten op (an lm_head weight gradient or its copy)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.bytes = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and tuple(o.shape) == self.shape:
                self.bytes += o.numel() * o.element_size()
        return out


@pytest.mark.parametrize("use_lora", [True, False])
def test_lm_head_gradient_bytes_during_a_step(tiny_pair, tmp_path, use_lora):
    """Measured: a LoRA student's training step allocates no lm_head-sized tensor; a fully trained one does."""
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    config = DistillationConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False,
                                per_device_train_batch_size=4, report_to="none", max_steps=1)
    trainer = DistillationTrainer(
        tiny_pair["student"], tiny_pair["teacher"], args=config, train_dataset=synthetic_prompt_completion(8),
        processing_class=tok, peft_config=LoraConfig(**LORA) if use_lora else None,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    head = trainer.model.get_output_embeddings()
    with _VxHBytes(head.weight.shape) as recorder:
        trainer.training_step(trainer.model, batch, num_items_in_batch=(batch["labels"][:, 1:] != -100).sum())
    vocab, hidden = head.weight.shape
    if use_lora:
        assert recorder.bytes == 0 and head.weight.grad is None
    else:
        assert recorder.bytes >= vocab * hidden * 4 and head.weight.grad is not None


def test_lora_on_the_lm_head_is_refused(tiny_pair, tmp_path):
    config = DistillationConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    from peft import get_peft_model

    on_head = LoraConfig(**{**LORA, "target_modules": ["q_proj", "lm_head"]})
    # TRL's own check (the loss reads lm_head.weight directly, so a LoRA delta there would be ignored)
    with pytest.raises(ValueError, match="`lm_head` is not supported"):
        DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=config,
                            train_dataset=synthetic_prompt_completion(8), peft_config=on_head)
    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_pair["student"]), on_head)
    with pytest.raises(ValueError, match="`lm_head` is not supported"):
        DistillationTrainer(wrapped, tiny_pair["teacher"], args=config, train_dataset=synthetic_prompt_completion(8),
                            processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]))


def test_self_teacher_without_a_peft_student_is_refused(tiny_pair, tmp_path):
    config = DistillationConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match="needs a PEFT student"):
        DistillationTrainer(tiny_pair["student"], "self", args=config, train_dataset=synthetic_prompt_completion(8))


def test_qlora_is_refused_without_a_gpu(tmp_path):
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        resolve(DistillationConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                   model_init_kwargs={"quantization_config": {"load_in_4bit": True}}))


FAST = ["--max_steps", "2", "--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none",
        "--logging_steps", "1", "--disable_tqdm", "true", "--use_cpu"]


def _cli_args(tiny_pair, tmp_path, teacher):
    data = tmp_path / "data.jsonl"
    synthetic_prompt_completion(16).to_json(data)
    return ["--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path", teacher,
            "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"), *FAST]


@pytest.mark.distributed
def test_cli_trains_a_lora_student_beside_a_zero3_teacher_on_two_processes(tiny_pair, tmp_path):
    args = _cli_args(tiny_pair, tmp_path, tiny_pair["teacher"])
    args.remove("--use_cpu")
    configs = Path(__file__).parent.parent / "configs" / "deepspeed"
    result = launch("trl_distill", *args, "--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj",
                    "--deepspeed", str(configs / "zero2_student.json"),
                    "--teacher_deepspeed", str(configs / "zero3_teacher.json"), launcher_args=("-m",))
    teacher_line = next(line for line in result.stdout.splitlines() if "teacher DeepSpeed config" in line)
    assert '"stage": 3' in teacher_line and result.stdout.count("'kd_loss'") == 2
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files


@pytest.mark.parametrize(
    "extra, message",
    [([], "needs a LoRA student: add --use_peft"),
     (["--use_peft", "--load_in_4bit"], "need a CUDA GPU")],
)
def test_cli_refuses_self_teacher_without_peft_and_qlora_on_cpu(tiny_pair, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(_cli_args(tiny_pair, tmp_path, "self") + extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
