"""Make DeepSpeed (and DDP) work on machines without a GPU, with no setup code from the user.

On a CPU-only machine accelerate's `PartialState` picks no backend for DeepSpeed, so the state says one process
while torch.distributed has several, and the Trainer fails its batch-size check. `TrainingArguments` ignores
`ddp_backend` on its DeepSpeed branch. The fix (checked against transformers 5.24 / accelerate 1.15): create the
`PartialState` ourselves with the gloo backend before `TrainingArguments` sets up its devices, and tell it to use
that configured state, created with `ddp_timeout` (without it a frozen rank would block the others for DeepSpeed's
default 10 minutes, whatever `--ddp_timeout` says).

At exit the group is torn down; after an error (`note_failure`, which the command line's boundaries call) without
the barrier, which would only wait for peers that are gone or stuck. `peer_failure` turns the errors a collective
raises when a peer stops answering or goes away into one `errors.PeerLostError` line, and `first_failure` lets the
ranks agree on a fault one of them met, so that all stop with its message.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import re
import socket
import sys

import torch
from accelerate import PartialState
from accelerate.utils import gather_object, str_to_bool

from ..compat import partial_state_fields, reset_accelerate_state
from ..errors import PeerLostError

_exit = {"failed": False}  # set by `note_failure`: the process is leaving on an error, or its group is broken


def free_port() -> int:
    """An unused TCP port on loopback, for a torch.distributed rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deepspeed_requested(args) -> bool:
    return bool(getattr(args, "deepspeed", None)) or str_to_bool(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false"))


def has_accelerator() -> bool:
    """A CUDA (or ROCm) or XPU device is visible."""
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


# Set by launchers that describe the processes their own way (DeepSpeed's MPI discovery reads them): several
# processes there are not ours to describe
_OTHER_LAUNCHERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def _set_single_process_env() -> None:
    """`python script.py` with DeepSpeed: DeepSpeed needs a process group even for one process."""
    if "WORLD_SIZE" not in os.environ and all(os.environ.get(name, "1") == "1" for name in _OTHER_LAUNCHERS):
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())),
        )


@contextlib.contextmanager
def _deepspeed_env():
    """`ACCELERATE_USE_DEEPSPEED=true` while the block runs (what makes accelerate's `PartialState` start DeepSpeed's
    process group), then as it was: transformers sets it the same way, for that call only."""
    previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = previous


def note_failure() -> None:
    """This process is leaving on an error (or its group is broken): tear the group down at exit without waiting
    for the others, who are gone, stuck, or leaving on the same error."""
    _exit["failed"] = True


def teardown_process_group() -> None:
    """Tear the gloo group down at exit. Without this a CPU run aborts at interpreter exit (-6, "terminate called
    without an active exception"). After a clean run a rank that gets there first waits (30 s at most) for the
    others, so none tears down while a peer still talks to it; after an error (`note_failure`) it does not wait."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if not _exit["failed"]:
        with contextlib.suppress(Exception):  # a peer already gone: tear down anyway
            torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


_destroy_registered = []


def _destroy_at_exit() -> None:
    """Register `teardown_process_group` once per process, whoever created the group (a stock `TrainingArguments`
    built before ours, accelerate, or us)."""
    if not _destroy_registered:
        atexit.register(teardown_process_group)
        previous = sys.excepthook

        def note_and_report(*exc_info):  # an uncaught exception outside the command line's boundaries
            note_failure()
            previous(*exc_info)

        sys.excepthook = note_and_report
        _destroy_registered.append(True)


def _forget_single_process_state() -> None:
    """A stock `TrainingArguments` built before ours (a `Trainer` script handed to `DistillationTrainer`) left a
    backend-less one-process state on a multi-process launch; it holds no process group, so forget it and build
    the gloo one."""
    state = partial_state_fields()
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if state and state.get("backend") is None and state.get("num_processes", 1) != launched:
        reset_accelerate_state()


def prepare_cpu_distributed_state(args) -> None:
    """Make DeepSpeed train on every launched process of a machine without GPU: set up a gloo `PartialState` and
    point `args` at it (`use_configured_state`). Call as its devices are set up (`DistillationConfig._setup_devices`
    does). With a GPU, see below; without DeepSpeed only the teardown at exit is registered (DDP on CPU is the Trainer's
    own `use_cpu=True` path, which `precision.settle_precision` takes on such a machine).

    DeepSpeed needs this even with `use_cpu=True`: the Trainer's CPU branch would leave DeepSpeed's process group
    uninitialised until the first engine, so a teacher loaded under `zero.Init` would see a world size of 1.

    With a GPU only the one-process case is ours: `python train.py` with DeepSpeed and no launcher gets the
    environment of a one-process group (transformers leaves it to a launcher, and DeepSpeed's ``env://`` set-up
    would fail on the missing RANK); NCCL and the Trainer's own device set-up do the rest.
    """
    if has_accelerator():
        if _deepspeed_requested(args):
            _set_single_process_env()
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _destroy_at_exit()  # any CPU group, DDP's (gloo) too, is torn down at exit: else it may abort (-6) there
    if not _deepspeed_requested(args):
        return
    _set_single_process_env()
    _forget_single_process_state()
    if not partial_state_fields():
        with _deepspeed_env():
            PartialState(backend="gloo", timeout=datetime.timedelta(seconds=args.ddp_timeout))
    _destroy_at_exit()
    accelerator_config = args.accelerator_config
    if accelerator_config is None:
        args.accelerator_config = {"use_configured_state": True}
    elif isinstance(accelerator_config, dict):
        args.accelerator_config = {**accelerator_config, "use_configured_state": True}  # the caller's dict untouched
    elif isinstance(accelerator_config, str):
        return  # a JSON file: the user configures the state themselves
    else:  # the AcceleratorConfig that TrainingArguments built from the user's value
        accelerator_config.use_configured_state = True


def first_failure(message: str | None, accelerator) -> tuple[int, str] | None:
    """Call on every rank at the same point, with the fault this rank met there (None: none): ``(rank, message)``
    of the lowest rank that met one, or None. One scalar all-reduce; the messages are gathered only on a fault."""
    if accelerator.num_processes == 1:
        return None if message is None else (accelerator.process_index, message)
    flag = torch.tensor([0.0 if message is None else 1.0], device=accelerator.device)
    if accelerator.reduce(flag, reduction="sum").item() == 0:
        return None
    messages = gather_object([message])
    rank = next(r for r, m in enumerate(messages) if m is not None)
    return rank, messages[rank]


_TIMED_OUT = re.compile(r"Timed out waiting (\d+) ?ms|failed to pass monitoredBarrier in (\d+) ?ms|timed out after "
                        r"(\d+) ?ms", re.IGNORECASE)
_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
         "socket closed", "remote process exited")


def peer_failure(error: BaseException) -> PeerLostError | None:
    """The `PeerLostError` for an error a collective (gloo, the rendezvous store) raised because another process
    of the run stopped answering or went away; None for any other error (our bug, or not a peer's)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if isinstance(error, RuntimeError) and (timed_out := _TIMED_OUT.search(text)):
            return PeerLostError(_timed_out_message(int(next(g for g in timed_out.groups() if g)) / 1000))
        if isinstance(error, RuntimeError) and any(sign in text.lower() for sign in _LOST):
            detail = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0]  # less gloo's "[file.cc:123] " and advice
            return PeerLostError(f"Rank {_rank()} lost its connection to {_peers()} ({detail}): that process "
                                 "stopped, and its own message says why. Fix that, then resume from the last "
                                 "complete checkpoint with --resume_from_checkpoint true.")
        error = error.__cause__ or error.__context__
    return None


def _timed_out_message(seconds: float) -> str:
    return (f"Rank {_rank()} waited {seconds:g} s (--ddp_timeout) in a collective for {_peers()}, which stopped "
            "answering (frozen, killed, out of memory or far slower): see that process's output. If it is only "
            "slow, raise --ddp_timeout; the last complete checkpoint is kept (resume with --resume_from_checkpoint "
            "true).")


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _peers() -> str:
    """The other processes of the run, for a message: "rank 1" of two."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    others = [r for r in range(world) if r != _rank()]
    return f"rank {others[0]}" if len(others) == 1 else f"another of the {world} processes"
