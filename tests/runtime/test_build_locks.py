"""A killed run must not hang every later one: the `lock` a build of DeepSpeed's CPU op leaves when it is stopped
midway is removed with one line (`trl_distill.runtime.build_locks`), each environment builds in its own directory,
and the suite's shared ranks, which start over a planted stale lock (tests/conftest.py), say what they waited on when
they do not start."""

import os
import subprocess
import sys
import time

import pytest
from build_lock import OP

from trl_distill.runtime.build_locks import (
    build_root,
    clear_stale_locks,
    describe_locks,
    own_build_dir,
    prepare_op_builds,
)
from trl_distill.testing import launch

RANK_SCRIPT = "import torch.distributed as dist\nprint('rank', dist.get_rank(), 'of', dist.get_world_size())\n"


def stale(root, op="op_a"):
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    return lock


def test_a_lock_no_process_holds_is_removed_with_one_line_and_a_held_one_is_kept(tmp_path):
    dead = stale(tmp_path, "op_a")
    held = stale(tmp_path, "op_b")
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(held)!r}); import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while not any("held open by process" in line for line in describe_locks(tmp_path)):
            assert time.monotonic() < deadline, describe_locks(tmp_path)
            time.sleep(0.05)
        assert describe_locks(tmp_path)[1].endswith(f"held open by process {holder.pid})")
        lines = []
        assert clear_stale_locks(tmp_path, write=lines.append) == lines == [
            f"trl-distill: removed a stale build lock, {dead}: a build of op_a was stopped midway and no process "
            "holds it; the op is built again."]
        assert not dead.exists() and held.exists()  # a running build is waited for, as torch does
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_locks(tmp_path, write=lines.append) == [
        f"trl-distill: removed a stale build lock, {held}: a build of op_b was stopped midway and no process holds it;"
        " the op is built again."]
    assert clear_stale_locks(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == [
        ".trl_distill_lock_check", "op_a", "op_b"]  # nothing but the locks went


def test_each_environment_builds_in_its_own_directory_and_a_users_choice_is_kept(tmp_path, monkeypatch):
    """The trainer's import (as the command line's entry, a config's device set-up and `testing.launch`: each before
    DeepSpeed can build an op) points torch at this environment's directory (this suite's ranks build there too);
    importing the config alone leaves the environment as it is."""
    probe = "import os, trl_distill.{}; print(os.environ.get('TORCH_EXTENSIONS_DIR'))"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    ours, alone = (subprocess.run([sys.executable, "-c", probe.format(module)], env=env, capture_output=True,
                                  text=True, check=True).stdout for module in ("trainer", "config"))
    assert ours.strip() == str(own_build_dir()) == str(build_root()) and alone.strip() == "None"
    assert own_build_dir().name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}")
    assert "-env-" in own_build_dir().name and own_build_dir().parent.name == "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert prepare_op_builds() == [] and os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path) == str(build_root())


@pytest.mark.distributed
def test_the_shared_ranks_start_over_a_stale_build_lock(shared_ranks, tmp_path):
    """The session's ranks first started over a lock planted where they build DeepSpeed's CPU op (a directory of
    the pool's own, `RankPool.extensions`): torch would have waited on it forever; they removed it with one line (one
    rank; the other found it gone) and loaded the op."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    out = launch(script).stdout
    assert "rank 0 of 2" in out and "rank 1 of 2" in out
    lock = shared_ranks.planted
    assert lock == shared_ranks.extensions / OP / "lock" and not lock.exists()
    assert shared_ranks.first_start_output.count(f"trl-distill: removed a stale build lock, {lock}: a build of {OP} "
                                                 "was stopped midway") == 1
    assert (lock.parent / f"{OP}.so").exists()
