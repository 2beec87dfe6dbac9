"""`trl-distill build-ops`: build now the op DeepSpeed compiles the first time a process starts its process group, so
that no launch waits on it. On CPU that is its shared-memory collectives, `deepspeed_shm_comm` (about half a minute
on 2 cores), which the first launch of an environment otherwise builds while every rank waits. `make setup` runs it.

The op is the one DeepSpeed's own process group loads (its `TorchBackend` asks the accelerator for a
``ShareMemCommBuilder`` and loads it when compatible), asked for here the same way, through DeepSpeed's public
op-builder API, and built where that process group would build it: this environment's directory
(`runtime.build_locks`), or the ``TORCH_EXTENSIONS_DIR`` the user set. An accelerator without such an op builds none."""

from __future__ import annotations

import argparse
import time

COMM_OP_BUILDER = "ShareMemCommBuilder"  # the builder DeepSpeed's TorchBackend asks its accelerator for


def build_comm_op() -> str:
    """Build (or find up to date) DeepSpeed's comm op for this machine's accelerator; one line saying what is ready
    and where."""
    from ..runtime.process_setup import prepare_process

    prepare_process()  # DeepSpeed told its accelerator, this environment's build directory, a stale lock removed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    builder = accelerator.create_op_builder(COMM_OP_BUILDER)
    if builder is None or not builder.is_compatible():
        return f"DeepSpeed's {accelerator.device_name()} accelerator loads no comm op here: nothing to build"
    start = time.monotonic()
    module = builder.load()
    return f"DeepSpeed's {builder.NAME} op is ready ({time.monotonic() - start:.0f} s): {module.__file__}"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="trl-distill build-ops", description=(
        "Build the op DeepSpeed compiles when a process group first starts (on CPU: deepspeed_shm_comm) now, in "
        "this environment's build directory, so that the first launch does not wait on it."))
    parser.parse_args(argv)
    print(build_comm_op())
