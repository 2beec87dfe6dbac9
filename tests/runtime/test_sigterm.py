"""SIGTERM (a scheduler preempting the job, `kill`, a launcher stopping its ranks) stops `trl-distill` with one line
naming the last complete checkpoint and how to resume it, exit status 143 (128 + 15), no traceback; that checkpoint
stays complete and is the one ``--resume_from_checkpoint true`` takes. One real run, started as a launcher starts a
rank (`scripts.fault_worker.start_ranks`), sent SIGTERM once its first checkpoint is complete."""

import signal
import time

import pytest
from scripts.fault_worker import start_ranks, stop_ranks, wait_ranks  # tests/ is on sys.path
from test_faults import base, checkpoints, line_of  # the fault tests' run and checks (tests/runtime is on sys.path)

from trl_distill.cli.errors import TERMINATED_STATUS, kept_checkpoint
from trl_distill.runtime.checkpoints import MARKER, resolve_resume
from trl_distill.testing import synthetic_prompt_completion


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "enable_jit_checkpoint"])
def test_sigterm_names_the_checkpoint_to_resume_and_exits_143(tiny_pair, tmp_path, jit):
    """With `--enable_jit_checkpoint` the HF Trainer's own handler saves a checkpoint a few seconds later and stops
    training as if it had ended: the same line then names that checkpoint, and the half-trained student is not saved
    as the result ("Distilled student saved to", exit 0, before)."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    synthetic_prompt_completion(32).to_json(data)
    jit_flag = ["--enable_jit_checkpoint", "true"] if jit else []
    ranks = start_ranks(base(tiny_pair, data, out, "--use_cpu", "--max_steps", "400", "--save_steps", "2",
                             *jit_flag), tmp_path / "logs")
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoint-2" / MARKER).exists():
            assert ranks[0].poll() is None and time.monotonic() < deadline, ranks[0].err[-3000:]
            time.sleep(0.01)
        ranks[0].process.send_signal(signal.SIGTERM)
        assert wait_ranks(ranks, timeout=60) == [TERMINATED_STATUS], ranks[0].err[-3000:]
    finally:
        stop_ranks(ranks)
    assert TERMINATED_STATUS == 143
    saved = checkpoints(out)  # (it may have gone on past checkpoint-2 before the signal landed)
    newest = max((name for name, whole in saved.items() if whole), key=lambda name: int(name.split("-")[1]))
    assert all(whole for name, whole in saved.items() if int(name.split("-")[1]) < int(newest.split("-")[1])), saved
    assert line_of(ranks[0], "trl-distill: terminated (SIGTERM): stopped; ") == (
        f"trl-distill: terminated (SIGTERM): stopped; the last complete checkpoint is {out / newest} (step "
        f"{newest.split('-')[1]}): resume with --resume_from_checkpoint true (the same command).")
    assert resolve_resume(True, str(out)) == str(out / newest)  # what the resume it names takes
    assert not (out / "model.safetensors").exists()  # stopped before the final save: nothing claims to be done
    assert "saved to" not in ranks[0].out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert kept_checkpoint(str(empty)) == (f"no complete checkpoint in {empty} yet: the same command starts again "
                                           "from step 0.")


def test_the_hf_jit_checkpoints_progress_file_is_not_one_of_its_files(tmp_path):
    """The HF Trainer's JIT checkpoint writes `checkpoint-is-incomplete.txt` before it saves (so our marker, written
    inside the save, saw it) and removes it after: the checkpoint is whole once it is gone, not while it is there
    (it was never whole: a resume skipped every JIT checkpoint)."""
    from trl_distill.runtime.checkpoints import JIT_IN_PROGRESS, is_complete, mark_complete

    checkpoint = tmp_path / "checkpoint-7"
    checkpoint.mkdir()
    (checkpoint / JIT_IN_PROGRESS).write_text("Checkpoint started at step 7 and in progress...")
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    mark_complete(str(checkpoint))
    assert not is_complete(str(checkpoint))  # still saving
    (checkpoint / JIT_IN_PROGRESS).unlink()
    assert is_complete(str(checkpoint))
    (checkpoint / "model.safetensors").write_bytes(b"cut")
    assert not is_complete(str(checkpoint))
