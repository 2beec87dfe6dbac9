"""A build lock as a stopped build leaves it, planted where a process about to start builds DeepSpeed's CPU op: held by
no process and old. It goes into a build directory of the test's own (`private_build_root`, seeded with the ops this
environment has built, so nothing is rebuilt), never into the one the session's other processes share: one of them
would find it first."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from trl_distill.runtime.build_locks import LOCK, own_build_dir

OP = "deepspeed_shm_comm"  # the op a process group on CPU builds (and a killed first launch leaves locked)


def private_build_root(root: Path) -> Path:
    """`root` made a ``TORCH_EXTENSIONS_DIR`` holding a copy of each op this environment has built (times kept: torch
    and ninja find them up to date), without their locks."""
    root.mkdir(parents=True, exist_ok=True)
    built = own_build_dir()
    for op in built.iterdir() if built.is_dir() else []:
        if op.is_dir() and any(op.glob("*.so")) and not (op / LOCK).exists():
            shutil.copytree(op, root / op.name, copy_function=shutil.copy2, dirs_exist_ok=True)
    return root


def plant_stale_build_lock(root: Path, age_s: float = 600) -> Path:
    """Create ``<root>/deepspeed_shm_comm/lock``, as torch's `FileBaton` does, and close it at once: a build killed
    midway. Its time is set `age_s` in the past."""
    lock = root / OP / LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    past = time.time() - age_s
    os.utime(lock, (past, past))
    return lock
