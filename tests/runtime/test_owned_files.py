"""What the user owns is never written over, deleted or silently replaced (issue 33): each refusal is one
`trl-distill: error:` line and an exit code, with every file under the test's directory as it was, byte for byte."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.cache.writer import _resume_point
from trl_distill.cli import main
from trl_distill.runtime import run_lock
from trl_distill.runtime.checkpoints import MARKER, check_resume, resolve_resume
from trl_distill.testing import build_tiny_model, build_tokenizer, launch, logged, synthetic_prompt_completion

ROOT = Path(__file__).parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
FAST = ["--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--logging_steps", "1",
        "--disable_tqdm", "true", "--save_strategy", "no"]
MISSING = "model.layers.1.mlp.down_proj.weight"


def tree(root: Path) -> dict[str, bytes | None]:  # every path under `root`, with its bytes (None: a directory)
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(Path(root).rglob("*"))}


def cli_args(student, teacher, data, output_dir, *extra, use_cpu: bool = True) -> list[str]:
    teacher_flags = ["--teacher_model_name_or_path", str(teacher)] if teacher else []
    return ["--model_name_or_path", str(student), *teacher_flags, "--dataset_name", str(data), "--output_dir",
            str(output_dir), "--max_steps", "1", *FAST, *(["--use_cpu", "true"] if use_cpu else []), *extra]


def one_line(capsys, argv, code: int = 2, prog: str = "trl-distill") -> str:  # in-process: exit `code`, one line
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"{prog}: error:")]
    assert exit_info.value.code == code and len(errors) == 1, (exit_info.value.code, errors)
    return errors[0]


def run_cli(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:  # its own process: exit handlers run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "trl_distill", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def error_lines(text: str, prog: str = "trl-distill") -> list[str]:
    return [line[line.index(f"{prog}: error:"):] for line in text.splitlines() if f"{prog}: error:" in line]


@pytest.fixture
def owned(tiny_pair, tmp_path) -> dict[str, Path]:
    """The user's own copies of the tiny student, teacher, tokenizer and a data file, under `tmp_path`."""
    paths = {name: tmp_path / "models" / name for name in ("student", "teacher", "tokenizer")}
    for name, path in paths.items():
        shutil.copytree(tiny_pair[name], path)
    paths["data"] = tmp_path / "data" / "pc.jsonl"
    paths["data"].parent.mkdir()
    synthetic_prompt_completion(16).to_json(str(paths["data"]))
    return paths


# ---- 1. output_dir apart from every input ----
TEACHER, DATASET = "the teacher (--teacher_model_name_or_path)", "the dataset (--dataset_name)"


@pytest.mark.parametrize("output, how, what", [
    ("models/teacher", "is", TEACHER), ("models/teacher/distilled", "is inside", TEACHER), ("models", "holds", TEACHER),
    ("models/student", "is", "the student (--model_name_or_path)"),
    ("models/tokenizer", "is", "the teacher's tokenizer (--teacher_tokenizer_name_or_path)"),
    ("data", "holds", DATASET), ("data/saved/sub", "is inside", DATASET),
    ("cache", "is", "the teacher cache (--teacher_cache)"), ("cache-teacher", "is", TEACHER),
])
def test_an_output_dir_that_is_holds_or_lies_inside_an_input_is_refused(owned, tmp_path, capsys, output, how, what):
    student, teacher, data, extra = owned["student"], owned["teacher"], tmp_path / "data" / "saved", []
    synthetic_prompt_completion(16).save_to_disk(str(data))  # (a .jsonl's path is the command line's to check)
    if output == "models":  # the student elsewhere, so that only the teacher is inside
        student = shutil.move(owned["student"], tmp_path / "student")
    if "tokenizer" in what:
        extra = ["--teacher_tokenizer_name_or_path", str(owned["tokenizer"])]
    if "cache" in what:
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "manifest.json").write_text("{}")
        teacher, extra = None, ["--teacher_cache", str(tmp_path / "cache")]
    argv, prog, target = cli_args(student, teacher, data, tmp_path / output, *extra), "trl-distill", tmp_path / output
    if output == "cache-teacher":  # its output is the cache directory: here the teacher's
        argv, prog, target = ["cache-teacher", *argv, "--teacher_cache", str(teacher)], f"{prog} cache-teacher", teacher
    before = tree(tmp_path)
    line = one_line(capsys, argv, prog=prog)
    assert f"The output directory {str(target)!r} {how} {what}" in line, line
    assert "Pass an output directory apart from every input" in line
    assert tree(tmp_path) == before  # not a byte written, not a file removed (no lock, no probe left)


# ---- 2. cache-teacher: only its own partial shards are deleted; a directory of other files is refused ----
def test_cache_teacher_into_a_directory_of_user_files_is_refused_untouched(owned, tmp_path, capsys):
    directory = tmp_path / "mine"
    directory.mkdir()
    (directory / "notes.tmp").write_text("my notes, in a .tmp file")
    (directory / "results.csv").write_text("a,b\n1,2\n")
    before = tree(tmp_path)
    argv = ["cache-teacher", *cli_args(owned["student"], owned["teacher"], owned["data"], tmp_path / "unused"),
            "--teacher_cache", str(directory), "--cache_top_k", "4"]
    line = one_line(capsys, argv, prog="trl-distill cache-teacher")
    assert f"{directory} is not empty and holds no teacher cache ('notes.tmp', 'results.csv')" in line
    assert tree(tmp_path) == before


def test_a_cache_rerun_deletes_its_own_partial_shards_and_nothing_else(tmp_path):
    from trl_distill.cache.manifest import Manifest

    manifest = Manifest("t", None, "h", vocab_size=10, top_k=2, temperature=1.0, max_length=8, log_prob_dtype="7bit",
                        dataset_fingerprint="f", num_rows=4, shard_rows=2)
    manifest.save(tmp_path)
    mine = {"shard-00001.arrow.trl_distill.tmp": b"half a shard", "shard-00000.arrow.tmp": b"an older half"}
    theirs = {"notes.tmp": b"the user's", "shard-1.arrow.tmp": b"not our name", "x.arrow.trl_distill.tmp": b"nor this"}
    for name, content in {**mine, **theirs}.items():
        (tmp_path / name).write_bytes(content)
    assert _resume_point(manifest, str(tmp_path)) == []
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "manifest.json"} == theirs


# ---- 3. one run per output_dir ----
@pytest.fixture
def holder(tmp_path):
    """A live process (tests/scripts/run_lock_holder.py) holding the lock on ``tmp_path / "out"``."""
    process = subprocess.Popen([sys.executable, str(SCRIPTS / "run_lock_holder.py"), str(tmp_path / "out")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield process
    process.kill()  # (nothing, when it is gone already)
    process.wait()


@pytest.mark.distributed
def test_a_second_run_is_refused_on_every_rank_and_a_killed_runs_lock_is_taken_over(owned, tmp_path, capsys,
                                                                                    holder):
    out = tmp_path / "out"
    (out / "mine.txt").write_text("the user's file in the output directory")
    lock = out / run_lock.LOCK_NAME
    assert json.loads(lock.read_text())["pid"] == holder.pid
    before = tree(tmp_path)
    argv = cli_args(owned["student"], owned["teacher"], owned["data"], out)
    line = one_line(capsys, argv)  # 1 process
    assert f"Another run is using output_dir {str(out)!r}: pid {holder.pid} on host" in line
    with pytest.raises(RuntimeError) as failure:  # 2 processes: rank 1 learns rank 0's verdict and stops too
        launch("trl_distill", *argv, launcher_args=("-m",), timeout=240)
    assert error_lines(str(failure.value)) == [line, line], str(failure.value)[-3000:]
    assert tree(tmp_path) == before  # the holder's lock and the user's file as they were

    holder.kill()  # SIGKILL: its lock stays behind, naming a dead pid
    holder.wait()
    result = launch("trl_distill", *argv, launcher_args=("-m",), timeout=300)
    assert result.stdout.count(f"trl-distill: taking over the stale lock {lock} left by pid {holder.pid}") == 1
    assert f"pid {holder.pid} is no longer running on this host" in result.stdout
    assert (out / "model.safetensors").exists() and not lock.exists()  # trained, saved, released
    assert (out / "mine.txt").read_text() == "the user's file in the output directory"


def test_a_stale_lock_naming_a_dead_pid_is_taken_over_with_a_message(owned, tmp_path, capsys):
    (dead := subprocess.Popen([sys.executable, "-c", "pass"])).wait()
    (out := tmp_path / "out").mkdir()
    _write_lock(out, host=(host := run_lock.socket.gethostname()), pid=dead.pid, started=1.0)
    main(cli_args(owned["student"], owned["teacher"], owned["data"], out))
    err = capsys.readouterr().err
    assert f"trl-distill: taking over the stale lock {out / run_lock.LOCK_NAME} left by pid {dead.pid} on host " \
           f"{host!r}: pid {dead.pid} is no longer running on this host." in err
    assert (out / "model.safetensors").exists() and not (out / run_lock.LOCK_NAME).exists()


def test_the_lock_is_reentrant_in_one_process_and_a_reused_pid_is_stale(tmp_path, capsys):
    out = tmp_path / "new"
    first = run_lock.acquire(str(out))
    record = json.loads((out / run_lock.LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == run_lock.socket.gethostname()
    run_lock.acquire(str(out)).release()  # a second trainer in this process: the same run, its lock kept
    assert json.loads((out / run_lock.LOCK_NAME).read_text()) == record
    first.release()
    assert not out.exists()  # the lock made it, and nothing else was written there
    out.mkdir()  # the parent is alive, but started at another time than the lock says: the pid was reused
    _write_lock(out, host=run_lock.socket.gethostname(), pid=os.getppid(), started=12.0)
    run_lock.acquire(str(out)).release()
    assert f"pid {os.getppid()} is another process now" in capsys.readouterr().err


def _write_lock(out: Path, **record) -> Path:
    path = out / run_lock.LOCK_NAME
    path.write_text(json.dumps({"token": "x", **record}))
    return path


def test_another_hosts_lock_is_stale_once_its_heartbeat_stops(tmp_path, capsys):
    path, stop = _write_lock(tmp_path, host="elsewhere", pid=1, started=1.0), threading.Event()
    thread = threading.Thread(target=lambda: [os.utime(path) for _ in iter(lambda: stop.wait(0.05), True)])
    thread.start()  # a live holder on another host touches its lock
    try:
        with pytest.raises(run_lock.RunLockedError, match="pid 1 on host 'elsewhere'"):
            run_lock.acquire(str(tmp_path), stale_after=1.0)
    finally:
        stop.set()
        thread.join()
    start = time.monotonic()
    run_lock.acquire(str(tmp_path), stale_after=1.0).release()  # no heartbeat any more: taken over after 1 s
    assert 1.0 <= time.monotonic() - start < 5.0
    assert "its heartbeat did not move for 1 s" in capsys.readouterr().err
    os.utime(_write_lock(tmp_path, host="elsewhere", pid=1), (time.time() - 3600, time.time() - 3600))
    start = time.monotonic()
    run_lock.acquire(str(tmp_path), stale_after=1.0).release()  # an hour old: no need to watch it
    assert time.monotonic() - start < 0.5 and "its heartbeat stopped 36" in capsys.readouterr().err  # 3600 s


# ---- 4. resume: the newest complete checkpoint, or a fresh start said in one line ----
def _trainer(tiny_pair, out, max_steps, **kwargs):
    config = DistillationConfig(output_dir=str(out), use_cpu=True, bf16=False, report_to="none",
                                gradient_checkpointing=False, max_steps=max_steps, save_steps=1, logging_steps=1,
                                learning_rate=5e-3, lr_scheduler_type="linear", per_device_train_batch_size=2,
                                disable_tqdm=True, seed=0, **kwargs)
    return DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=config,
                               train_dataset=synthetic_prompt_completion(16))


def _incomplete_copy(source: Path, target: Path) -> None:
    """`source` as a run killed while writing it leaves it: weights and trainer state, no optimizer, no marker."""
    shutil.copytree(source, target)
    for name in (MARKER, "optimizer.pt", "scheduler.pt"):
        (target / name).unlink()


@pytest.fixture(scope="module")
def uninterrupted(tiny_pair, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    _trainer(tiny_pair, out, 4).train()
    return out


def test_resume_true_takes_the_newest_complete_checkpoint_with_its_optimizer_and_schedule(tiny_pair, uninterrupted,
                                                                                          tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for step in (1, 2):  # complete; checkpoint-3 is what a run killed while writing it leaves
        shutil.copytree(uninterrupted / f"checkpoint-{step}", out / f"checkpoint-{step}")
    _incomplete_copy(uninterrupted / "checkpoint-3", out / "checkpoint-3")
    trainer = _trainer(tiny_pair, out, 4)
    trainer.train(resume_from_checkpoint=True)
    reference = json.loads((uninterrupted / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    resumed = trainer.state.log_history  # steps 1-2 as checkpoint-2 logged them, 3-4 computed again
    for key in ("loss", "learning_rate"):  # (from the incomplete checkpoint-3: a fresh optimizer and schedule)
        mine, theirs = logged(resumed, key), logged(reference, key)
        assert sorted(mine) == [1, 2, 3, 4]
        for step in (3, 4):
            assert mine[step] == pytest.approx(theirs[step], rel=1e-6), (key, step)
    assert logged(resumed, "learning_rate")[4] < logged(resumed, "learning_rate")[3]  # a schedule, not a constant
    for step in (3, 4):  # the optimizer state (Adam moments, step counts) equals the uninterrupted run's
        ours, theirs = (torch.load(d / f"checkpoint-{step}" / "optimizer.pt", weights_only=True)["state"]
                        for d in (out, uninterrupted))
        assert len(ours) > 0 and ours.keys() == theirs.keys()
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-8)


def test_resume_true_with_only_an_incomplete_checkpoint_starts_fresh_and_says_so(tiny_pair, uninterrupted, tmp_path,
                                                                                 caplog):
    out = tmp_path / "out"
    out.mkdir()
    _incomplete_copy(uninterrupted / "checkpoint-2", out / "checkpoint-2")
    trainer = _trainer(tiny_pair, out, 4)
    with caplog.at_level("WARNING", logger="trl_distill.runtime.checkpoints"):
        trainer.train(resume_from_checkpoint=True)
    assert (f"--resume_from_checkpoint true: no complete checkpoint in {str(out)!r} (checkpoint-2 incomplete: a run "
            "stopped while writing); starting from step 0.") in caplog.text
    reference = json.loads((uninterrupted / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    for key in ("loss", "learning_rate"):  # all 4 steps afresh, as the uninterrupted run computed them
        mine, theirs = logged(trainer.state.log_history, key), logged(reference, key)
        assert sorted(mine) == [1, 2, 3, 4] and mine == pytest.approx(theirs, rel=1e-6), key
    _incomplete_copy(uninterrupted / "checkpoint-1", tmp_path / "checkpoint-1")  # named: refused, not resumed
    with pytest.raises(ValueError, match="checkpoint-1' is incomplete"):
        resolve_resume(str(tmp_path / "checkpoint-1"), str(tmp_path))


def test_resume_true_into_a_new_or_empty_output_dir_starts_fresh(owned, tmp_path, caplog):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        with caplog.at_level("WARNING", logger="trl_distill.runtime.checkpoints"):
            main(cli_args(owned["student"], owned["teacher"], owned["data"], out, "--resume_from_checkpoint", "true"))
        assert f"true: no complete checkpoint in {str(out)!r}; starting from step 0." in caplog.text
        assert (out / "model.safetensors").exists()


# ---- 5. resume of another student ----
def test_resuming_another_students_checkpoint_is_refused_naming_both(owned, tmp_path):
    out = tmp_path / "out"
    main(cli_args(owned["student"], owned["teacher"], owned["data"], out, "--save_strategy", "steps",
                  "--save_steps", "1"))
    other = tmp_path / "models" / "wider_student"
    tokenizer = AutoTokenizer.from_pretrained(owned["tokenizer"])
    build_tiny_model(tokenizer, "student", hidden_size=48, num_attention_heads=2).save_pretrained(other)
    tokenizer.save_pretrained(other)
    before = tree(tmp_path)
    result = run_cli(*cli_args(other, owned["teacher"], owned["data"], out, "--resume_from_checkpoint", "true",
                               "--max_steps", "2"))
    lines = error_lines(result.stderr)
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert (f"checkpoint-1' was trained from another student: {str(owned['student'])!r} (architecture ") in lines[0]
    assert f"there, {str(other)!r} (architecture " in lines[0] and "Traceback" not in result.stderr
    assert tree(tmp_path) == before

    record = json.loads((out / "checkpoint-1" / MARKER).read_text())["run"]
    changed = {**record, "student": {"name": str(other), "architecture": "0" * 16}}
    check_resume(str(out / "checkpoint-1"), changed, allow_changes=True)  # on purpose: allowed, with a warning
    with pytest.raises(ValueError, match="trained from another student"):
        check_resume(str(out / "checkpoint-1"), changed)


# ---- 6. a teacher (or student) that lacks a tensor ----
def _drop_tensor(directory: Path, name: str = MISSING) -> None:
    weights = load_file(directory / "model.safetensors")
    del weights[name]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("which", ["teacher", "student"])
def test_a_model_missing_a_tensor_is_refused_naming_it_and_the_file(owned, tmp_path, capsys, which):
    _drop_tensor(owned[which])
    before = tree(tmp_path)
    line = one_line(capsys, cli_args(owned["student"], owned["teacher"], owned["data"], tmp_path / "out"))
    flag = "teacher_model" if which == "teacher" else "--model_name_or_path"
    assert (f"{flag}: {owned[which] / 'model.safetensors'} lacks 1 tensor(s) the model needs ({MISSING}); loading "
            "would fill them with random values.") in line
    assert tree(tmp_path) == before


def test_both_load_paths_refuse_a_missing_tensor_and_accept_tied_weights(owned, tmp_path):
    from trl_distill.errors import ExternalError
    from trl_distill.runtime.validation import check_weights_complete
    from trl_distill.teacher.live import LiveTeacher
    from trl_distill.teacher.zero3_loading import refuse_missing, safetensors_index

    teacher, needs = owned["teacher"], rf"lacks 1 tensor\(s\) the model needs \({MISSING}\)"
    model = AutoModelForCausalLM.from_pretrained(teacher)
    refuse_missing(str(teacher), model, safetensors_index(str(teacher)))  # the partitioned loader: whole, accepted
    _drop_tensor(teacher)
    with pytest.raises(ExternalError, match="model.safetensors " + needs):
        refuse_missing(str(teacher), model, safetensors_index(str(teacher)))
    torch.save(load_file(teacher / "model.safetensors"), teacher / "pytorch_model.bin")  # `from_pretrained`'s path:
    (teacher / "model.safetensors").unlink()  # a .bin, which the up-front safetensors check does not read
    with pytest.raises(ExternalError, match="pytorch_model.bin " + needs):
        LiveTeacher(str(teacher))._load()
    tied = tmp_path / "tied"
    model = build_tiny_model(build_tokenizer(), "teacher", tie_word_embeddings=True)
    model.save_pretrained(tied)
    assert "lm_head.weight" not in load_file(tied / "model.safetensors")  # saved once, as the embedding
    check_weights_complete(str(tied), "teacher_model")
    torch.testing.assert_close(LiveTeacher(str(tied))._load().lm_head.weight, model.lm_head.weight)


@pytest.mark.distributed
def test_a_zero3_teacher_missing_a_tensor_stops_every_rank_with_one_line(owned, tmp_path):
    _drop_tensor(owned["teacher"])
    argv = cli_args(owned["student"], owned["teacher"], owned["data"], tmp_path / "out", "--deepspeed",
                    str(ROOT / "configs/deepspeed/zero2_student.json"), use_cpu=False)
    with pytest.raises(RuntimeError) as failure:
        launch(SCRIPTS / "missing_tensor_worker.py", *argv, timeout=300)
    text = str(failure.value)
    line = (f"trl-distill: error: teacher_model: {owned['teacher'] / 'model.safetensors'} lacks 1 tensor(s) the model "
            f"needs ({MISSING})")
    assert text.count("load_partitioned refused") == 2 and text.count(line) == 2, text[-3000:]
    assert "]: Traceback" not in text


# ---- 7. an unreadable teacher tokenizer ----
@pytest.mark.parametrize("name, content, message", [
    ("tokenizer.json", b'{"version": "1.0", "model": {', "is not valid JSON"),
    ("tokenizer.json", b'{"version": "1.0", "model": {"type": "nothing"}}', "cannot be parsed"),
    ("tokenizer_config.json", b"\xff\xfe not text", "is not valid JSON"),
])
def test_an_unreadable_teacher_tokenizer_file_is_refused_naming_it(owned, tmp_path, capsys, name, content, message):
    (owned["teacher"] / name).write_bytes(content)
    before = tree(tmp_path)
    line = one_line(capsys, cli_args(owned["student"], owned["teacher"], owned["data"], tmp_path / "out"))
    assert f"--teacher_model_name_or_path: the tokenizer file {owned['teacher'] / name} {message}" in line
    assert tree(tmp_path) == before


def test_a_teacher_without_tokenizer_files_falls_back_with_a_warning(owned, caplog):
    from trl_distill.teacher.resolve import TOKENIZER_FILES, load_teacher_tokenizer

    for name in TOKENIZER_FILES:
        (owned["teacher"] / name).unlink(missing_ok=True)
    args = DistillationConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
    with caplog.at_level("WARNING", logger="trl_distill.teacher.resolve"):
        assert load_teacher_tokenizer(args.teacher_tokenizer_name_or_path, str(owned["teacher"])) is None
    assert f"The teacher directory {owned['teacher']} has no tokenizer files" in caplog.text
