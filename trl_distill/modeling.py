"""What the loss needs from a causal LM: its last hidden states, its lm_head, and how it scales logits."""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass

import torch
from torch import nn

_PATCHED = "_trl_distill_forward"


def add_fused_distillation_forward(model: nn.Module) -> None:
    """Let `model(..., fused_distillation=fn)` return ``fn(last_hidden_state, model)`` instead of logits.

    The backbone runs as usual and `fn` projects through the lm_head itself (a chunk of completion rows at a
    time), so no ``[B, T, V]`` logits are built. Because `fn` runs *inside* the model's forward, a DeepSpeed
    engine's forward hooks (ZeRO-3 gathers, timers) wrap it as they wrap a normal forward. Without the keyword the
    forward is unchanged (generation, evaluation with logits). Patch the `PreTrainedModel`, before any PEFT
    wrapping or `accelerator.prepare`; patching twice is a no-op.
    """
    if getattr(model, _PATCHED, False):
        return
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_distillation=None, **kwargs):
        if fused_distillation is None:
            return original_forward(*args, **kwargs)
        for key in ("labels", "shift_labels", "num_items_in_batch", "fused_lm_head"):
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        return fused_distillation(hidden, self)

    model.forward = types.MethodType(forward, model)
    setattr(model, _PATCHED, True)


@dataclass(frozen=True)
class LMHead:
    """An lm_head's parameters and the logit transform its config applies after the projection."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    logit_scale: float | None
    softcap: float | None

    @classmethod
    def of(cls, model: nn.Module) -> LMHead:
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear) and not hasattr(head, "weight"):
            raise ValueError(f"{type(model).__name__} has no linear lm_head; it cannot be distilled.")
        config = model.config.get_text_config()
        scale = getattr(config, "logit_scale", None)
        if scale is None and getattr(config, "logits_scaling", None):
            scale = 1.0 / config.logits_scaling  # Granite divides its logits
        return cls(head.weight, getattr(head, "bias", None), scale, getattr(config, "final_logit_softcapping", None))


def _is_partitioned(param: torch.Tensor | None) -> bool:
    # DeepSpeed's per-parameter ZeRO-3 attributes (`ds_id`, `ds_status`); checked against deepspeed 0.19.8
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param is not None and hasattr(param, "ds_id") and param.ds_status != ZeroParamStatus.AVAILABLE


def gathered(*params: torch.Tensor | None):
    """Gather the ZeRO-3 partitioned ones among `params` for the duration of the block (read-only).

    Decided per parameter (by its DeepSpeed attributes), not by the global ZeRO-3 flag: the teacher is ZeRO-3
    while the student, whose plugin is the selected one, may not be.
    """
    unique = {id(p): p for p in params if _is_partitioned(p)}
    if not unique:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(unique.values()))


def hidden_size(config) -> int:
    """The width of a model's last hidden state, read from its (text) config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("hidden_size", "d_model", "n_embd"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError(f"Cannot find the hidden size in {type(config).__name__}; set the DeepSpeed bucket sizes by hand.")
