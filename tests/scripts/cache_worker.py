"""`trl-distill cache-teacher` through the CLI's own code, except that rank 0 SIGKILLs itself (no cleanup) once
shard KILL_AFTER is on disk: a crash to resume from.

    torchrun --nproc_per_node 2 tests/scripts/cache_worker.py KILL_AFTER [cache-teacher flags]
"""

import os
import signal
import sys

import trl_distill.cache.writer as writer
from trl_distill.cli.cache_teacher import main

kill_after = int(sys.argv[1])
fill = writer.fill_teacher_cache


def fill_then_die(*args, **kwargs):
    def on_shard(index: int) -> None:
        if index == kill_after and int(os.environ.get("RANK", "0")) == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    return fill(*args, on_shard=on_shard, **kwargs)


writer.fill_teacher_cache = fill_then_die
main(sys.argv[2:])
