"""Bad input through `trl-distill`, as an adversarial user tries it: each case is one line (`trl-distill: error:`,
exit 2) before training, with nothing written to output_dir, or a counted skip; resume refuses another run."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from trl_distill.cli import main
from trl_distill.testing import launch, synthetic_prompt_completion

ROOT = Path(__file__).parents[2]
FAST = ["--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--logging_steps", "1",
        "--disable_tqdm", "true", "--save_strategy", "no"]


def cli_args(tiny_pair, dataset, output_dir, *extra, teacher=None):
    return ["--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path",
            teacher or tiny_pair["teacher"], "--dataset_name", str(dataset), "--output_dir", str(output_dir),
            "--max_steps", "1", *FAST, *extra]


def one_line(capsys, argv) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one `trl-distill: error:` line on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trl-distill: error:")]
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    return errors[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "pc.jsonl"
    synthetic_prompt_completion(16).to_json(str(path))
    return path


@pytest.mark.parametrize("flags, message", [
    (["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps must be >= 1, got 0."),
    (["--max_steps", "0"], "max_steps=0 trains nothing"),
])
def test_flags_out_of_range(tiny_pair, data, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the student already there")
    assert message in one_line(capsys, [*cli_args(tiny_pair, data, out), *flags])
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"the student already there"  # not overwritten


@pytest.mark.parametrize("name, content, message", [
    ("malformed.jsonl", '{"prompt": "a", "completion": " b"}\n{"prompt": "c", "completion": \n',
     "malformed.jsonl', line 2: not valid JSON (Expecting value). Fix or remove that line."),
    ("empty.jsonl", "", "empty.jsonl' is empty (0 bytes)."),
    ("mixed.jsonl", '{"prompt": "a", "completion": " b"}\n{"messages": [{"role": "user", "content": "x"}]}\n',
     "Row 1 of the 'train' split has no 'prompt' (it has ['messages']): every row must be in one format"),
    ("turns.jsonl", '{"messages": "hello"}\n', "Row 0 of the 'train' split: 'messages' must be a list of"),
])
def test_damaged_data_files_name_the_file_and_row(tiny_pair, tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    assert message in one_line(capsys, cli_args(tiny_pair, path, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_conversation_without_an_assistant_turn_is_a_counted_skip(tiny_pair, tmp_path, caplog):
    rows = [{"messages": [{"role": "user", "content": f"reverse: cat dog {i} =>"},
                          {"role": "assistant", "content": f" dog cat {i}"}]} for i in range(7)]
    rows.append({"messages": [{"role": "user", "content": "no answer here"}]})
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(cli_args(tiny_pair, path, tmp_path / "out", "--per_device_train_batch_size", "4", "--use_cpu"))
    assert "1 of 8 training rows have no assistant turn (no loss token) and are skipped." in caplog.text
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # it trained and saved


def test_output_dir_that_is_a_file_or_cannot_be_created(tiny_pair, data, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert "is an existing file, not a directory" in one_line(capsys, cli_args(tiny_pair, data, blocker))
    assert "is not a writable directory" in one_line(capsys, cli_args(tiny_pair, data, blocker / "sub"))
    assert blocker.read_text() == "not a directory"


@pytest.mark.distributed
def test_a_truncated_teacher_fails_every_rank_with_the_same_line(tiny_pair, data, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_pair["teacher"], teacher)
    weights = teacher / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # a download cut short
    argv = cli_args(tiny_pair, data, tmp_path / "out", "--deepspeed",
                    str(ROOT / "configs/deepspeed/zero2_student.json"), teacher=str(teacher))
    with pytest.raises(RuntimeError) as failure:
        launch("trl_distill", *argv, launcher_args=("-m",), timeout=120)
    line = f"trl-distill: error: teacher_model: {weights} is truncated"
    assert str(failure.value).count(line) == 2 and "]: Traceback" not in str(failure.value)  # no rank's traceback
    assert not (tmp_path / "out").exists()


def test_resume_true_from_the_cli_and_a_resume_with_other_settings(tiny_pair, data, tmp_path, capsys):
    out = tmp_path / "out"
    train = [*cli_args(tiny_pair, data, out, "--use_cpu"), "--save_strategy", "steps", "--save_steps", "1"]
    main([*train[: train.index("--max_steps")], "--max_steps", "2", *train[train.index("--max_steps") + 2:]])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    resume = [a if a != "1" or train[i - 1] != "--max_steps" else "3" for i, a in enumerate(train)]
    line = one_line(capsys, [*resume, "--resume_from_checkpoint", "true", "--divergence", "reverse_kl"])
    assert ("checkpoint-2' was trained with other distillation settings (divergence: 'forward_kl' there, "
            "'reverse_kl' now)") in line
    main([*resume, "--resume_from_checkpoint", "true"])  # `true` is the newest complete checkpoint, not a path
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]
    main([*resume, "--resume_from_checkpoint", str(out / "checkpoint-2"), "--divergence", "reverse_kl",
          "--resume_allow_changes", "true", "--output_dir", str(tmp_path / "changed")])


def test_resume_on_another_number_of_processes_is_one_line(tiny_pair, data, zero2_zero3_runs, tmp_path):
    """A checkpoint of the 2-process DeepSpeed run, resumed by a single DeepSpeed process."""
    checkpoint = zero2_zero3_runs["dir"] / "main" / "checkpoint-8"
    argv = [*cli_args(tiny_pair, data, tmp_path / "out"), "--deepspeed",
            str(ROOT / "configs/deepspeed/zero2_student.json"), "--resume_from_checkpoint", str(checkpoint)]
    result = subprocess.run([sys.executable, "-m", "trl_distill", *argv], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"trl-distill: error: Checkpoint '{checkpoint}' was written by 2 processes and this run has 1"
            in result.stderr)


def test_an_error_once_training_runs_keeps_its_traceback(tiny_pair, data, tmp_path, monkeypatch):
    """The one-line boundary covers parsing and set-up only: a bug mid-training surfaces whole."""
    from trl_distill.trainer import DistillationTrainer

    def broken(self, *args, **kwargs):
        raise ValueError("a bug inside the loss")

    monkeypatch.setattr(DistillationTrainer, "compute_loss", broken)
    with pytest.raises(ValueError, match="a bug inside the loss"):  # not SystemExit(2) with one line
        main(cli_args(tiny_pair, data, tmp_path / "out", "--use_cpu"))
