"""`trl-distill` (the CLI's own `main`) with a ZeRO-3 teacher whose safetensors lack a tensor, the up-front check
(`validation.check_weights_complete`) switched off, so that the partitioned loader (`teacher.zero3_loading`) meets the
gap itself on every rank. Each rank appends ``load_partitioned refused`` to stdout when that loader raised.

    torchrun --nproc_per_node 2 tests/scripts/missing_tensor_worker.py [training flags]
"""

import sys

import trl_distill.teacher.live as live

live.check_weights_complete = lambda directory, what: None  # as if the check had missed it
load = live.load_partitioned


def recording(*args, **kwargs):
    try:
        return load(*args, **kwargs)
    except Exception:
        print("load_partitioned refused", flush=True)
        raise


live.load_partitioned = recording

from trl_distill.cli import main  # noqa: E402

main(sys.argv[1:])
