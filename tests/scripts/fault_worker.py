"""One rank of `trl-distill` (the command line's own `main`, its error boundaries and all) whose process meets a fault
of its own: ``fault_worker.py FAULT STEP RANK RECORD -- CLI ARGS``, where FAULT is ``stop`` (the rank sends itself
SIGSTOP: frozen) or ``interrupt`` (SIGINT: Ctrl-C), at the end of optimizer step STEP on rank RANK, after writing the
time of the fault to RECORD (a JSON file).

`start_ranks` starts the ranks of a run as a launcher does (RANK, WORLD_SIZE, MASTER_ADDR/PORT), each with its own
stdout and stderr files and exit status, so that a test reads what every rank printed and how it left, with no
launcher stopping the others for it; one process is plain `python -m trl_distill`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).resolve()


@dataclass
class Rank:
    process: subprocess.Popen
    stdout: Path
    stderr: Path
    started: float
    ended: float | None = None

    @property
    def err(self) -> str:
        return self.stderr.read_text()

    @property
    def out(self) -> str:
        return self.stdout.read_text()

    def poll(self) -> int | None:
        code = self.process.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
        return code


def start_ranks(cli_args: list[str], logs: Path, nproc: int = 1, fault: tuple[str, int, int, Path] | None = None,
                env: dict | None = None) -> list[Rank]:
    """Start `nproc` ranks of ``trl-distill CLI_ARGS`` (through this worker when `fault` is given), logging to
    ``LOGS/rank<k>.{out,err}``."""
    from trl_distill.runtime.distributed import free_port

    logs.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
            **(env or {})}
    if nproc > 1:
        base.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()))
    head = [sys.executable, "-m", "trl_distill"]
    if fault is not None:
        kind, step, rank, record = fault
        head = [sys.executable, str(WORKER), kind, str(step), str(rank), str(record), "--"]
    ranks = []
    for k in range(nproc):
        rank_env = {**base, "RANK": str(k), "LOCAL_RANK": str(k)} if nproc > 1 else base
        out, err = logs / f"rank{k}.out", logs / f"rank{k}.err"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            process = subprocess.Popen([*head, *cli_args], env=rank_env, stdout=stdout, stderr=stderr,
                                       start_new_session=True)
        ranks.append(Rank(process, out, err, time.monotonic()))
    return ranks


def wait_ranks(ranks: list[Rank], timeout: float) -> list[int | None]:
    """Each rank's exit status once all have exited, or None for those still running after `timeout` s."""
    deadline = time.monotonic() + timeout
    while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [rank.poll() for rank in ranks]


def stop_ranks(ranks: list[Rank]) -> None:
    """SIGKILL what is left of the ranks (and anything they started), frozen ones included."""
    from trl_distill.testing import kill_tree

    for rank in ranks:
        if rank.process.poll() is None:
            kill_tree(rank.process.pid)
            rank.process.wait()


def main() -> None:
    kind, step, rank, record = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cli_args = sys.argv[sys.argv.index("--") + 1:]
    how = {"stop": signal.SIGSTOP, "interrupt": signal.SIGINT}[kind]
    # Ctrl-C as at a terminal: a process started in the background by a non-interactive shell (CI) inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler of its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from transformers import TrainerCallback

    from trl_distill.cli import main as trl_distill
    from trl_distill.cli import train

    class Fault(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step and int(os.environ.get("RANK", "0")) == rank:
                Path(record).write_text(json.dumps({"kind": kind, "step": step, "time": time.monotonic()}))
                os.kill(os.getpid(), how)

    build = train.build_trainer

    def with_fault(*args):
        trainer = build(*args)
        trainer.add_callback(Fault())
        return trainer

    train.build_trainer = with_fault
    trl_distill(cli_args)


if __name__ == "__main__":
    main()
