"""Silence the messages a user can do nothing about, at their source, once (`process_setup.prepare_process`).

- DeepSpeed picks its accelerator at import and, on a machine without GPU, warns "Setting accelerator to CPU. If you
  have GPU ... we were unable to detect it." Telling it the answer (``DS_ACCELERATOR=cpu``, its own variable) when
  torch sees no CUDA or XPU device picks the same accelerator without the warning; a value the user set is kept.
- torch 2.13 deprecates `torch.distributed.all_gather_into_tensor`, which DeepSpeed 0.19.8's ZeRO-3 gathers call on
  every step: one FutureWarning per rank the user cannot act on. Only that message is filtered.
- transformers 5.24 renamed `is_gradient_checkpointing`, which peft 0.21 reads whenever it wraps a LoRA student.
- TRL 1.16's SFT preparation warns "The tokenized prompt is not a prefix of the tokenized prompt+completion ... This
  warning is shown once" once per distinct prompt ending (its `warning_once` caches the message, which quotes the
  ending): hundreds of times for prompts that end mid-word. The first is shown; the rest are counted
  (`PROMPT_NOT_A_PREFIX`) and `data.prepare.log_repeated_prompt_warning` says how many after the preparation.
"""

from __future__ import annotations

import logging
import os
import warnings


class RepeatedWarning(logging.Filter):
    """Let the first record holding `fragment` through and hold back the others, counting them all (`take`
    returns how many came, the first included, and starts again)."""

    def __init__(self, fragment: str):
        super().__init__()
        self.fragment, self.count = fragment, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.fragment not in record.getMessage():
            return True
        self.count += 1
        return self.count == 1

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


PROMPT_NOT_A_PREFIX = RepeatedWarning("This warning is shown once, but it likely applies to every")


def quiet_unactionable_warnings() -> None:
    from .distributed import has_accelerator

    if not has_accelerator():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for message in (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                    r"`is_gradient_checkpointing` is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    sft_logger = logging.getLogger("trl.trainer.sft_trainer")  # accelerate's adapter logs through this logger
    if PROMPT_NOT_A_PREFIX not in sft_logger.filters:
        sft_logger.addFilter(PROMPT_NOT_A_PREFIX)
