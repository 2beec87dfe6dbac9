"""2 processes: how much each rank's memory grows while `zero3_loading.load_partitioned` builds and fills a ZeRO-3
teacher, against the bytes it keeps (its partitions). Writes ``<out>/rank<k>.json``.

    load_memory_worker.py <model dir> <out> [broadcast]   # "broadcast": DeepSpeed's own zero.Init, for contrast
"""

import os
import sys

import torch

import trl_distill  # noqa: F401  (DeepSpeed on CPU)
from trl_distill import compat
from trl_distill.teacher.zero3_loading import load_partitioned
from trl_distill.testing import write_rank_record


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def main():
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    directory, out = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3:  # the stock zero.Init: every rank receives each module whole from rank 0
        compat._unbroadcast_init = lambda: deepspeed.zero.Init
    deepspeed.init_distributed(dist_backend="gloo")
    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})  # noqa: F841
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    model = load_partitioned(directory, {"dtype": torch.float32})
    peak = status("VmHWM")
    params = list(model.parameters())
    record = {
        "growth": peak - before,
        "held": sum(p.ds_tensor.numel() * p.element_size() for p in params),
        "total": sum(p.ds_numel * p.element_size() for p in params),
        "largest": max(p.ds_numel * p.element_size() for p in params),
        "checksum": sum(float(p.ds_tensor.double().sum()) for p in params),
    }
    write_rank_record(out, int(os.environ["RANK"]), record)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
