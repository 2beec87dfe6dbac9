"""Expected faults after start-up, through the command line: a teacher turning NaN, a disk filling up while
checkpointing, a rank that freezes or is interrupted. Each stops `trl-distill` with one line on every rank that can
still speak, exit status 1 (130 for Ctrl-C), no traceback, within bounded time, and leaves the last complete checkpoint
complete. The ranks are started as a launcher starts them (`scripts.fault_worker.start_ranks`), each with its own
stderr and exit status."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from scripts.fault_worker import start_ranks, stop_ranks, wait_ranks  # tests/ is on sys.path

from trl_distill.runtime.checkpoints import MARKER, is_complete
from trl_distill.testing import synthetic_prompt_completion

ROOT = Path(__file__).parents[2]
ZERO2 = str(ROOT / "configs/deepspeed/zero2_student.json")
FAST = ["--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--disable_tqdm", "true",
        "--logging_steps", "1", "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--max_length", "64",
        "--train_sampling_strategy", "sequential"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "data.jsonl"
    synthetic_prompt_completion(32).to_json(path)
    return path


def base(tiny_pair, data, out: Path, *extra: str, teacher: str | None = None) -> list[str]:
    return ["--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path",
            teacher or tiny_pair["teacher"], "--dataset_name", str(data), "--output_dir", str(out), *FAST, *extra]


def line_of(rank, prefix: str = "trl-distill: error: ") -> str:
    """The one line of ours on the rank's stderr, the last it printed, and no traceback."""
    err = rank.err
    assert "Traceback" not in err, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("trl-distill")]
    assert len(ours) == 1 and ours[0].startswith(prefix) and err.rstrip().endswith(ours[0]), err[-3000:]
    return ours[0]


def checkpoints(out: Path) -> dict[str, bool]:
    """``{checkpoint-N: marked complete and whole}``."""
    return {p.name: (p / MARKER).exists() and is_complete(p) for p in sorted(out.glob("checkpoint-*"))}


@pytest.mark.distributed
def test_a_teacher_turning_nan_stops_both_ranks_with_one_line(tiny_pair, tmp_path):
    """2 processes (ZeRO-2 student, ZeRO-3 teacher): the saved teacher holds NaN in one row of its embedding layer,
    the row of a token ("Z") only the 11th example has; in dataset order that example is rank 1's at step 3, after
    checkpoint-2 was written. Both ranks stop at step 3 with the one line."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_pair["teacher"], teacher)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    z = tokenizer.convert_tokens_to_ids("Z")
    weights = load_file(teacher / "model.safetensors")
    weights["model.embed_tokens.weight"][z] = float("nan")
    save_file(weights, teacher / "model.safetensors", metadata={"format": "pt"})
    rows = synthetic_prompt_completion(16).to_list()
    rows[10]["prompt"] = rows[10]["prompt"].replace("reverse:", "reverse: Z")
    assert [i for i, r in enumerate(rows) if z in tokenizer(r["prompt"] + r["completion"])["input_ids"]] == [10]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    ranks = start_ranks(base(tiny_pair, data, out, "--deepspeed", ZERO2, "--max_steps", "6", "--save_steps", "2",
                             teacher=str(teacher)), tmp_path / "logs", nproc=2)
    try:
        assert wait_ranks(ranks, timeout=240) == [1, 1], [r.err[-3000:] for r in ranks]
    finally:
        stop_ranks(ranks)
    for rank in ranks:
        assert "The teacher produced NaN or inf at step 3 (on 1 rank(s))" in line_of(rank)
    assert abs(ranks[0].ended - ranks[1].ended) < 10
    assert checkpoints(out) == {"checkpoint-2": True}


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs mounted for the test (we are root), unmounted after it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): the full-disk test needs one")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_disk_filling_up_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(tiny_pair, data,
                                                                                         small_disk):
    """Once checkpoint-2 is complete another writer fills the disk to 64 KiB free: writing checkpoint-4 fails with
    ENOSPC (in safetensors' or torch's writer, whichever comes first); the line names the file, the filesystem and
    checkpoint-2, which stays complete; checkpoint-4 is left unmarked."""
    out = small_disk / "out"
    ranks = start_ranks(base(tiny_pair, data, out, "--use_cpu", "--max_steps", "6", "--save_steps", "2"),
                        small_disk.parent / "logs")
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint-2" / MARKER).exists():
            assert ranks[0].poll() is None and time.monotonic() < deadline, ranks[0].err[-3000:]
            time.sleep(0.01)
        with open(small_disk / "filler", "wb") as filler:
            os.posix_fallocate(filler.fileno(), 0, shutil.disk_usage(small_disk).free - 64 * 1024)
        assert wait_ranks(ranks, timeout=120) == [1], ranks[0].err[-3000:]
    finally:
        stop_ranks(ranks)
    line = line_of(ranks[0])
    assert f"the disk is full writing {out / 'checkpoint-4'}{os.sep}" in line, line
    assert f"(No space left on device; the filesystem at {small_disk} has " in line
    assert line.endswith("the last complete checkpoint (checkpoint-2) is kept.")
    assert checkpoints(out) == {"checkpoint-2": True, "checkpoint-4": False}


def test_a_full_disk_reads_as_one_through_torch_and_safetensors(small_disk):
    """Each writer's own error for ENOSPC (torch.save's, safetensors'), on a real full tmpfs, is the disk's line."""
    from safetensors.torch import save_file

    from trl_distill.cli.errors import disk_full_message

    big = torch.zeros(5 * 1024 * 1024)  # 20 MiB: more than the disk holds
    for name, write in (("weights.pt", lambda path: torch.save(big, path)),
                        ("weights.safetensors", lambda path: save_file({"w": big}, path))):
        with pytest.raises(Exception) as raised:
            write(str(small_disk / name))
        message = disk_full_message(raised.value)
        assert message is not None and message.startswith(f"the disk is full writing {small_disk / name} ("), (
            name, raised.value)
        (small_disk / name).unlink(missing_ok=True)  # safetensors removes its own
    assert disk_full_message(RuntimeError("file write failed")) is None  # not a full disk: our bug, a traceback


@pytest.mark.distributed
def test_a_frozen_rank_stops_the_other_within_ddp_timeout(tiny_pair, data, tmp_path):
    """2 processes (DeepSpeed on CPU, gloo): rank 1 freezes (SIGSTOP) at the end of step 2. With --ddp_timeout 20,
    rank 0 stops with one line naming the timeout within 20 + 30 s; continued, rank 1 finds rank 0 gone and stops
    with one line too. checkpoint-1 stays complete, the half-written checkpoint-2 unmarked."""
    record, out = tmp_path / "fault.json", tmp_path / "out"
    ranks = start_ranks(base(tiny_pair, data, out, "--deepspeed", ZERO2, "--max_steps", "6", "--save_steps", "1",
                             "--ddp_timeout", "20"), tmp_path / "logs", nproc=2, fault=("stop", 2, 1, record))
    try:
        assert wait_ranks(ranks[:1], timeout=240) == [1], ranks[0].err[-3000:]
        frozen = json.loads(record.read_text())["time"]
        assert ranks[0].ended - frozen < 20 + 30 and ranks[1].poll() is None
        ranks[1].process.send_signal(signal.SIGCONT)
        assert wait_ranks(ranks[1:], timeout=60) == [1], ranks[1].err[-3000:]
    finally:
        stop_ranks(ranks)
    assert "Rank 0 waited 20 s (--ddp_timeout) in a collective for rank 1, which stopped answering" in (
        line_of(ranks[0]))
    assert "Rank 1 lost its connection to rank 0 (" in line_of(ranks[1])
    saved = checkpoints(out)
    assert saved["checkpoint-1"] and not saved.get("checkpoint-2") and len(saved) <= 2, saved


@pytest.mark.distributed
def test_ctrl_c_on_one_rank_stops_both_at_once(tiny_pair, data, tmp_path):
    """2 processes: rank 1 gets SIGINT at the end of step 2. It says so and leaves without the 30 s exit barrier
    (its group is broken); rank 0 finds it gone and stops with one line. checkpoint-1 stays complete."""
    record, out = tmp_path / "fault.json", tmp_path / "out"
    ranks = start_ranks(base(tiny_pair, data, out, "--deepspeed", ZERO2, "--max_steps", "6", "--save_steps", "1"),
                        tmp_path / "logs", nproc=2, fault=("interrupt", 2, 1, record))
    try:
        assert wait_ranks(ranks, timeout=240) == [1, 130], [r.err[-3000:] for r in ranks]
    finally:
        stop_ranks(ranks)
    interrupted = json.loads(record.read_text())["time"]
    # Well under the 30 s exit barrier it skips. Not 10 s: under `make test`'s 2 xdist workers both cores are busy,
    # and rank 1 took 12.3 s once (a fresh clone, 398e9f1); with the barrier it would take 30 s or more
    assert ranks[1].ended - interrupted < 20 and ranks[0].ended - interrupted < 25
    assert line_of(ranks[1], "trl-distill: interrupted (Ctrl-C): stopped; the last complete checkpoint is "
                             f"{out}/checkpoint-1 (step 1): resume with --resume_from_checkpoint true (the same "
                             "command).")
    assert "Rank 0 lost its connection to rank 1 (" in line_of(ranks[0])
    assert checkpoints(out)["checkpoint-1"]


@pytest.mark.distributed
def test_ctrl_c_to_torchrun_stops_every_rank_at_once(tiny_pair, data, tmp_path):
    """SIGINT to `torchrun` (which passes it on to every rank): each rank says so on one line in its own log
    (``--redirects 3``) and all are gone within seconds, checkpoint-1 complete. (torchrun itself then prints its
    own SignalException traceback: the launcher's, not ours.)"""
    from trl_distill.runtime.distributed import free_port
    from trl_distill.testing import kill_tree

    out, logs = tmp_path / "out", tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "--redirects", "3", "--log-dir", str(logs), "-m", "trl_distill",
           *base(tiny_pair, data, out, "--deepspeed", ZERO2, "--max_steps", "400", "--save_steps", "1")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint-1" / MARKER).exists():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        interrupted = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)
        assert time.monotonic() - interrupted < 15
    finally:
        kill_tree(launcher.pid)
    for k in (0, 1):
        (err,) = logs.glob(f"**/attempt_0/{k}/stderr.log")
        assert "Traceback" not in err.read_text(), err.read_text()[-3000:]
        ours = [line for line in err.read_text().splitlines() if line.startswith("trl-distill")]
        assert len(ours) == 1, err.read_text()[-3000:]
        named = re.fullmatch(r"trl-distill: interrupted \(Ctrl-C\): stopped; the last complete checkpoint is "
                             rf"{re.escape(str(out))}/checkpoint-(\d+) \(step (\d+)\): resume with "
                             r"--resume_from_checkpoint true \(the same command\)\.", ours[0])
        assert named and named[1] == named[2] and checkpoints(out)[f"checkpoint-{named[1]}"], ours
    assert checkpoints(out)["checkpoint-1"]
