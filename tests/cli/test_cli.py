"""`trl-distill` / `python -m trl_distill`: flags, dataset formats, bad input, 2 processes via accelerate."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from build_lock import plant_stale_build_lock, private_build_root  # tests/ is on sys.path
from oracles import held_out_loss
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill.cli import main
from trl_distill.testing import launch, synthetic_prompt_completion

ROOT = Path(__file__).parents[2]
FAST = ["--max_steps", "2", "--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none",
        "--logging_steps", "1", "--disable_tqdm", "true", "--save_strategy", "no"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    """The same examples in each format SFT reads, saved the ways users keep them."""
    tmp = tmp_path_factory.mktemp("datasets")
    ds = synthetic_prompt_completion(24)
    paths = {"prompt_completion": str(tmp / "pc.jsonl"), "text": str(tmp / "lm.parquet"),
             "messages": str(tmp / "conversations"), "bad_columns": str(tmp / "bad.csv")}
    ds.to_json(paths["prompt_completion"])
    ds.map(lambda r: {"text": r["prompt"] + r["completion"]}, remove_columns=["prompt", "completion"]).to_parquet(
        paths["text"]
    )
    ds.map(
        lambda r: {"messages": [{"role": "user", "content": r["prompt"]},
                                {"role": "assistant", "content": r["completion"]}]},
        remove_columns=["prompt", "completion"],
    ).save_to_disk(paths["messages"])
    ds.rename_column("prompt", "question").to_csv(paths["bad_columns"])
    return paths


def base_args(tiny_pair, dataset, output_dir):
    return ["--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path", tiny_pair["teacher"],
            "--dataset_name", dataset, "--output_dir", str(output_dir), "--use_cpu", *FAST]


def test_help_lists_teacher_and_loss_flags():
    out = subprocess.run([sys.executable, "-m", "trl_distill", "--help"], capture_output=True, text=True, check=True)
    for flag in ("--teacher_model_name_or_path", "--teacher_deepspeed", "--divergence", "--temperature", "--alpha",
                 "--beta", "--skew_alpha", "--loss_chunk_size", "--dataset_name", "--use_peft", "--lora_r"):
        assert flag in out.stdout, flag
    assert "Path or hub id of the teacher model" in out.stdout
    assert "forward_kl,reverse_kl,jsd,skew_forward_kl,skew_reverse_kl,tvd" in out.stdout


@pytest.mark.parametrize("fmt", ["prompt_completion", "text", "messages"])
def test_each_dataset_format_trains_and_saves(tiny_pair, datasets, tmp_path, fmt):
    main(base_args(tiny_pair, datasets[fmt], tmp_path / "out"))  # messages: assistant tokens by default
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(p.numel() for p in student.parameters()) == 37280
    initial, teacher = (AutoModelForCausalLM.from_pretrained(tiny_pair[m]) for m in ("student", "teacher"))
    assert all(not torch.equal(a, b) for a, b in zip(student.parameters(), initial.parameters(), strict=True))
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    rows = synthetic_prompt_completion(24)  # the rows the CLI trained on, in each format
    before, after = (held_out_loss(m, teacher, tokenizer, rows, temperature=1.0)["loss"] for m in (initial, student))
    # the CLI's defaults (alpha 0.5, T = 1, learning rate 2e-5), 2 steps: 0.5 KD + 0.5 CE on those rows' completions
    # measured 2.791905 -> 2.790914 / 2.790968 / 2.790989 (prompt_completion / text / messages; about -0.00095):
    # assert half that improvement
    assert after < before - 0.00045, (before, after)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"--teacher_model_name_or_path": "./no/such/teacher"}, "no model directory at './no/such/teacher'"),
        ({"--divergence": "kl"}, "argument --divergence: invalid choice: 'kl'"),
        ({"--dataset_name": "./no_such_data.jsonl"}, "Dataset path not found"),
        ({"--dataset_name": "bad_columns"}, "match no supported format"),
        ({"--temperature": "0"}, "temperature must be > 0"),
    ],
)
def test_bad_input_fails_with_one_line_and_writes_nothing(tiny_pair, datasets, tmp_path, capsys, change, message):
    args = base_args(tiny_pair, datasets["prompt_completion"], tmp_path / "out")
    for flag, value in change.items():
        value = datasets.get(value, value)
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
    assert err[-1].startswith("trl-distill: error:")
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_two_processes_with_the_headline_accelerate_config(tiny_pair, datasets, tmp_path):
    """`accelerate launch --config_file configs/accelerate/zero2_student_zero3_teacher.yaml -m trl_distill`."""
    out = tmp_path / "out"
    args = base_args(tiny_pair, datasets["prompt_completion"], out)
    args.remove("--use_cpu")
    yaml = str(ROOT / "configs" / "accelerate" / "zero2_student_zero3_teacher.yaml")
    result = launch("trl_distill", *args, "--teacher_deepspeed", str(ROOT / "configs/deepspeed/zero3_teacher.json"),
                    launcher="accelerate", launcher_args=("--config_file", yaml, "-m"), cwd=ROOT)
    assert result.stdout.count("'kd_loss'") == 2  # logged once per step (rank 0 prints)
    assert "model.safetensors" in {p.name for p in out.iterdir()}
    AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.distributed
def test_bad_input_fails_on_every_rank(tiny_pair, datasets, tmp_path):
    args = base_args(tiny_pair, datasets["bad_columns"], tmp_path / "out")
    with pytest.raises(RuntimeError) as failure:
        launch("trl_distill", *args, launcher_args=("-m",), timeout=120)
    assert str(failure.value).count("trl-distill: error: The 'train' split has columns") == 2
    assert not (tmp_path / "out").exists()


def test_plain_python_with_deepspeed_and_tensorboard(tiny_pair, datasets, tmp_path):
    """`python -m trl_distill` in a fresh process: one-process DeepSpeed, and `--report_to tensorboard` logs the
    distillation losses. It starts over a stale lock where DeepSpeed builds its CPU op (a first launch killed
    midway; in a TORCH_EXTENSIONS_DIR the user set), which torch alone would wait on forever: one line says it was
    removed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    extensions = private_build_root(tmp_path / "torch_extensions")  # a TORCH_EXTENSIONS_DIR of the user's
    lock = plant_stale_build_lock(extensions)

    args = base_args(tiny_pair, datasets["prompt_completion"], tmp_path / "out")
    args.remove("--use_cpu")
    args[args.index("--report_to") + 1] = "tensorboard"
    args += ["--deepspeed", str(ROOT / "configs/deepspeed/zero2_student.json")]
    env = {**os.environ, "TENSORBOARD_LOGGING_DIR": str(tmp_path / "tb"), "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(extensions)}
    done = subprocess.run([sys.executable, "-m", "trl_distill", *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count(f"trl-distill: removed a stale build lock, {lock}: a build of deepspeed_shm_comm was "
                             "stopped midway and no process holds it; the op is built again.") == 1
    assert not lock.exists()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    for tag in ("train/loss", "train/kd_loss", "train/ce_loss"):
        assert [e.step for e in events.Scalars(tag)] == [1, 2], tag
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")


@pytest.mark.distributed
def test_two_processes_with_torchrun(tiny_pair, datasets, tmp_path):
    """`torchrun --nproc_per_node 2 -m trl_distill --deepspeed zero2_student.json`: the teacher is derived ZeRO-3."""
    out = tmp_path / "out"
    args = base_args(tiny_pair, datasets["messages"], out)
    args.remove("--use_cpu")
    result = launch("trl_distill", *args, "--deepspeed", str(ROOT / "configs/deepspeed/zero2_student.json"),
                    launcher_args=("-m",))
    assert result.stdout.count("'kd_loss'") == 2
    assert "model.safetensors" in {p.name for p in out.iterdir()}


def test_the_generation_eval_from_the_command_line_on_conversations(tiny_pair, tmp_path):
    """Conversational rows with an answer column (train and test splits in one saved DatasetDict): the eval prompts
    are rendered by the chat template, the verifiers get TRL's conversational completions, and the run's log and
    `trl-distill report` carry eval_pass@1 at each evaluation."""
    import json

    from datasets import DatasetDict

    rows = synthetic_prompt_completion(24).map(
        lambda r: {"messages": [{"role": "user", "content": r["prompt"]},
                                {"role": "assistant", "content": r["completion"]}],
                   "answer": r["completion"].strip()}, remove_columns=["prompt", "completion"])
    DatasetDict({"train": rows.select(range(16)), "test": rows.select(range(16, 24))}).save_to_disk(tmp_path / "data")
    out = tmp_path / "out"
    args = base_args(tiny_pair, str(tmp_path / "data"), out)
    args[args.index("--max_steps") + 1] = "4"
    main([*args, "--eval_strategy", "steps", "--eval_steps", "2", "--eval_reward_funcs", "exact_match",
          "trl_distill.testing:even_length_reward", "--eval_max_new_tokens", "6"])
    log = json.loads((out / "trainer_state.json").read_text())["log_history"]
    evals = [h for h in log if "eval_pass@1" in h]
    assert [h["step"] for h in evals] == [2, 4]
    assert all(h["eval_generation_prompts"] == 8 and "eval_rewards/even_length_reward/mean" in h
               and "eval_teacher_nll" in h for h in evals)
    main(["report", str(out)])
    assert "| eval_pass@1 |" in (out / "report.md").read_text()


@pytest.mark.distributed
def test_two_processes_with_the_fsdp2_accelerate_config(tiny_pair, datasets, tmp_path):
    """`accelerate launch --config_file configs/accelerate/fsdp2_student_fsdp2_teacher.yaml -m trl_distill`, no
    other flag: an FSDP2 student (its checkpoint in FSDP's format) beside a teacher sharded over both ranks."""
    out = tmp_path / "out"
    args = base_args(tiny_pair, datasets["prompt_completion"], out)
    args.remove("--use_cpu")
    args[args.index("--save_strategy") + 1] = "steps"
    yaml = str(ROOT / "configs" / "accelerate" / "fsdp2_student_fsdp2_teacher.yaml")
    result = launch("trl_distill", *args, "--save_steps", "2", launcher="accelerate",
                    launcher_args=("--config_file", yaml, "-m"), cwd=ROOT)
    assert result.stdout.count("'kd_loss'") == 2  # logged once per step (rank 0 prints)
    held = re.search(r"the teacher is sharded with FSDP2 over 2 ranks: this rank holds ([\d.]+) of its ([\d.]+) MiB",
                     result.stdout)
    assert held and float(held[1]) == pytest.approx(float(held[2]) / 2, abs=0.006), result.stdout[-3000:]
    assert (out / "checkpoint-2" / "pytorch_model_fsdp.bin").exists()  # FSDP's own checkpoint of the student
    assert "model.safetensors" in {p.name for p in out.iterdir()}
    saved = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in saved.parameters()) == sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_pair["student"]).parameters())
