"""`benchmarks/trainer_worker.py` (one timed training run) with the GPU's peak memory added to each rank's record:
``record["cuda"]`` holds `torch.cuda.max_memory_allocated` / `max_memory_reserved` and the device's name (absent on
a machine without CUDA, as in ``run.sh --cpu-dry-run``).

    train_worker.py '<spec JSON>'     # under python (one process) or torchrun
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: trainer_worker, _common, memory_probe

import torch  # noqa: E402
import trainer_worker  # noqa: E402

_write = trainer_worker.write_rank_record


def write_with_gpu_memory(directory, rank: int, record: dict):
    if torch.cuda.is_available():
        record["cuda"] = {"device": torch.cuda.get_device_name(), "max_allocated": torch.cuda.max_memory_allocated(),
                          "max_reserved": torch.cuda.max_memory_reserved()}  # fmt: skip
    return _write(directory, rank, record)


trainer_worker.write_rank_record = write_with_gpu_memory  # main() writes its record through this name

if __name__ == "__main__":
    trainer_worker.main()
