"""Runs the GPU run's training rows, each a fresh process (`train_worker.py` under ``python`` or ``torchrun
--nproc_per_node 1``), one at a time on the GPU, within a timeout each and the run's deadline.

While a row runs, the next one is started: it imports and builds what it can on the host, then waits at a gate (a
file, ``GPU_BENCH_GATE``) where its GPU work begins (`trainer_worker.gpu_turn`), which is created once the row before
has exited; so no two rows compute on the GPU at once, and each row's start-up (the interpreter's imports: about a
third of a row's wall time on the first GPU run) overlaps the row before. A row's wall time and timeout count from its
gate; a waiting row leaves when gpu_bench.py is gone (``GPU_BENCH_PID``). A row that exits non-zero, or runs past
its timeout (then its whole process tree is killed), fails with the last lines of its output (stdout and stderr, in
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


@dataclass
class Started:
    """A row's process, started and waiting at its gate."""

    name: str
    proc: subprocess.Popen
    gate: Path
    log: Path
    out: Path
    spawned: float


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


def finish(started: Started, timeout_s: float, limit: str = "--row_timeout_s") -> dict:
    """Open the row's gate and wait for it: ``{"wall_s", "process_s"}`` and its record, or ``"error"`` and
    ``"tail"`` (its output's last lines). `limit`: what set `timeout_s`, for the error."""
    started.gate.touch()
    t0 = time.perf_counter()
    try:
        code = started.proc.wait(timeout=max(timeout_s, 0.0))
        error = f"exit status {code}" if code else None
    except subprocess.TimeoutExpired:
        stop(started)
        error = f"timed out after {timeout_s:.0f} s ({limit}); killed"
    times = {"wall_s": time.perf_counter() - t0, "process_s": time.perf_counter() - started.spawned}
    if error is None:
        try:
            return {**times, "record": json.loads((started.out / "rank0.json").read_text())}
        except (OSError, ValueError) as problem:
            error = f"exit status 0 but no record: {problem}"
    return {**times, "error": error, "tail": tail(started.log)}


def run_rows(rows: list[tuple[str, str, str | None]], make_spec, timeout_of, deadline: float, work: Path,
             report) -> dict:
    """Run `rows` (name, launcher, the row it needs first or None) in order; `make_spec(name, out)` gives a row's
    spec, `timeout_of(name)` its timeout, `deadline` (a `time.perf_counter` value) when rows end: none starts after
    it, a running one is stopped there. `report(name, result)` is called as each row ends; returns name -> result."""
    results: dict = {}
    upcoming = None

    def launch(index: int):
        if index >= len(rows):
            return None
        name, launcher, _ = rows[index]
        return start(name, make_spec(name, work / name / "out"), launcher, work)

    try:
        upcoming = launch(0)
        for index, (name, _, needs) in enumerate(rows):
            current, upcoming = upcoming, None
            left = deadline - time.perf_counter()
            if needs and "error" in results.get(needs, {}):
                result = {"error": f"not run: it reads what {needs} writes, and {needs} failed", "tail": ""}
            elif left <= 0:
                result = {"error": "not run: the run's deadline (--deadline_s) had passed", "tail": ""}
            else:
                upcoming = launch(index + 1)  # its start-up overlaps this row; it waits at its gate
                own = timeout_of(name)
                result = finish(current, min(own, left), "--row_timeout_s" if own <= left else "the run's --deadline_s")
            if "error" in result:
                stop(current)
            results[name] = result
            report(name, result)
            if upcoming is None:
                upcoming = launch(index + 1)
    finally:
        if upcoming is not None:
            stop(upcoming)
    return results
