"""Prove, before training relies on it, that the fused path gives each model's own logits; else use the exact path.

The fused loss rebuilds a model's logits from its last hidden states and `LMHead` (the output embeddings plus the
scale and softcap its config names). Architectures that compute logits otherwise (a multiplier under another name,
a head module with its own learned scale, a prediction head before the decoder, a backbone we cannot find) would
get a silently wrong loss. So, once per run and per model, on the first batch's first row, the rebuilt logits are
compared with the model's own `forward(...).logits`. A model that fails, on any rank, uses the exact path from then
on: its own forward with ``logits_to_keep`` = the loss positions (see `modeling.add_fused_distillation_forward`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from .fused_forward import LossFeatures, gathered, use_exact_logits

logger = logging.getLogger(__name__)

PROBE_TOKENS = 64  # positions of the first row compared, per model


@dataclass
class LogitPath:
    """Which path a model's logits take, and the evidence: the largest difference seen between the rebuilt and
    the model's own logits (None when the fused path could not run at all) and the tolerance it was held to."""

    name: str
    exact: bool
    max_error: float | None
    tolerance: float
    positions: int
    reason: str = ""

    def describe(self, vocab: int, loss_tokens: int) -> str:
        checked = f"checked against {self.name}(...).logits on {self.positions} positions"
        if not self.exact:
            return (f"trl_distill: {self.name} logits: fused lm_head path ({checked}: max |diff| "
                    f"{self.max_error:.2e} <= {self.tolerance:.1e}).")
        why = self.reason or f"max |diff| {self.max_error:.3g} > {self.tolerance:.1e}"
        mib = loss_tokens * vocab * 4 / 2**20
        return (f"trl_distill: {self.name} logits: exact path, the model's own forward at the loss positions "
                f"(logits_to_keep), because the fused lm_head rebuild does not reproduce them ({checked}: {why}). "
                f"Cost: full-vocabulary logits for the kept positions, about {mib:.0f} MiB (fp32) for the first "
                "batch, instead of one chunk at a time; the result is exact.")


def probe_inputs(model_inputs: dict) -> dict:
    """The first row of a batch, its first `PROBE_TOKENS` positions (tensors shaped ``[B, T]`` only)."""
    length = model_inputs["input_ids"].shape[1]
    probe = {}
    for key, value in model_inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == length:
            probe[key] = value[:1, :PROBE_TOKENS]
    return probe


def _tolerance(own: torch.Tensor, half: bool) -> float:
    """Absolute tolerance: rounding of the same ops in another order or precision, relative to the logits' size."""
    rtol, atol = (2e-2, 1e-3) if half else (1e-4, 1e-5)
    return atol + rtol * own.abs().max().item()


def _features(features: LossFeatures) -> LossFeatures:
    return features


def _rebuilt(features: LossFeatures) -> torch.Tensor:
    with gathered(*features.head.params):
        return features.head.whole().logits(features.states).float()


@torch.no_grad()
def check_fused_logits(name: str, call, module: nn.Module, inputs: dict, mixed_precision: bool = False) -> LogitPath:
    """Compare, on `inputs`, ``call(..., fused_distillation=...)`` rebuilt logits with ``call(...).logits``.

    `call` runs the model as training does (a DeepSpeed engine, a DDP or PEFT wrapper, or `module` itself; every
    rank must call this under ZeRO-3); `module` is the patched `PreTrainedModel`, put in eval mode for the probe.
    Half-precision weights or ``mixed_precision`` (autocast) hold the comparison to half-precision rounding.
    """
    use_exact_logits(module, False)
    was_training = module.training
    module.eval()
    try:
        # The fused forward first: under ZeRO-3 the first forward records the prefetch trace, and a model that calls
        # its lm_head after a trace without it just re-records; the other order has the lm_head in flight while the
        # rebuild gathers it (deepspeed 0.19.8).
        try:
            # rebuilt after the forward, as the loss does: the lm_head is gathered for the rebuild, outside it
            rebuilt = _rebuilt(call(**inputs, fused_distillation=_features))
        except (AttributeError, ValueError, TypeError) as error:
            rebuilt = error
        own = call(**inputs, use_cache=False).logits.float()
    finally:
        module.train(was_training)
    half = mixed_precision or next(module.parameters()).dtype not in (torch.float32, torch.float64)
    tolerance, positions = _tolerance(own, half), own.shape[1]
    if isinstance(rebuilt, Exception):
        return LogitPath(name, True, None, tolerance, positions, f"the rebuild fails: {rebuilt}")
    if rebuilt.shape != own.shape:
        return LogitPath(name, True, None, tolerance, positions,
                         f"rebuilt logits {tuple(rebuilt.shape)} vs {tuple(own.shape)}")
    error = (rebuilt - own).abs().max().nan_to_num(float("inf")).item()
    return LogitPath(name, not error <= tolerance, error, tolerance, positions)


def settle_logit_paths(candidates: list[tuple[str, object, nn.Module]], inputs: dict, accelerator,
                       mixed_precision: bool = False) -> list[LogitPath]:
    """Check each ``(name, call, module)`` and set its path; a model that fails on any rank is exact on all
    (the paths gather differently under ZeRO-3, so every rank must take the same one)."""
    paths = [check_fused_logits(name, call, module, inputs, mixed_precision) for name, call, module in candidates]
    failed = torch.tensor([float(p.exact) for p in paths], device=inputs["input_ids"].device)
    if accelerator.num_processes > 1:
        failed = accelerator.reduce(failed, reduction="sum")
    for path, count, (_, _, module) in zip(paths, failed.tolist(), candidates, strict=True):
        if count > 0 and not path.exact:
            path.exact, path.reason = True, "the rebuild differs on another rank"
        use_exact_logits(module, path.exact)
    return paths


def settle_logit_paths_by_inputs(candidates: list[tuple[str, object, nn.Module, dict]], accelerator,
                                 mixed_precision: bool = False) -> list[LogitPath]:
    """`settle_logit_paths` for ``(name, call, module, inputs)``: the models that read the same inputs are checked
    together, on a probe of them (a teacher with another tokenizer on its own ids)."""
    groups: dict[int, tuple[dict, list]] = {}
    for name, call, module, inputs in candidates:
        groups.setdefault(id(inputs), (inputs, []))[1].append((name, call, module))
    return [path for inputs, group in groups.values()
            for path in settle_logit_paths(group, probe_inputs(inputs), accelerator, mixed_precision)]


def announce(paths: list, accelerator, vocab: int, loss_tokens: int) -> None:
    """Rank 0 says which path each model takes (one info line each, `LogitPath.describe`)."""
    if accelerator.is_main_process:
        for path in paths:
            logger.info(path.describe(vocab, loss_tokens))


class LogitPaths:
    """Each model's logit path for one run, settled once, on the first batch, by whoever meets it first (the
    trainer's loss, a teacher's once-per-step pass); the trainer owns it and hands it down. Iterates over the
    settled `LogitPath`s (none before)."""

    def __init__(self, accelerator, candidates, mixed_precision: bool, vocab_size: int):
        self.accelerator, self.candidates = accelerator, candidates  # candidates(model_inputs, extras): the teachers'
        self.mixed_precision, self.vocab_size = mixed_precision, vocab_size
        self.paths: list[LogitPath] | None = None

    @property
    def settled(self) -> bool:
        return self.paths is not None

    def __iter__(self):
        return iter(self.paths or ())

    def settle(self, model, model_inputs: dict, mask: torch.Tensor, extras=None) -> None:
        """Check the student (`model`, as its forward runs) and each teacher model against their own logits and pick
        each one's path; rank 0 says which path each takes. `mask` ``[B, K]``: the loss tokens at the kept
        positions (for the cost it states)."""
        student = self.accelerator.unwrap_model(model)
        student = student.get_base_model() if hasattr(student, "get_base_model") else student
        candidates = [("student", model, student, model_inputs), *self.candidates(model_inputs, extras)]
        self.paths = settle_logit_paths_by_inputs(candidates, self.accelerator, self.mixed_precision)
        announce(self.paths, self.accelerator, self.vocab_size, int(mask.shape[0] * mask.shape[1]))
