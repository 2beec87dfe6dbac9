"""Runs the GPU run's training rows, each a fresh process (`train_worker.py` under ``python`` or ``torchrun
--nproc_per_node 1``), one at a time on the GPU, within a timeout each and the run's deadline.

While a row runs, the next one is started: it imports and builds what it can on the host, then waits at a gate (a
file, ``GPU_BENCH_GATE``) where its GPU work begins (`trainer_worker.gpu_turn`). The gate opens once the row before
has written its record (its GPU work done; ``row_done`` in its output folder), and that row's exit (tearing down its
process group and CUDA context) is awaited meanwhile; so no two rows compute on the GPU at once, and a row's start-up
(imports, torchrun, building its trainer: about a third of a row's wall time on the first GPU run) and the exit of the
row before are off the clock. A row's wall time and timeout count from its gate; a waiting row leaves when
gpu_bench.py is gone (``GPU_BENCH_PID``). A row that exits non-zero (before or after its record), or runs past its
timeout (then its whole process tree is killed), fails with the last lines of its output (stdout and stderr, in
``<work>/<row>/log.txt``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "train_worker.py"
TAIL_LINES = 40
DONE = "row_done"  # written by train_worker.py into the row's output folder once its record is
POLL_S = 0.05
EXIT_GRACE_S = 60  # a row's exit after its record (tearing down its process group and CUDA context)


@dataclass
class Started:
    """A row's process, started and waiting at its gate."""

    name: str
    proc: subprocess.Popen
    gate: Path
    log: Path
    out: Path
    spawned: float
    opened: float = 0.0  # when its gate opened


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a row's log (at most 6000 characters), up to torchrun's line saying its rank failed
    (after it, torchrun's own traceback, the same for every failure)."""
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    end = next((i + 1 for i, line in enumerate(text) if "failed (exitcode:" in line), len(text))
    return "\n".join(text[:end][-lines:])[-6000:]


def start(name: str, spec: dict, launcher: str, work: Path) -> Started:
    from trl_distill.runtime.distributed import free_port

    directory = work / name
    directory.mkdir(parents=True, exist_ok=True)
    gate, log = directory / "gate", directory / "log.txt"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
           "GPU_BENCH_GATE": str(gate), "GPU_BENCH_PID": str(os.getpid()),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}  # fmt: skip
    cmd = [sys.executable, str(WORKER), json.dumps(spec)]
    if launcher == "torchrun":  # one rank, on loopback, as `trl_distill.testing.launch` runs it
        env["OMP_NUM_THREADS"] = "1"
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                    f"--master_port={free_port()}"]  # fmt: skip
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
    return Started(name, proc, gate, log, Path(spec["out"]), time.perf_counter())


def stop(started: Started) -> None:
    from trl_distill.testing import kill_tree

    if started.proc.poll() is None:
        kill_tree(started.proc.pid)
    started.proc.wait()


def failed(started: Started, error: str) -> dict:
    return {"wall_s": time.perf_counter() - started.opened, "process_s": time.perf_counter() - started.spawned,
            "error": error, "tail": tail(started.log)}


def open_gate(started: Started) -> None:
    started.gate.touch()
    started.opened = time.perf_counter()


def wait_row(started: Started, timeout_s: float, limit: str) -> dict:
    """Wait, from its gate's opening, until the row's GPU work is done (its record written: `DONE` in its output
    folder), it exits, or `timeout_s` passes (then it is killed; `limit` names what set the timeout). ``{"wall_s",
    "process_s", "record"}``, or ``"error"`` and ``"tail"`` (its output's last lines)."""
    while not (started.out / DONE).exists():
        code = started.proc.poll()
        if code is not None and not (started.out / DONE).exists():
            return failed(started, f"exit status {code}" + ("" if code else " without writing its record"))
        if code is None and time.perf_counter() - started.opened > timeout_s:
            stop(started)
            return failed(started, f"timed out after {timeout_s:.0f} s ({limit}); killed")
        time.sleep(POLL_S)
    return {"wall_s": time.perf_counter() - started.opened, "process_s": time.perf_counter() - started.spawned,
            "record": json.loads((started.out / "rank0.json").read_text())}


def settle(started: Started, result: dict) -> dict:
    """`result` once the row's process has exited (`EXIT_GRACE_S` after its record): an error (its figures
    dropped) when it exits non-zero or not at all (then it is killed)."""
    try:
        code = started.proc.wait(timeout=EXIT_GRACE_S)
    except subprocess.TimeoutExpired:
        stop(started)
        error = f"did not exit within {EXIT_GRACE_S} s of writing its record; killed"
    else:
        if not code:
            return result
        error = f"exit status {code} after writing its record"
    return {"wall_s": result["wall_s"], "process_s": result["process_s"], "error": error, "tail": tail(started.log)}


def run_rows(rows: list[tuple[str, str, str | None]], make_spec, timeout_of, deadline: float, work: Path,
             report) -> dict:
    """Run `rows` (name, launcher, the row it needs first or None) in order; `make_spec(name, out)` gives a row's
    spec, `timeout_of(name)` its timeout, `deadline` (a `time.perf_counter` value) when rows end: none starts after
    it, a running one is stopped there. A row's gate opens as soon as the row before has written its record; that
    row's exit is awaited then. `report(name, result)` is called as each row ends; returns name -> result."""
    results: dict = {}
    upcoming = lingering = None  # the next row, waiting at its gate; a row with its record written, exit pending

    def launch(index: int):
        if index >= len(rows):
            return None
        name, launcher, _ = rows[index]
        return start(name, make_spec(name, work / name / "out"), launcher, work)

    def end(name: str, result: dict) -> None:
        results[name] = result
        report(name, result)

    def settle_lingering() -> None:
        nonlocal lingering
        if lingering is not None:
            end(lingering[0].name, settle(*lingering))
            lingering = None

    try:
        upcoming = launch(0)
        for index, (name, _, needs) in enumerate(rows):
            current, upcoming = upcoming, None
            left = deadline - time.perf_counter()
            if needs:  # what it reads is complete once the row it needs has exited
                settle_lingering()
            if needs and "error" in results.get(needs, {"error": "not run"}):
                result = {"error": f"not run: it reads what {needs} writes, and {needs} failed", "tail": ""}
            elif left <= 0:
                settle_lingering()
                result = {"error": "not run: the run's deadline (--deadline_s) had passed", "tail": ""}
            else:
                upcoming = launch(index + 1)  # its start-up overlaps this row; it waits at its gate
                open_gate(current)
                settle_lingering()  # the row before, tearing down beside this one's start
                own = timeout_of(name)
                result = wait_row(current, min(own, left), "--row_timeout_s" if own <= left else
                                  "the run's --deadline_s")  # fmt: skip
            if "error" in result:
                stop(current)
                end(name, result)
            else:
                lingering = (current, result)
            if upcoming is None:
                upcoming = launch(index + 1)
        settle_lingering()
    finally:
        for started in (upcoming, lingering[0] if lingering else None):
            if started is not None:
                stop(started)
    return results
