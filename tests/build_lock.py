"""A build lock as a stopped build leaves it: planted where DeepSpeed's CPU op is built, held by no process and old."""

from __future__ import annotations

import os
import time
from pathlib import Path

from trl_distill.runtime.build_locks import LOCK, build_root

OP = "deepspeed_shm_comm"  # the op a process group on CPU builds (and a killed first launch leaves locked)


def plant_stale_build_lock(age_s: float = 600) -> Path:
    """Create ``<build root>/deepspeed_shm_comm/lock``, as torch's `FileBaton` does, and close it at once: a build
    killed midway. Its time is set `age_s` in the past."""
    lock = build_root() / OP / LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass  # a lock is there already (stale, or a build of another process of this session): set its age only
    past = time.time() - age_s
    os.utime(lock, (past, past))
    return lock
