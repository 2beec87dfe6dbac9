"""The planner's arithmetic for Mixture-of-Experts models: what a rank holds counts every expert (the total
parameters), what a token computes only the experts it is routed to (the active parameters), and ZeRO-3 gathers an
MoE layer's experts whole (one fused tensor per projection: the largest leaf module, `plan.zero3_gathered`)."""

from __future__ import annotations

from dataclasses import dataclass

EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
ROUTED_PER_TOKEN = ("num_experts_per_tok", "moe_k", "moe_topk")


@dataclass(frozen=True)
class MoeShape:
    """A Mixture-of-Experts model as the planner counts it."""

    experts: int
    experts_per_token: int
    moe_layers: int  # layers whose MLP is routed (the others are dense)
    expert_params: int  # every routed expert's parameters, all layers
    active_params: int  # parameters one token computes with: all but the experts it is not routed to
    active_intermediate: int  # MLP width one token's activations go through in an MoE layer: k experts + shared


def first_set(config, names: tuple[str, ...]) -> int:
    values = [getattr(config, name, None) for name in names]
    value = next((v for v in values if isinstance(v, int) and v > 0), 0)
    return value


def moe_shape(config, model) -> MoeShape | None:
    """`model` (built on the meta device from `config`) as an MoE: its routed experts are the modules transformers
    names ``*Experts``; None for a dense model."""
    text = config.get_text_config()
    experts, routed = first_set(text, EXPERT_COUNTS), first_set(text, ROUTED_PER_TOKEN)
    modules = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    if not experts or not routed or not modules:
        return None
    expert_params = sum(p.numel() for m in modules for p in m.parameters())
    total = sum(p.numel() for p in model.parameters())
    width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    shared = (getattr(text, "shared_expert_intermediate_size", None)
              or (getattr(text, "n_shared_experts", None) or 0) * width)
    return MoeShape(experts=experts, experts_per_token=routed, moe_layers=len(modules), expert_params=expert_params,
                    active_params=total - expert_params + expert_params * routed // experts,
                    active_intermediate=routed * width + shared)


def activation_intermediate(intermediate: int, layers: int, moe: MoeShape | None) -> float:
    """The MLP width a token's saved activations go through, averaged over the layers: an MoE layer's `k` routed
    experts (and shared ones) instead of the dense width, plus its router's logits."""
    if moe is None:
        return intermediate
    routed = moe.active_intermediate + moe.experts / 4  # (4 intermediates per width in `layer_activations`)
    return (moe.moe_layers * routed + (layers - moe.moe_layers) * intermediate) / layers
