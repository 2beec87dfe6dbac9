"""`trl-distill report`: the curves and summary of a real (tiny, one-process) run, read from its trainer_state.json
and run record, checked against that file; and one clear line for a directory with nothing to report."""

import subprocess
import sys

import pytest
from report_checks import check_picture, check_summary
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.report import load_history, write_report, write_run_record
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings


@pytest.fixture(scope="module")
def finished_run(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "run"
    data = synthetic_prompt_completion(24)
    args = DistillationConfig(**tiny_run_settings(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, save_strategy="steps", save_steps=3,
        eval_strategy="steps", eval_steps=3, use_cpu=True, teacher_model_name_or_path=tiny_pair["teacher"]))
    trainer = DistillationTrainer(tiny_pair["student"], args=args, train_dataset=data,
                                  eval_dataset=data.select(range(8)),
                                  processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]))
    trainer.train()
    trainer.save_state()
    write_run_record(str(out), trainer.run_record())
    return out


def test_the_report_draws_each_logged_question_and_its_numbers_are_the_state_files(finished_run, tmp_path):
    picture, text = write_report(str(finished_run), str(tmp_path))
    check_picture(tmp_path / "report.png", ["loss", "agreement", "KL", "eval"])
    assert check_summary(tmp_path / "report.md", finished_run / "trainer_state.json") >= 10
    summary = (tmp_path / "report.md").read_text()
    assert "- divergence: forward_kl" in summary and "- temperature: 2.0" in summary and "steps: 6 of 6" in summary
    assert "Best eval_loss:" in summary


def test_a_checkpoint_alone_is_enough_and_the_command_line_prints_where_it_wrote(finished_run, tmp_path):
    (finished_run / "trainer_state.json").rename(tmp_path / "moved.json")
    (finished_run / "trl_distill_run.json").rename(tmp_path / "moved_run.json")
    try:
        history = load_history(str(finished_run))
        assert history.state_file.endswith("checkpoint-6/trainer_state.json")
        assert history.run["settings"]["alpha"] == 0.5
        done = subprocess.run([sys.executable, "-m", "trl_distill", "report", str(finished_run), "--into",
                               str(tmp_path / "rep")], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"Report written: {tmp_path / 'rep' / 'report.png'}" in done.stdout
        check_picture(tmp_path / "rep" / "report.png", ["loss", "agreement", "KL", "eval"])
    finally:
        (tmp_path / "moved.json").rename(finished_run / "trainer_state.json")
        (tmp_path / "moved_run.json").rename(finished_run / "trl_distill_run.json")


def test_a_state_file_cut_short_is_passed_over_for_the_newest_checkpoint_that_reads(finished_run, tmp_path, capsys):
    """OUT/trainer_state.json and checkpoint-6's cut short, checkpoint-3's intact: the report is checkpoint-3's, and
    says which files it passed over (docs/observability.md promises the fallback)."""
    from trl_distill.cli import main

    damaged = [finished_run / "trainer_state.json", finished_run / "checkpoint-6" / "trainer_state.json"]
    whole = [path.read_bytes() for path in damaged]
    try:
        for path, content in zip(damaged, whole, strict=True):
            path.write_bytes(content[: len(content) // 2])
        main(["report", str(finished_run), "--into", str(tmp_path)])
        printed = capsys.readouterr().out.splitlines()
        assert printed == [f"{path} cannot be read (cut short?): passed over for an older trainer_state.json"
                           for path in damaged] + [f"Report written: {tmp_path / 'report.png'} and "
                                                   f"{tmp_path / 'report.md'}"]
        summary = (tmp_path / "report.md").read_text()
        assert f"- read from: `{finished_run / 'checkpoint-3' / 'trainer_state.json'}`" in summary
        assert "steps: 3 of 6" in summary and all(f"- passed over (unreadable): `{p}`" in summary for p in damaged)
        assert check_summary(tmp_path / "report.md", finished_run / "checkpoint-3" / "trainer_state.json") >= 5
    finally:
        for path, content in zip(damaged, whole, strict=True):
            path.write_bytes(content)


def test_a_directory_with_nothing_to_report_is_one_line(tmp_path, capsys):
    from trl_distill.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["report", str(tmp_path)])  # the command line's own entry point, in this process
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"trl-distill: error: {tmp_path} holds no readable trainer_state.json, nor do its checkpoints: `trl-distill` "
        "writes one when training ends (Python API: call trainer.save_state())."]


def test_a_report_replaces_an_earlier_report_never_a_users_file_of_that_name(finished_run, tmp_path):
    into = tmp_path / "notes"
    write_report(str(finished_run), str(into))
    before = (into / "report.png").stat().st_mtime_ns
    write_report(str(finished_run), str(into))  # an earlier report: replaced
    assert (into / "report.png").stat().st_mtime_ns > before
    for name, mine in (("report.md", b"# My own notes on this run\n"), ("report.png", b"\x89PNG\r\n\x1a\n my own")):
        (into / "report.md").unlink(missing_ok=True)
        (into / "report.png").unlink(missing_ok=True)
        (into / name).write_bytes(mine)
        done = subprocess.run([sys.executable, "-m", "trl_distill", "report", str(finished_run), "--into", str(into)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            f"trl-distill: error: {into / name} exists and is not a report `trl-distill report` wrote: it is left as "
            "it is. Move it away, or write the report elsewhere with --into DIR."], done.stderr
        assert (into / name).read_bytes() == mine and sorted(p.name for p in into.iterdir()) == [name]
