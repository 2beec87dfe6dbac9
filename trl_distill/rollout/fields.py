"""The fields of `DistillationConfig` that sample completions during training: how often and how (GKD's), and
from a vLLM server of the student (TRL's names, `trl.DistillationConfig` / `GRPOConfig` 1.16); their checks."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field


@dataclass
class OnPolicyFields:
    """Completions sampled during training (GKD): by the student (lmbda) or the teacher (seq_kd), and how."""

    lmbda: float = field(
        default=0.0,
        metadata={
            "help": "On-policy fraction (GKD): per optimizer step, with this probability the batch's completions are "
            "sampled from the student for the same prompts. The draw is seeded by (seed, step): equal on every rank "
            "and on resume. 0 is off-policy distillation on the dataset's completions."
        },
    )
    seq_kd: bool = field(
        default=False,
        metadata={"help": "Sequence-level KD: on the steps not drawn on-policy, completions are sampled from the "
                  "teacher instead of taken from the dataset."},
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Tokens sampled per completion (lmbda > 0 or seq_kd)."})
    generation_temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature of generated completions (not the loss temperature)."}
    )
    generation_top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling of generated completions."})
    generation_top_k: int = field(default=0, metadata={"help": "Top-k sampling of generated completions (0: off)."})


@dataclass
class EngineRolloutFields:
    """On-policy completions (``lmbda > 0``) sampled by a vLLM server of the student instead of its HF `generate`."""

    use_vllm: bool = field(default=False, metadata={
        "help": "Sample the student's completions (lmbda > 0) from a vLLM server of the student (`trl-distill "
        "vllm-serve --model STUDENT`) whose weights are synced from the trainer, instead of the student's HF "
        "generate. Any teacher kind but a cache scores them."})
    vllm_mode: str = field(default="server", metadata={
        "help": "'server' (a vLLM server of the student, started with `trl-distill vllm-serve`) or 'colocate' "
        "(vLLM inside the training processes; not available yet).", "choices": ["server", "colocate"]})
    vllm_server_base_url: str | None = field(default=None, metadata={
        "help": "Base URL of the rollout server (e.g. http://localhost:8000); when set, host and port are ignored."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Host of the rollout server."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Port of the rollout server."})
    vllm_server_timeout: float = field(default=240.0, metadata={
        "help": "Seconds the rollout server may take to answer a request or a weight sync before training stops "
        "with one line (the last complete checkpoint kept)."})
    vllm_group_port: int = field(default=51216, metadata={
        "help": "Port on the trainer's rank 0 for the weight-sync group with the server's workers (gloo on CPU)."})
    vllm_sync_steps: int = field(default=1, metadata={
        "help": "Sync the student's weights to the rollout server every this many optimizer steps (and before the "
        "first rollout). A resumed run samples what the uninterrupted one did when it resumes at a multiple of it."})
    vllm_importance_sampling_correction: bool = field(default=False, metadata={
        "help": "Weight each sampled token's KD and CE by min(π_trainer / π_engine, vllm_importance_sampling_clip_max) "
        "(detached, at temperature 1): corrects for rollouts sampled by an engine whose numerics differ from the "
        "trainer's (bf16 kernels). The sampled-token objective's surrogate is weighted so too, its ratio then taken "
        "against the trainer's own log-probs (as TRL's GRPO). The gap is logged either way "
        "(rollout_logprob_abs_diff)."})
    vllm_importance_sampling_clip_max: float = field(default=3.0, metadata={
        "help": "Upper bound of the importance-sampling weights (TRL's GRPO name)."})


def check_engine_args(args) -> None:
    """One clear error for engine settings that cannot work, as the config is built."""
    if not args.use_vllm:
        return
    if args.vllm_mode not in ("server", "colocate"):
        raise ValueError(f"vllm_mode must be 'server' or 'colocate', got {args.vllm_mode!r}.")
    if args.vllm_mode == "colocate":
        where = ("vLLM is not importable in this Python (the CPU build pins an older transformers than "
                 "trl_distill's)" if importlib.util.find_spec("vllm") is None else
                 "trl_distill does not run a colocated engine yet")
        raise ValueError(f"use_vllm with vllm_mode='colocate' needs vLLM inside the training processes, and "
                         f"{where}. Use vllm_mode='server': start `trl-distill vllm-serve --model STUDENT` and pass "
                         "--vllm_server_base_url http://HOST:8000.")
    if args.lmbda == 0:
        raise ValueError("use_vllm samples the student's completions, and lmbda=0 samples none: set lmbda > 0 "
                         "(the share of steps distilled on the student's own samples), or drop use_vllm.")
    if not args.vllm_importance_sampling_clip_max > 0:
        raise ValueError("vllm_importance_sampling_clip_max must be > 0, got "
                         f"{args.vllm_importance_sampling_clip_max}.")
    if args.vllm_sync_steps < 1 or not args.vllm_server_timeout > 0:
        raise ValueError(f"vllm_sync_steps must be >= 1 and vllm_server_timeout > 0; got {args.vllm_sync_steps}, "
                         f"{args.vllm_server_timeout}.")
