"""What the loss needs from a causal LM: its last hidden states and its lm_head (the fused path), or its own logits at
the loss positions (the exact path)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..compat import is_zero3_partitioned

_PATCHED = "_trl_distill_forward"
_EXACT = "_trl_distill_exact_logits"  # set by `use_exact_logits`: the model's own forward makes the logits
_BACKBONE_NAMES = ("model", "transformer", "language_model", "decoder", "gpt_neox")


class LossFeatures(NamedTuple):
    """What a model hands the loss for the kept positions.

    ``states`` ``[B, K, F]``: the last hidden states (``F`` = hidden size) that ``head`` projects to logits, or, when
    ``head`` is None, the model's own logits (``F`` = vocabulary), for an architecture whose head the fused path does
    not rebuild exactly (see `trl_distill.model.logit_check`).
    """

    states: torch.Tensor
    head: LMHead | None
    aux_loss: torch.Tensor | None = None
    """A Mixture-of-Experts model's router load-balancing loss from the same forward (unweighted, as its own forward
    returns it), when asked for with ``output_router_logits=True``; else None."""


def add_fused_distillation_forward(model: nn.Module) -> None:
    """Let `model(..., fused_distillation=fn, loss_positions=idx)` return ``fn(LossFeatures)`` instead of logits.

    On the fused path (the default) the backbone runs as usual and `fn` projects its last hidden states through the
    lm_head itself (a chunk of completion rows at a time), so no ``[B, T, V]`` logits are built. On the exact path
    (`use_exact_logits`) the model's own forward computes the logits at `loss_positions` only
    (``logits_to_keep``). `loss_positions` (1-D, sorted) keeps those sequence positions; None keeps all. Because `fn`
    runs *inside* the model's forward, a DeepSpeed engine's forward hooks (ZeRO-3 gathers, timers) wrap it as they
    wrap a normal forward. Without the keyword the forward is unchanged (generation, evaluation with logits). Patch
    the `PreTrainedModel`, before any PEFT wrapping or `accelerate.prepare`; patching twice is a no-op. With
    ``output_router_logits=True`` (a Mixture-of-Experts model) the features carry the router's load-balancing loss
    of the same forward (`router_aux_loss`).
    """
    if getattr(model, _PATCHED, False):
        return
    original_forward = model.forward
    takes_positions = "logits_to_keep" in inspect.signature(type(model).forward).parameters

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_distillation=None, loss_positions=None, **kwargs):
        if fused_distillation is None:
            return original_forward(*args, **kwargs)
        for key in ("labels", "shift_labels", "num_items_in_batch", "fused_lm_head", "logits_to_keep"):
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        routed = kwargs.pop("output_router_logits", False)
        if hasattr(self.config.get_text_config(), "output_router_logits"):  # an MoE model: its router's logits
            kwargs["output_router_logits"] = routed  # only when asked (its config may say so for other callers)
        if getattr(self, _EXACT, False):
            if takes_positions and loss_positions is not None:
                kwargs["logits_to_keep"] = loss_positions
            outputs = original_forward(*args, **kwargs)
            logits = outputs.logits
            if not takes_positions and loss_positions is not None:
                logits = logits[:, loss_positions]
            return fused_distillation(LossFeatures(logits, None, outputs.aux_loss if routed else None))
        head = LMHead.of(self)  # before any compute: a model we cannot rebuild fails here, not mid-forward
        unshard_if_fsdp2(self.get_output_embeddings())
        outputs = backbone(self)(*args, **kwargs)
        hidden = outputs.last_hidden_state
        if loss_positions is not None:
            hidden = hidden[:, loss_positions]
        aux = router_aux_loss(self, outputs.router_logits, kwargs.get("attention_mask")) if routed else None
        return fused_distillation(LossFeatures(hidden, head, aux))

    model.forward = types.MethodType(forward, model)
    setattr(model, _PATCHED, True)


def unshard_if_fsdp2(module: nn.Module) -> None:
    """Gather an lm_head that FSDP2 shards in a group of its own (accelerate 1.15 carves ``[final norm, lm_head]``
    out of the root, and only the lm_head when it finds no final norm, as for a PEFT model): FSDP2 gathers a group
    when one of its modules is called, and the fused path reads the weight without calling the lm_head. Its
    gradient is reduce-scattered after the backward as for any group whose forward did not run (torch 2.13's
    final post-backward callback)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module.unshard()


def router_aux_loss(model: nn.Module, router_logits, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The router load-balancing loss a Mixture-of-Experts causal LM's own forward computes from its backbone's
    router logits: its module's `load_balancing_loss_func` with the expert count, top-k and attention mask it passes
    (transformers 5.24; `moe_aux_refusal` says first which models cannot, and tests hold it to the model's own
    `aux_loss`)."""
    module = sys.modules[own_class(model).__module__]
    return module.load_balancing_loss_func(router_logits, model.num_experts, model.num_experts_per_tok,
                                           attention_mask)


def own_class(model: nn.Module) -> type:
    """The model's own class: the one FSDP2's `fully_shard` derives the class of a sharded module from
    (``FSDP<name>``, defined in torch's module, not the model's)."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def moe_aux_refusal(model: nn.Module) -> str | None:
    """Why `router_aux_loss` cannot take `model`'s load-balancing loss from its backbone (None: it can)."""
    module = sys.modules[own_class(model).__module__]
    missing = [name for name in ("num_experts", "num_experts_per_tok") if not hasattr(model, name)]
    if not hasattr(module, "load_balancing_loss_func") or missing:
        return (f"{type(model).__name__} computes no router load-balancing loss the distillation loss can take from "
                "its forward (transformers' own `load_balancing_loss_func` with its expert count and top-k): set "
                "router_aux_loss_coef=0.0 to distil it without one.")
    return None


def use_exact_logits(model: nn.Module, exact: bool = True) -> None:
    """Make the patched forward of `model` return its own logits (``exact=True``) or its last hidden states."""
    setattr(model, _EXACT, exact)


def backbone(model: nn.Module) -> nn.Module:
    """The module under a causal LM that returns its last hidden states (``.last_hidden_state``).

    `base_model` where the model names it; otherwise the first of the usual attribute names (`model`,
    `transformer`, ...) that holds a module: Llama-4's text model, for one, is not at `base_model`.
    """
    base = getattr(model, "base_model", model)
    if base is not model:
        return base
    for name in _BACKBONE_NAMES:
        child = getattr(model, name, None)
        if isinstance(child, nn.Module) and child is not model:
            return child
    raise ValueError(f"Cannot find the backbone of {type(model).__name__}: none of base_model, "
                     f"{', '.join(_BACKBONE_NAMES)} holds it.")


class LMHead:
    """An lm_head's parameters and the logit transform its config applies after the projection.

    Read from the config names the mainstream families use; `trl_distill.model.logit_check` proves, per model, that
    `logits` equals the model's own logits before training relies on it. One made by `of` reads its weight and bias
    from the model's output layer when they are used, not when it is made: under ZeRO-3, touching a partitioned
    parameter inside a module's forward gathers it there and ties it to that module's every later forward
    (DeepSpeed's external parameters, 0.19.8), so a teacher's head is read after its forward, where the loss
    gathers it once.
    """

    __slots__ = ("_weight", "_bias", "_module", "logit_scale", "softcap")

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, logit_scale: float | None = None,
                 softcap: float | None = None, module: nn.Linear | None = None):
        self._weight, self._bias, self._module = weight, bias, module
        self.logit_scale, self.softcap = logit_scale, softcap

    @property
    def weight(self) -> torch.Tensor:
        return self._weight if self._module is None else self._module.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias if self._module is None else getattr(self._module, "bias", None)

    @classmethod
    def of(cls, model: nn.Module) -> LMHead:
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
            raise ValueError(f"{type(model).__name__}'s output layer ({type(head).__name__}) is not a plain linear "
                             "projection.")
        extra = [name for name, _ in head.named_parameters() if name not in ("weight", "bias")]
        if extra:  # e.g. a learned per-token scale
            raise ValueError(f"{type(model).__name__}'s lm_head has parameters of its own ({', '.join(extra)}).")
        config = model.config.get_text_config()
        scale = getattr(config, "logit_scale", None)
        if scale is None and getattr(config, "logits_scaling", None):
            scale = 1.0 / config.logits_scaling  # Granite divides its logits
        if scale is None and getattr(config, "lm_head_multiplier", None) is not None:
            scale = config.lm_head_multiplier
        return cls(None, None, scale, getattr(config, "final_logit_softcapping", None), module=head)

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """The head's tensors (for `gathered`)."""
        return (self.weight,) if self.bias is None else (self.weight, self.bias)

    def whole(self) -> LMHead:
        """This head with FSDP2-sharded weights gathered whole (collective: every rank calls it); itself when they
        are not sharded (read where the model leaves its head sharded after a forward, as the logit check does)."""
        if not hasattr(self.weight, "full_tensor"):
            return self
        bias = self.bias.full_tensor() if self.bias is not None else None
        return LMHead(self.weight.full_tensor(), bias, self.logit_scale, self.softcap)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[..., H]`` -> logits ``[..., V]`` in >= fp32: projection, then scale and softcap."""
        raw = F.linear(hidden, self.weight, self.bias)
        return finalise_logits(raw.to(torch.promote_types(raw.dtype, torch.float32)), self.logit_scale, self.softcap)


def features_only(features: LossFeatures) -> LossFeatures:
    """The hook that has the fused forward hand back its features untouched (a teacher's forward)."""
    return features


def finalise_logits(logits: torch.Tensor, scale: float | None, softcap: float | None) -> torch.Tensor:
    """Apply a model's logit scale (multiply) and final-logit softcapping ``c·tanh(x / c)``."""
    if scale is not None:
        logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def gathered(*params: torch.Tensor | None):
    """Gather the ZeRO-3 partitioned ones among `params` for the duration of the block (read-only).

    Decided per parameter (by its DeepSpeed attributes), not by the global ZeRO-3 flag: the teacher is ZeRO-3
    while the student, whose plugin is the selected one, may not be.
    """
    unique = {id(p): p for p in params if is_zero3_partitioned(p)}
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
