"""What a process does once before DeepSpeed is imported or builds an op: the warnings a user cannot act on
silenced (`quiet.quiet_unactionable_warnings`, which also tells DeepSpeed its accelerator on a machine without GPU)
and this environment's op build directory chosen, a stale build lock removed (`build_locks.prepare_op_builds`).

Called where a run can first reach DeepSpeed: the trainer's import, the command line's entry, a config's device
set-up (`DistillationConfig._setup_devices`, where DeepSpeed's process group starts) and `testing.launch` (whose
ranks inherit the environment). `import trl_distill` does neither."""

from __future__ import annotations

from .build_locks import prepare_op_builds
from .quiet import quiet_unactionable_warnings

_done: list[bool] = []


def prepare_process() -> None:
    """Both, once per process (a later call does nothing)."""
    if _done:
        return
    _done.append(True)
    quiet_unactionable_warnings()
    prepare_op_builds()
