"""The test session's shared ranks: one `torchrun` launch of 2 processes that runs, one after another, the 2-process
jobs that `trl_distill.testing.launch` would each have launched on their own (`tests/scripts/rank_pool_worker.py`).

A launch costs two interpreters importing torch, transformers, DeepSpeed and trl_distill (about 10 s each on this
machine) and a gloo rendezvous before a few seconds of training; the pool pays that once. A job keeps what a launch
gives a test: its exit status, both ranks' output, `RuntimeError` on a failure and `subprocess.TimeoutExpired` past
its timeout. A job that hangs or kills a rank ends the pool, as torchrun ends the other ranks; so does a failed job
after which the process group no longer carries a barrier and an all-reduce, and a job that changed a library's state
that the ranks cannot put back. The next job then starts new ranks: a failure names its own test and hides no other.
Tests that kill or freeze a rank on purpose launch on their own (``launch(..., own_launch=True)``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from build_lock import plant_stale_build_lock, private_build_root

from trl_distill.runtime.build_locks import build_root, describe_locks
from trl_distill.runtime.distributed import free_port
from trl_distill.testing import kill_tree

WORKER = Path(__file__).parent / "scripts" / "rank_pool_worker.py"
POLL_S = 0.02
START_TIMEOUT_S = 300
GRACE_S = 10  # after one rank failed, how long the other may take to finish on its own before it is stopped
CHECK_TIMEOUT_S = 30


class RankPool:
    """`nproc` ranks started on the first job and kept for the next ones; `close` stops them."""

    def __init__(self, nproc: int = 2, plant_stale_lock: bool = False):
        """With `plant_stale_lock`, the ranks build DeepSpeed's CPU op in a directory of the pool's own (seeded with
        this environment's ops), where the first start finds a stale build lock (`build_lock.plant_stale_build_lock`),
        as a killed first launch leaves it; `planted` is its path and `first_start_output` what the ranks wrote
        before they were ready."""
        self.nproc, self.proc, self.dir, self.next_job = nproc, None, None, 0
        self.plant_stale_lock, self.planted, self.first_start_output = plant_stale_lock, None, None
        self.extensions = None  # the ranks' TORCH_EXTENSIONS_DIR, with plant_stale_lock
        self.launches = 0  # how many times ranks were started: one, unless a job failed
        self.jobs, self.restarts = 0, []  # jobs run; why ranks were stopped before the end (job, reason)

    def accepts(self, nproc: int, launcher: str, launcher_args: tuple[str, ...]) -> bool:
        return nproc == self.nproc and launcher == "torchrun" and launcher_args in ((), ("-m",))

    def _start(self, env: dict[str, str]) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)  # the stopped ranks' jobs: their tests have read them
        self.dir = Path(tempfile.mkdtemp(prefix="rank_pool_"))
        if self.plant_stale_lock:
            if self.extensions is None:
                self.extensions = private_build_root(Path(tempfile.mkdtemp(prefix="rank_pool_extensions_")))
                self.planted = plant_stale_build_lock(self.extensions)
            env = {**env, "TORCH_EXTENSIONS_DIR": str(self.extensions)}
        (self.dir / "launch_env.json").write_text(json.dumps(env))
        (self.dir / "owner").write_text(str(os.getpid()))  # the ranks leave when this process is gone
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={self.nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(WORKER), str(self.dir)]
        self.log = open(self.dir / "pool.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.launches, self.next_job = self.launches + 1, 0
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all((self.dir / f"ready.rank{r}").exists() for r in range(self.nproc)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                waiting = self._starting_ranks_stacks()
                log = (self.dir / "pool.log").read_text()[-8000:]
                locks = "\n".join(describe_locks(Path(env.get("TORCH_EXTENSIONS_DIR") or build_root()))) or "none"
                self.close()
                raise RuntimeError(f"the shared ranks did not start within {START_TIMEOUT_S} s; {waiting}; build locks "
                                   f"where they build DeepSpeed's ops: {locks}\n{log}")
            time.sleep(0.1)
        if self.launches == 1:
            self.first_start_output = (self.dir / "pool.log").read_text()

    def close(self) -> None:
        """Stop the ranks (a job in flight too). With RANK_POOL_LOG set, append what they ran to that file."""
        if os.environ.get("RANK_POOL_LOG"):
            with open(os.environ["RANK_POOL_LOG"], "a") as log:
                log.write(json.dumps({"jobs": self.jobs, "launches": self.launches, "restarts": self.restarts}) + "\n")
        if self.proc is not None:
            if self.proc.poll() is None:
                (self.dir / "stop").touch()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    kill_tree(self.proc.pid)
                    self.proc.wait()
            self.log.close()
        self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self.extensions is not None:
            shutil.rmtree(self.extensions, ignore_errors=True)
            self.extensions = None

    def _kill(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
            self.proc.wait()
            self.log.close()
        self.proc = None

    def _outputs(self, n: int) -> str:
        parts = []
        for rank in range(self.nproc):
            path = self.dir / f"job-{n}.rank{rank}.out"
            parts.append(path.read_text(errors="replace") if path.exists() else "")
        return "".join(parts)

    def _done(self, n: int) -> dict[int, dict]:
        done = {}
        for rank in range(self.nproc):
            path = self.dir / f"job-{n}.rank{rank}.json"
            if path.exists():
                done[rank] = json.loads(path.read_text())
        return done

    def _starting_ranks_stacks(self) -> str:
        """Ask the ranks that did not get ready for their stacks (in the pool's log); says how many were asked."""
        import psutil

        try:
            ranks = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return "torchrun had exited"
        for rank in ranks:
            try:
                rank.send_signal(signal.SIGUSR1)
            except psutil.NoSuchProcess:
                pass
        time.sleep(1)
        return f"the stacks of the {len(ranks)} ranks still starting are at the end of their log below"

    def _dump_stacks(self) -> None:
        """Ask each rank for its threads' stacks (into the job's output), before it is stopped."""
        for rank in range(self.nproc):
            try:
                os.kill(int((self.dir / f"ready.rank{rank}").read_text()), signal.SIGUSR1)
            except (OSError, ValueError):
                pass
        time.sleep(1)

    def _submit(self, job: dict) -> int:
        n = self.next_job
        self.next_job += 1
        tmp = self.dir / f"job-{n}.tmp"
        tmp.write_text(json.dumps(job))
        tmp.rename(self.dir / f"job-{n}.json")
        return n

    def _wait(self, n: int, timeout: float, cmd: list[str], what: str) -> dict[int, dict]:
        """Every rank's report of job `n` (fewer when a rank died or was stopped: then the ranks are stopped)."""
        deadline, failed_at = time.monotonic() + timeout, None
        while True:
            done = self._done(n)
            if len(done) == self.nproc:
                return done
            if failed_at is None and any(d["returncode"] != 0 for d in done.values()):
                failed_at = time.monotonic()
            alive = self.proc.poll() is None
            if not alive or (failed_at is not None and time.monotonic() - failed_at > GRACE_S):
                self.restarts.append((what, "a rank died" if not alive else "a rank failed, another did not"))
                self._kill()  # a rank died, or one failed and the others did not follow: as torchrun ends them
                return done
            if time.monotonic() > deadline:
                self.restarts.append((what, "timed out"))
                self._dump_stacks()
                output = self._outputs(n)
                self._kill()
                raise subprocess.TimeoutExpired(cmd, timeout, output=output)
            time.sleep(POLL_S)

    def _group_answers(self) -> bool:
        """After a failed job that every rank finished: whether the process group still carries a barrier and an
        all-reduce (a rank may have left a collective half done). If not, the ranks are stopped."""
        n = self._submit({"check": True})
        try:
            done = self._wait(n, CHECK_TIMEOUT_S, ["group check"], "group check")
        except subprocess.TimeoutExpired:
            return False
        return len(done) == self.nproc and all(d["returncode"] == 0 for d in done.values())

    def run(self, cmd: list[str], target: str, args: list[str], module: bool, env: dict[str, str],
            cwd: str | os.PathLike | None, timeout: float) -> subprocess.CompletedProcess:
        """Run one job on every rank; what `launch` returns for it."""
        if self.proc is None or self.proc.poll() is not None:
            self._kill()
            self._start(dict(os.environ))
        self.jobs += 1
        n = self._submit({"target": target, "args": list(args), "module": module, "env": env,
                          "cwd": str(cwd or os.getcwd())})
        done = self._wait(n, timeout, cmd, target)
        out = self._outputs(n)
        codes = [d["returncode"] for d in done.values()] + [-signal.SIGKILL] * (self.nproc - len(done))
        returncode = next((code for code in codes if code != 0), 0)  # a rank's own status before a stopped one's
        if self.proc is not None:
            unfit = [line for line in out.splitlines() if line.startswith("rank_pool_worker:")]
            if not all(d.get("fit", True) for d in done.values()):
                self.restarts.append((target, "unfit: " + " ".join(unfit)[:300]))
                self._kill()  # a job that changed what cannot be put back: new ranks for the next
            elif returncode != 0 and not self._group_answers():
                self.restarts.append((target, f"exit {returncode}, then the group did not answer"))
                self._kill()
        if returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed with exit code {returncode} (shared ranks, job {n}):\n"
                               f"{out[-8000:]}")
        return subprocess.CompletedProcess(cmd, 0, out, "")
