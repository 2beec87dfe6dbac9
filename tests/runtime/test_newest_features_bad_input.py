"""Reliability round four, through `trl-distill` as an adversarial user tries the newest features: several teachers'
datasets (none dropped, mixed formats and paths holding `=` named right), their config as JSON (what TensorBoard's
callback writes), and `--alpha 0` without a teacher (the SFT baseline). Each case: the exit code, the one line,
and that nothing the user gave was lost."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from trl_distill import DistillationConfig
from trl_distill.cli import main
from trl_distill.run_plan import resolve
from trl_distill.teacher.no_teacher import SFT_ONLY
from trl_distill.testing import synthetic_prompt_completion

FAST = ["--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--logging_steps", "1",
        "--disable_tqdm", "true", "--save_strategy", "no", "--per_device_train_batch_size", "4", "--use_cpu", "true"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Prompt-completion files of 16, 8 and 4 rows (different rows), and a conversational one."""
    directory = tmp_path_factory.mktemp("data")
    paths = {}
    for name, rows, seed in (("one", 16, 0), ("two", 8, 1), ("three", 4, 2)):
        paths[name] = directory / f"{name}.jsonl"
        synthetic_prompt_completion(rows, seed=seed).to_json(str(paths[name]))
    paths["msgs"] = directory / "msgs.jsonl"
    Dataset.from_list([{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant",
                                                                              "content": f"{i} {i}"}]}
                       for i in range(8)]).to_json(str(paths["msgs"]))
    return paths


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """The CLI in this process: ``(exit code, stdout, stderr)``."""
    try:
        main(argv)
        code = 0
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def trained_steps(out: Path) -> int:
    return json.loads((out / "trainer_state.json").read_text())["global_step"]


def teachers(tiny_pair) -> list[str]:
    return ["--teachers", f"a={tiny_pair['teacher']}", f"b={tiny_pair['teacher']}"]


def test_a_teacher_named_twice_in_dataset_name_trains_on_both_of_its_datasets(tiny_pair, files, tmp_path, capsys):
    """`a=one,a=two,b=three`: 16 + 8 rows for a, 4 for b, one epoch of 4-row batches is 7 steps (the second `a=`
    used to replace the first: 3 steps, silently)."""
    out = tmp_path / "out"
    code, _, err = run(["--model_name_or_path", tiny_pair["student"], *teachers(tiny_pair), "--dataset_name",
                        f"a={files['one']},a={files['two']},b={files['three']}", "--output_dir", str(out),
                        "--num_train_epochs", "1", *FAST], capsys)
    assert code == 0, err[-3000:]
    assert trained_steps(out) == (16 + 8 + 4) // 4
    state = json.loads((out / "trainer_state.json").read_text())
    routed = [entry["teacher_tokens/a"] for entry in state["log_history"] if "teacher_tokens/a" in entry]
    assert len(routed) == 7 and 0.5 < sum(routed) / len(routed) < 1  # most tokens are a's: 24 of its 28 rows


@pytest.mark.parametrize("names, message", [
    ("a={pc},b={msgs}", "The teachers' datasets are of different formats (a: prompt-completion, b: conversational)"),
    ("a={pc},a={msgs}", "--dataset_name gives the teacher 'a' datasets of different formats ({pc}: prompt-completion, "
                        "{msgs}: conversational); convert them to one format."),
])
def test_datasets_of_different_formats_are_named_with_their_formats(tiny_pair, files, tmp_path, capsys, names,
                                                                     message):
    out = tmp_path / "out"
    argv = ["--model_name_or_path", tiny_pair["student"], *teachers(tiny_pair), "--dataset_name",
            names.format(pc=files["one"], msgs=files["msgs"]), "--output_dir", str(out), "--max_steps", "1", *FAST]
    code, _, err = run(argv, capsys)
    errors = [line for line in err.splitlines() if line.startswith("trl-distill: error:")]
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert message.format(pc=files["one"], msgs=files["msgs"]) in errors[0]
    assert "text_target" not in err and "assistant_only_loss" not in err
    assert not (out / "trainer_state.json").exists()


def test_an_existing_file_whose_path_holds_equals_is_one_dataset(tiny_pair, files, tmp_path, capsys):
    """`--dataset_name /d/eq=dir.jsonl` is that file, not teacher `/d/eq`'s dataset `dir.jsonl`."""
    odd = tmp_path / "d" / "eq=dir.jsonl"
    odd.parent.mkdir()
    odd.write_bytes(files["one"].read_bytes())
    out = tmp_path / "out"
    code, _, err = run(["--model_name_or_path", tiny_pair["student"], *teachers(tiny_pair), "--teacher_combine",
                        "sum", "--dataset_name", str(odd), "--output_dir", str(out), "--num_train_epochs", "1",
                        *FAST], capsys)
    assert code == 0, err[-3000:]
    assert trained_steps(out) == 16 // 4


def test_several_teachers_config_is_json_as_logging_callbacks_write_it(tiny_pair, files, tmp_path, capsys):
    """`args.to_json_string()` (TensorBoard's and W&B's callbacks call it as training starts) with `TeacherSpec`
    entries: JSON that builds the same config again; and a run with `--report_to tensorboard` trains."""
    args = DistillationConfig(output_dir=str(tmp_path / "cfg"), teachers=[
        f"a={tiny_pair['teacher']}", {"name": "b", "model": tiny_pair["teacher"], "deepspeed": {"train_batch_size": 8}},
        "c=cache:./cache"], teacher_combine="sum")
    unresolved = args.to_json_string()
    resolve(args)  # as the trainer does before any callback writes it: the config left as written
    assert args.to_json_string() == unresolved
    written = json.loads(args.to_json_string())
    assert written["teachers"] == [{"name": "a", "model": tiny_pair["teacher"]},
                                   {"name": "b", "model": tiny_pair["teacher"], "deepspeed": {"train_batch_size": 8}},
                                   {"name": "c", "cache": "./cache"}]
    again = DistillationConfig(output_dir=str(tmp_path / "cfg"), teachers=written["teachers"], teacher_combine="sum")
    assert resolve(again).teachers == resolve(args).teachers
    out = tmp_path / "out"
    argv = ["--model_name_or_path", tiny_pair["student"], *teachers(tiny_pair), "--teacher_combine", "sum",
            "--dataset_name", str(files["three"]), "--output_dir", str(out), "--max_steps", "1", *FAST,
            "--report_to", "tensorboard"]
    code, _, err = run(argv, capsys)
    assert code == 0, err[-3000:]
    assert list(out.rglob("events.out.tfevents.*"))  # TensorBoard's callback wrote its run, config and all


def test_alpha_0_without_a_teacher_trains_on_the_cross_entropy_and_says_so(tiny_pair, files, tmp_path, capsys):
    """As a user runs it (a process of its own, logging as `trl-distill` sets it up): rank 0's info lines show on
    stderr, this one among them, once."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "trl_distill", "--model_name_or_path", tiny_pair["student"],
                           "--alpha", "0", "--dataset_name", str(files["one"]), "--output_dir", str(out),
                           "--max_steps", "2", *FAST], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if SFT_ONLY in line]
    assert said == [f"trl_distill: {SFT_ONLY}"], done.stderr[-2000:]
    assert "trl_distill: student logits: " in done.stderr  # the logit-path line: an info line of the start-up
    log = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    assert len(log) == 2 and all(e["kd_loss"] == 0 and e["loss"] == pytest.approx(e["ce_loss"], rel=1e-5)
                                 for e in log)
    assert "teacher_ce" not in log[0] and log[0]["student_entropy"] > 0
    code, _, err = run(["--model_name_or_path", tiny_pair["student"], "--alpha", "0", "--lmbda", "1",
                        "--dataset_name", str(files["one"]), "--output_dir", str(tmp_path / "op"), "--max_steps", "1",
                        *FAST], capsys)
    assert code == 2 and "alpha=0 without a teacher has none: set lmbda=0" in err
    code, _, err = run(["--model_name_or_path", tiny_pair["student"], "--dataset_name", str(files["one"]),
                        "--output_dir", str(tmp_path / "none"), "--max_steps", "1", *FAST], capsys)
    assert code == 2 and "(--alpha 0 trains on the cross-entropy alone, without a teacher)" in err


@pytest.mark.distributed
def test_on_two_processes_rank_0_says_what_it_does_and_the_other_stays_quiet(tiny_pair, files, tmp_path):
    """The SFT-only line is logged on every rank: shown once, by rank 0 (`log_level` passive: INFO), not by rank 1
    (`log_level_replica` warning); `log_level_replica info` would show it on both (`process_log_level`)."""
    from types import SimpleNamespace

    from trl_distill.runtime.log_setup import process_log_level
    from trl_distill.testing import launch

    done = launch("trl_distill", "--model_name_or_path", tiny_pair["student"], "--alpha", "0", "--dataset_name",
                  str(files["one"]), "--output_dir", str(tmp_path / "out"), "--max_steps", "1", *FAST,
                  launcher_args=("-m",), timeout=240)
    assert done.stdout.count(f"trl_distill: {SFT_ONLY}") == 1, done.stdout[-3000:]
    levels = {(main, replica, rank_0): process_log_level(SimpleNamespace(log_level=main, log_level_replica=replica,
                                                                         should_log=rank_0))
              for main in ("passive", "error") for replica in ("passive", "warning", "info") for rank_0 in (0, 1)}
    assert levels[("passive", "warning", 1)] == logging.INFO and levels[("passive", "warning", 0)] == logging.WARNING
    assert levels[("passive", "info", 0)] == logging.INFO and levels[("error", "passive", 1)] == logging.ERROR
    assert levels[("passive", "passive", 0)] == logging.WARNING
