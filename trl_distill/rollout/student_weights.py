"""The student's weights as the rollout engine loads them: Hugging Face checkpoint names, full tensors.

A plain or ZeRO-0/1/2 student holds each tensor whole. A ZeRO-3 student holds 1/N of each: a chunk of them is gathered
(collectively, on every rank) only while it is being sent. An FSDP2 student holds each as a DTensor: its `full_tensor()`
(collective too) is taken as the weight is built, one at a time. A LoRA student is sent merged, base weight plus each
active adapter's delta (`peft`'s `get_delta_weight`), computed beside the training weights, never folded into them (a
merge and unmerge in place would leave rounding in the weights being trained).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..compat import is_zero3_partitioned
from ..model.fused_forward import gathered
from ..runtime.fsdp2 import whole

PEFT_PREFIX = "base_model.model."


@dataclass
class StudentWeight:
    """One tensor the engine receives: its name, full shape and dtype, what must be gathered to build it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    params: tuple[torch.Tensor, ...]
    build: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.ds_shape) if is_zero3_partitioned(param) else tuple(param.shape)


def student_weights(model: torch.nn.Module) -> list[StudentWeight]:
    """Every tensor of `model` (the unwrapped student, PEFT or not) under its checkpoint name."""
    lora_layers = {}
    if hasattr(model, "get_base_model"):
        from peft.tuners.lora import LoraLayer

        lora_layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    weights = []
    for name, param in model.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue  # adapter factors are folded into their base weight; a saved module's copy is sent instead
        clean = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        owner = name.rsplit(".", 1)[0].removesuffix(".base_layer")
        layer = lora_layers.get(owner) if name.endswith(".base_layer.weight") else None
        if layer is None:
            weights.append(StudentWeight(clean, full_shape(param), param.dtype, (param,),
                                         lambda p=param: whole(p.detach())))
        else:
            factors = tuple(p for n, p in layer.named_parameters() if ".lora_" in f".{n}")
            weights.append(StudentWeight(clean, full_shape(param), param.dtype, (param, *factors),
                                         lambda p=param, m=layer: merged_weight(p, m)))
    return weights


def merged_weight(weight: torch.Tensor, layer) -> torch.Tensor:
    """`weight` plus the deltas of `layer`'s active, unmerged adapters (as `peft` would merge them); FSDP2's DTensors
    gathered whole (every rank computes the same deltas: collective)."""
    merged = whole(weight.detach()).clone()
    if not getattr(layer, "merged", False) and not getattr(layer, "disable_adapters", False):
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                merged += whole(layer.get_delta_weight(adapter)).to(merged.dtype)
    return merged


def chunks(weights: list[StudentWeight], max_bytes: int) -> list[list[StudentWeight]]:
    """Consecutive weights of one dtype, at most `max_bytes` a chunk (a bigger tensor is a chunk of its own)."""
    out: list[list[StudentWeight]] = []
    size = 0
    for weight in weights:
        if not out or out[-1][0].dtype != weight.dtype or size + weight.nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(weight)
        size += weight.nbytes
    return out


def flat_chunks(groups: list[list[StudentWeight]]) -> Iterator[torch.Tensor]:
    """Each chunk as one flat tensor; a ZeRO-3 chunk is gathered (collective: every rank iterates) meanwhile."""
    with torch.no_grad():
        for group in groups:
            with gathered(*(p for weight in group for p in weight.params)):
                yield torch.cat([weight.build().reshape(-1) for weight in group])
