"""The learning rates docs/on_policy.md recommends on the student's own samples, as the literature's on-policy
recipes use them: 1e-4 for a LoRA student, 5e-5 fully fine-tuned. Above them on-policy runs have ended below their
warm start (3e-3 in our own experiments; the sampled-token objective collapsed at 1e-3): one warning says so as the
run is built."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..run_plan import OnPolicyPlan

logger = logging.getLogger(__name__)

# the highest learning rate docs/on_policy.md recommends on the student's own samples, by how the student trains
ON_POLICY_LEARNING_RATE = {"LoRA": 1e-4, "full fine-tuning": 5e-5}


def rate(value: float) -> str:
    """A learning rate as the docs write it: ``1e-4``, ``5e-5``, ``2.5e-3``."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def learning_rate_warning(on_policy: OnPolicyPlan, learning_rate: float, lora: bool) -> str | None:
    """The one line for an on-policy run (``lmbda > 0``) whose `learning_rate` is above the recommendation for its
    kind of student (`lora`: a PEFT adapter trains), else None."""
    if not on_policy.lmbda > 0:
        return None
    kind = "LoRA" if lora else "full fine-tuning"
    limit = ON_POLICY_LEARNING_RATE[kind]
    if not learning_rate > limit:
        return None
    objective = f", {on_policy.objective} objective" if on_policy.objective != "divergence" else ""
    both = ", ".join(f"{name} {rate(bound)}" for name, bound in ON_POLICY_LEARNING_RATE.items())
    return (f"On-policy distillation (lmbda={on_policy.lmbda}{objective}) at learning_rate={rate(learning_rate)}, "
            f"above the {rate(limit)} docs/on_policy.md recommends for {kind} ({both}): faster runs have ended below "
            "their warm start or collapsed; lower --learning_rate.")


def warn_learning_rate(on_policy: OnPolicyPlan, learning_rate: float, lora: bool) -> None:
    """Log `learning_rate_warning`, if any (call on the main process only, once per run)."""
    line = learning_rate_warning(on_policy, learning_rate, lora)
    if line is not None:
        logger.warning(line)
