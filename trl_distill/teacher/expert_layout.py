"""Where each parameter of a Mixture-of-Experts model lies in a checkpoint that stores its experts apart.

transformers builds an MoE layer's experts as one fused tensor per projection (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) while the published checkpoints (Mixtral, Qwen-MoE,
DeepSeek, OLMoE...) and `save_pretrained` keep one tensor per expert and projection; its loader converts them
(`conversion_mapping`: rename, then stack the experts, then concatenate gate and up). Stacking along the first
dimension and concatenating along the second leave every source tensor whole and contiguous in the fused tensor's
row-major layout: expert 0's gate, expert 0's up, expert 1's gate, ... So a fused parameter is a sequence of whole
checkpoint tensors, and a rank can read the bytes of its ZeRO-3 partition from them directly
(`zero3_loading.load_partitioned`). Any other conversion (a transpose, a split, another dimension) is not handled:
the caller falls back to `from_pretrained`.
"""

from __future__ import annotations

import math
import re

from ..compat import checkpoint_conversions

Segments = list[tuple[str, int]]
"""A parameter's flat layout: ``(checkpoint tensor name, element count)`` in order."""


def expert_layout(model_type: str, shapes: dict[str, tuple[int, ...]],
                  checkpoint: dict[str, tuple[int, ...]]) -> dict[str, Segments] | None:
    """Each parameter (`shapes`: name -> shape) as the checkpoint tensors (`checkpoint`: name -> shape) that fill it,
    in order, under transformers' conversion of `model_type`; None when some parameter cannot be laid out so (the
    conversion is another kind, a tensor is missing, a shape does not add up)."""
    conversions = checkpoint_conversions(model_type)
    if conversions is None:
        return None
    renames = [(sources, targets) for kind, sources, targets, _ in conversions if kind == "rename"]
    converts = [(sources, targets[0], ops) for kind, sources, targets, ops in conversions if kind == "convert"]
    if any(len(targets) != 1 for kind, _, targets, _ in conversions if kind == "convert"):
        return None
    pieces: dict[str, dict[int, dict[int, str]]] = {}  # fused parameter -> source index -> expert -> tensor name
    layout: dict[str, Segments] = {}
    for name, shape in checkpoint.items():
        renamed = name
        for sources, targets in renames:
            for source, target in zip(sources, targets, strict=False):
                renamed = re.sub(source, target, renamed)
        matched = False
        for sources, target, _ in converts:
            for k, source in enumerate(sources):
                found = re.search(re.escape(source).replace(r"\*", r"(\d+)") + "$", renamed)
                if found is not None:
                    fused = renamed[: found.start()] + target
                    pieces.setdefault(fused, {}).setdefault(k, {})[int(found.group(1))] = name
                    matched = True
        if not matched:
            layout[renamed] = [(name, math.prod(shape))]
    ops_of = {target: (len(sources), ops) for sources, target, ops in converts}
    for fused, by_source in pieces.items():
        target = next(t for t in ops_of if fused.endswith(t))
        count, ops = ops_of[target]
        if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
            return None
        experts = sorted(by_source.get(0, {}))
        if len(by_source) != count or any(sorted(by_source[k]) != experts for k in by_source) or \
                experts != list(range(len(experts))):
            return None
        layout[fused] = [(by_source[k][e], math.prod(checkpoint[by_source[k][e]]))
                         for e in experts for k in range(count)]
        first = [checkpoint[by_source[k][0]] for k in range(count)]
        if any(len(s) < 1 or s[1:] != first[0][1:] for s in first):
            return None
        if shapes.get(fused) != (len(experts), sum(s[0] for s in first), *first[0][1:]):
            return None
    if any(name not in layout or sum(n for _, n in layout[name]) != math.prod(shape) for name, shape in shapes.items()):
        return None
    return {name: layout[name] for name in shapes}
