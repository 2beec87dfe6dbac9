"""Precision that fits the machine: bf16 where the hardware runs it, fp32 (with one warning) where it does not.

`trl.SFTConfig` defaults to ``bf16=True``, which transformers refuses on a machine without a GPU unless
``use_cpu=True``. A user who writes the README's example on a laptop or a CPU server passes neither, so we decide
for them: on a machine without an accelerator the Trainer's CPU path is taken (``use_cpu=True``, which also turns
off `dataloader_pin_memory`), with bf16 when the CPU computes it natively and fp32 otherwise. An explicit
``bf16=True`` / ``fp16=True`` that the machine cannot run is one clear error naming the flag.
"""

from __future__ import annotations

import logging
import platform

from ..compat import cpu_has_bf16_units
from ..runtime.distributed import has_accelerator

logger = logging.getLogger(__name__)


def cpu_supports_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86: AVX512-BF16 or AMX; Arm: the ``bf16`` feature).

    Elsewhere torch emulates bf16 on the CPU, several times slower than fp32. The x86 probe is
    `compat.cpu_has_bf16_units` (torch's private CPU feature checks).
    """
    from transformers.utils import is_torch_bf16_available_on_device

    if not is_torch_bf16_available_on_device("cpu"):
        return False
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        return cpu_has_bf16_units()
    if machine in ("aarch64", "arm64"):
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                return any(line.startswith("Features") and " bf16" in line for line in f)
        except OSError:
            return False
    return False


def settle_precision(args) -> None:
    """Choose `bf16` / `fp16` / `use_cpu` on `args` (a `TrainingArguments` before its `__post_init__`).

    With a GPU nothing changes (`SFTConfig` then defaults to bf16). Without one: ``use_cpu=True`` and, when no
    precision flag was given (``bf16 is None``), bf16 if `cpu_supports_bf16()` else fp32 with one warning. An
    explicit ``bf16=True`` on a CPU without bf16, or ``fp16=True`` without a GPU, raises `ValueError`.
    """
    if has_accelerator():
        return
    args.use_cpu = True
    if args.fp16 or args.fp16_full_eval:
        raise ValueError(
            "fp16=True needs a GPU, and this machine has none. Drop --fp16 (precision is then bf16 where this CPU "
            "supports it, else fp32), or pass --bf16 false for fp32."
        )
    supported = cpu_supports_bf16()
    if args.bf16 is None:
        args.bf16 = supported
        if not supported:
            logger.warning("No GPU, and this CPU has no native bf16: training in fp32 (bf16=False).")
        return
    if (args.bf16 or args.bf16_full_eval) and not supported:
        raise ValueError(
            "bf16=True, but this machine has no GPU and its CPU does not compute bf16 natively. Pass --bf16 false "
            "(bf16=False) to train in fp32, or leave bf16 unset to let trl_distill choose."
        )
