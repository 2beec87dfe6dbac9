"""The checks of the settings that sample the student's completions from a vLLM server of the student (TRL's names,
`trl.DistillationConfig` / `GRPOConfig` 1.16; the fields are `DistillationConfig`'s), run by `run_plan.resolve`."""

from __future__ import annotations

import importlib.util


def check_engine_args(args) -> None:
    """One clear error for engine settings that cannot work, before anything loads."""
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
