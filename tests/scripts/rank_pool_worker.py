"""One rank of the test session's shared ranks (`tests/rank_pool.py`): started once by torchrun, it runs the jobs that
`trl_distill.testing.launch` hands it, one after another, each as ``torchrun`` would have run it on its own.

    rank_pool_worker.py POOL_DIR

A job is ``POOL_DIR/job-<n>.json`` (a script path or ``-m`` module, its arguments, the environment, the directory);
this rank runs it with its output in ``job-<n>.rank<r>.out`` and writes ``job-<n>.rank<r>.json`` (its exit status and
seconds). Between jobs it puts back what a job may have changed in this process: the environment, the directory,
`sys.argv` and `sys.path`, the attributes of trl_distill's modules and classes (a worker that wraps a function),
accelerate's state, transformers' DeepSpeed flag, log levels, warning filters, torch's default dtype, grad mode and
seed; what a job registered with `atexit` runs at its end, as at a process's exit. The process group (gloo, started
before the first job as DeepSpeed on CPU starts it) serves every job. A job that changed a library's global state that
is not put back here (`WATCHED_MODULES`), and a failed job, leave the ranks unfit: the pytest side starts new ones.
"""

import atexit
import datetime
import faulthandler
import gc
import importlib
import json
import logging
import os
import pkgutil
import runpy
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

# What every job imports anyway: paid once per pool, not once per job
import datasets  # noqa: F401
import deepspeed  # noqa: F401
import deepspeed.runtime.sequence_parallel.parallel_state_sp  # noqa: F401  (its groups are watched from the start)
import peft  # noqa: F401
import requests  # noqa: F401
import torch
import torch.distributed
import transformers
import transformers.integrations.deepspeed as hf_deepspeed
import trl  # noqa: F401
from accelerate.state import AcceleratorState
from trl import SFTTrainer  # noqa: F401

import trl_distill  # noqa: F401
from trl_distill import testing  # noqa: F401
from trl_distill.runtime import distributed
from trl_distill.runtime.process_setup import prepare_process

POLL_S = 0.02
OWN_MODULES = ("trl_distill",)
# Libraries whose module globals a job may change in ways we do not put back (a registry, a process subgroup): a
# job that changed one leaves this process unfit, and the pytest side starts new ranks for the next job
WATCHED_MODULES = ("transformers", "accelerate", "deepspeed", "trl", "peft", "datasets")
# Caches filled on first use, the same for every job (datasets re-imports its builder modules)
SAME_FOR_EVERY_JOB = ("deepspeed.utils.groups._WORLD_GROUP", "transformers.utils.hub._hf_api",
                      "transformers.conversion_mapping._checkpoint_conversion_mapping_cache",
                      "datasets.packaged_modules.")


def watched(name: str) -> bool:
    return any(name == library or name.startswith(library + ".") for library in WATCHED_MODULES)


def import_every_module_of_ours() -> None:
    """Every trl_distill module, imported before the snapshot: a job's change to one imported later would stay."""
    for info in pkgutil.walk_packages(trl_distill.__path__, "trl_distill."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)


def snapshot_modules() -> dict:
    """The attributes of every module of ours and of every class defined in one (a job may wrap a function)."""
    saved = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(OWN_MODULES):
            continue
        saved[module] = dict(vars(module))
        for value in list(vars(module).values()):
            if isinstance(value, type) and getattr(value, "__module__", "") == name:
                saved[value] = dict(vars(value))
    return saved


def restore_modules(saved: dict) -> None:
    for owner, attributes in saved.items():
        current = vars(owner)
        for key in [k for k in current if k not in attributes]:
            if key not in ("__dict__", "__weakref__"):
                try:
                    delattr(owner, key)
                except (AttributeError, TypeError):
                    pass
        for key, value in attributes.items():
            if current.get(key, object()) is not value:
                try:
                    setattr(owner, key, value)
                except (AttributeError, TypeError):
                    pass


def watched_globals() -> dict:
    """``{(module name, attribute): id}`` of the watched libraries' module globals, and the attention registry's
    entries. A sequence-parallel trainer puts back what it changed as its training ends (the registry's entry and
    DeepSpeed's sequence groups, `runtime.sequence_parallel.SequenceParallelScope`); a job that leaves either changed
    ends its ranks (a data-parallel run after it would exchange attention and average over the wrong group)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen = {}
    for name, module in list(sys.modules.items()):
        if module is not None and watched(name):
            for key, value in list(vars(module).items()):
                if not isinstance(value, type(sys)):  # a submodule bound on first use is no change
                    seen[(name, key)] = id(value)
    for key, value in type(ALL_ATTENTION_FUNCTIONS)._global_mapping.items():
        seen[("ALL_ATTENTION_FUNCTIONS", key)] = id(value)
    for key, value in ALL_ATTENTION_FUNCTIONS._local_mapping.items():
        seen[("ALL_ATTENTION_FUNCTIONS.local", key)] = id(value)
    return seen


def changed_globals(before: dict) -> list[str]:
    """What a job changed of `watched_globals` (added names are lazy caches, except in the attention registry)."""
    after = watched_globals()
    changed = [f"{m}.{k}" for (m, k), v in before.items()
               if after.get((m, k), v) != v and not f"{m}.{k}".startswith(SAME_FOR_EVERY_JOB)]
    return changed + [f"{m}[{k!r}] added" for (m, k) in after if m.startswith("ALL_ATTENTION") and (m, k) not in before]


def log_levels() -> dict:
    manager = logging.Logger.manager
    loggers = [logging.getLogger()] + [v for v in manager.loggerDict.values() if isinstance(v, logging.Logger)]
    return {logger: (logger.level, list(logger.handlers), logger.propagate, logger.disabled) for logger in loggers}


def restore_log_levels(saved: dict) -> None:
    for logger, (level, handlers, propagate, disabled) in saved.items():
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate, logger.disabled = propagate, disabled


class Process:
    """What a job may change in this process, saved once the imports are done and put back after each job."""

    def __init__(self, launch_env: dict):
        # torchrun's own variables (RANK, MASTER_PORT, TORCHELASTIC_*...): kept under every job's environment
        self.launcher_env = {k: v for k, v in os.environ.items() if launch_env.get(k) != v}
        self.cwd, self.argv, self.path = os.getcwd(), list(sys.argv), list(sys.path)
        import_every_module_of_ours()
        self.modules = snapshot_modules()
        self.globals = watched_globals()
        self.logs = log_levels()
        self.transformers_verbosity = transformers.logging.get_verbosity()
        self.warnings = list(warnings.filters)
        self.dtype = torch.get_default_dtype()
        self.seed = torch.initial_seed()

    def enter(self, job: dict) -> None:
        self.globals = watched_globals()
        distributed._exit["failed"] = False  # (a failed job before this one noted it for the exit)
        os.environ.clear()
        os.environ.update({**job["env"], **self.launcher_env})
        os.chdir(job["cwd"])
        torch.manual_seed(self.seed)  # a new process's default generator
        torch.set_grad_enabled(True)

    def leave(self) -> bool:
        """Put back what the job changed; False when it changed what cannot be put back (see `WATCHED_MODULES`)."""
        AcceleratorState._reset_state(reset_partial_state=True)
        hf_deepspeed.unset_hf_deepspeed_config()
        restore_modules(self.modules)
        restore_log_levels(self.logs)
        transformers.logging.set_verbosity(self.transformers_verbosity)
        warnings.filters[:] = self.warnings
        torch.set_default_dtype(self.dtype)
        sys.argv[:], sys.path[:] = self.argv, self.path
        os.chdir(self.cwd)
        gc.collect()
        changed = changed_globals(self.globals)
        if changed:
            print(f"rank_pool_worker: this job changed {', '.join(changed)}: new ranks for the next job",
                  file=sys.stderr)
        return not changed


class ExitHandlers:
    """`atexit.register` during a job: the job's handlers run at its end, as they would at its process's exit; the
    process group's teardown is registered for real (the pool's own exit)."""

    def __init__(self):
        self.handlers, self.register = [], atexit.register

    def __enter__(self):
        def register(function, *args, **kwargs):
            if function is distributed.teardown_process_group:
                return self.register(function, *args, **kwargs)
            self.handlers.append((function, args, kwargs))
            return function

        atexit.register = register
        return self

    def __exit__(self, *exc):
        atexit.register = self.register
        for function, args, kwargs in reversed(self.handlers):
            try:
                function(*args, **kwargs)
            except Exception:
                traceback.print_exc()


def group_answers() -> int:
    """The pool's check after a failed job: a barrier (that names a missing rank) and an all-reduce, within 20 s."""
    try:
        torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=20))
        total = torch.ones(1)
        torch.distributed.all_reduce(total)
        return 0 if total.item() == torch.distributed.get_world_size() else 1
    except Exception:
        traceback.print_exc()
        return 1


def run_job(job: dict) -> int:
    """Run one job as its own process would; its exit status."""
    target = job["target"]
    if job["module"]:
        sys.argv[:] = [target, *job["args"]]
        sys.path.insert(0, job["cwd"])
        run = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        sys.argv[:] = [target, *job["args"]]
        sys.path.insert(0, str(Path(target).parent))
        run = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
    try:
        with ExitHandlers():
            run()
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports it (torch's hook prefixes "[rank<r>]: ")
        return 1


class Output:
    """This rank's stdout and stderr (the file descriptors: native libraries' output too) into one file."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        sys.stdout.flush(), sys.stderr.flush()
        self.file = open(self.path, "wb")
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(self.file.fileno(), 1), os.dup2(self.file.fileno(), 2)

    def __exit__(self, *exc):
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(self.saved[0], 1), os.dup2(self.saved[1], 2)
        for fd in self.saved:
            os.close(fd)
        self.file.close()


def keep_process_group(*args, **kwargs) -> None:
    """A job's `destroy_process_group` (a worker tidying up before its exit) leaves the pool's group up."""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def report(pool: Path, n: int, rank: int, done: dict) -> None:
    tmp = pool / f"job-{n}.rank{rank}.tmp"
    tmp.write_text(json.dumps(done))
    tmp.rename(pool / f"job-{n}.rank{rank}.json")


def main() -> None:
    pool = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the pytest side asks for the stacks of a hung job
    prepare_process()  # as a run's device set-up does before its process group builds DeepSpeed's op (a stale lock)
    # The process group every job of this pool shares, as PartialState(backend="gloo") starts it for DeepSpeed on CPU
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    process = Process(json.loads((pool / "launch_env.json").read_text()))
    owner = int((pool / "owner").read_text())
    torch.distributed.destroy_process_group = keep_process_group
    (pool / f"ready.rank{rank}").write_text(str(os.getpid()))
    n = 0
    while True:
        job_file = pool / f"job-{n}.json"
        waited = 0
        while not job_file.exists():
            if (pool / "stop").exists() or (waited % 50 == 0 and not alive(owner)):
                return  # stopped, or the pytest process that owns these ranks is gone (killed, or interrupted twice)
            time.sleep(POLL_S)
            waited += 1
        job = json.loads(job_file.read_text())
        start = time.monotonic()
        if job.get("check"):
            report(pool, n, rank, {"returncode": group_answers(), "fit": True, "seconds": time.monotonic() - start})
            n += 1
            continue
        process.enter(job)
        with Output(pool / f"job-{n}.rank{rank}.out"):
            status = run_job(job)
            try:
                fit = process.leave()
            except Exception:  # this process may not be fit for the next job: the pytest side starts new ranks
                traceback.print_exc()
                fit = False
        report(pool, n, rank, {"returncode": status, "fit": fit, "seconds": time.monotonic() - start})
        n += 1


if __name__ == "__main__":
    main()
