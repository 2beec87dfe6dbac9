"""Silence the messages a user can do nothing about, at their source, once, when trl_distill is imported.

- DeepSpeed picks its accelerator at import and, on a machine without GPU, warns "Setting accelerator to CPU. If you
  have GPU ... we were unable to detect it." Telling it the answer (``DS_ACCELERATOR=cpu``, its own variable) when
  torch sees no CUDA or XPU device picks the same accelerator without the warning; a value the user set is kept.
- torch 2.13 deprecates `torch.distributed.all_gather_into_tensor`, which DeepSpeed 0.19.8's ZeRO-3 gathers call on
  every step: one FutureWarning per rank the user cannot act on. Only that message is filtered.
- transformers 5.24 renamed `is_gradient_checkpointing`, which peft 0.21 reads whenever it wraps a LoRA student.
"""

from __future__ import annotations

import os
import warnings


def quiet_unactionable_warnings() -> None:
    from .distributed import has_accelerator

    if not has_accelerator():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for message in (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                    r"`is_gradient_checkpointing` is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
