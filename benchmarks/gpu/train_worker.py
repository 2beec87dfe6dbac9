"""`benchmarks/trainer_worker.py` (one timed training run) with the GPU's peak memory added to each rank's record:
``record["cuda"]`` holds `torch.cuda.max_memory_allocated` / `max_memory_reserved` and the device's name (absent on
a machine without CUDA, as in ``run.sh --cpu-dry-run``).

    train_worker.py '<spec JSON>'     # under python (one process) or torchrun

With ``GPU_BENCH_GATE=PATH`` in its environment it says so as it starts, and waits until PATH exists where its
contender is about to start its GPU work (`trainer_worker.gpu_turn`: after building a `DistillationTrainer`, before
building GKD's), having imported what that work needs; after writing its record it writes ``row_done`` beside it.
`runner.py` starts the next row this way while a row runs, and creates PATH once that row's ``row_done`` is there, so
no two rows compute on the GPU at once.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

# Imported before the gate opens. DeepSpeed's ZeRO optimizer check imports its Muon optimizer, whose torch.compile
# decorators import torch._dynamo (~1.5 s) inside train().
PRELOAD = ["deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer"]
PRELOAD_BY_TRAINER = {"cache_write": ["trl_distill.cli.cache_teacher", "trl_distill.cli.train", "trl_distill.trainer"],
                      "gkd": ["trl.experimental.gkd"]}
GATE_WAIT_S = 3600  # a gate never opened: give up rather than wait forever (and when gpu_bench.py is gone)

spec = json.loads(sys.argv[1])
gate = os.environ.get("GPU_BENCH_GATE")
print(f"train_worker: {spec['trainer']} rank {os.environ.get('RANK', '0')} pid {os.getpid()} started"
      + (", its GPU work waits for its turn" if gate else ""), flush=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: trainer_worker, _common, memory_probe

import torch  # noqa: E402
import trainer_worker  # noqa: E402

_write = trainer_worker.write_rank_record


def write_with_gpu_memory(directory, rank: int, record: dict):
    if torch.cuda.is_available():
        record["cuda"] = {"device": torch.cuda.get_device_name(), "max_allocated": torch.cuda.max_memory_allocated(),
                          "max_reserved": torch.cuda.max_memory_reserved()}  # fmt: skip
    path = _write(directory, rank, record)
    (Path(directory) / "row_done").touch()  # the GPU work is done: gpu_bench.py lets the next row start its own
    return path


def wait_for_gate() -> None:
    for name in PRELOAD + PRELOAD_BY_TRAINER.get(spec["trainer"], []):
        try:
            importlib.import_module(name)
        except ImportError:  # another version's layout: imported after the gate instead
            pass
    deadline, owner = time.monotonic() + GATE_WAIT_S, int(os.environ.get("GPU_BENCH_PID", "0"))
    while not os.path.exists(gate):
        if time.monotonic() > deadline or (owner and not _alive(owner)):
            sys.exit(f"train_worker: the gate {gate} did not open (gpu_bench.py gone, or {GATE_WAIT_S} s passed)")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


trainer_worker.write_rank_record = write_with_gpu_memory  # main() writes its record through this name
if gate:
    trainer_worker.gpu_turn = wait_for_gate  # the contenders call it through this name

if __name__ == "__main__":
    trainer_worker.main()
