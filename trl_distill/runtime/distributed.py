"""Make DeepSpeed (and DDP) work on machines without a GPU, with no setup code from the user.

On a CPU-only machine accelerate's `PartialState` picks no backend for DeepSpeed, so the state says one process
while torch.distributed has several, and the Trainer fails its batch-size check. `TrainingArguments` ignores
`ddp_backend` on its DeepSpeed branch. The fix (checked against transformers 5.24 / accelerate 1.15): create the
`PartialState` ourselves with the gloo backend before `TrainingArguments` sets up its devices, and tell it to use
that configured state.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket

import torch
from accelerate import PartialState
from accelerate.utils import str_to_bool

from ..compat import partial_state_fields, reset_accelerate_state


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


def _set_single_process_env() -> None:
    """`python script.py` with DeepSpeed: DeepSpeed needs a process group even for one process."""
    if "WORLD_SIZE" not in os.environ:
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


def teardown_process_group() -> None:
    """Tear the gloo group down at exit, all ranks together. Without this a CPU run aborts at interpreter exit (-6,
    "terminate called without an active exception"); a rank that gets there first waits (30 s at most) for the others,
    so none tears down while a peer still talks to it."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    with contextlib.suppress(Exception):  # a peer already gone: tear down anyway
        torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    torch.distributed.destroy_process_group()


_destroy_registered = []


def _destroy_at_exit() -> None:
    """Register `teardown_process_group` once per process, whoever created the group (a stock `TrainingArguments`
    built before ours, accelerate, or us)."""
    if not _destroy_registered:
        atexit.register(teardown_process_group)
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
    does). A no-op with a GPU or without DeepSpeed: DDP on CPU is the Trainer's own `use_cpu=True` path, which
    `precision.settle_precision` takes on such a machine.

    DeepSpeed needs this even with `use_cpu=True`: the Trainer's CPU branch would leave DeepSpeed's process group
    uninitialised until the first engine, so a teacher loaded under `zero.Init` would see a world size of 1.
    """
    if has_accelerator() or not _deepspeed_requested(args):
        return
    _set_single_process_env()
    _forget_single_process_state()
    if not partial_state_fields():
        with _deepspeed_env():
            PartialState(backend="gloo")
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
