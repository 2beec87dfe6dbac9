"""The checks of the generation-based evaluation's settings (`DistillationConfig`'s fields), run by
`run_plan.resolve`."""

from __future__ import annotations

from .verifiers import resolve_verifiers


def check_generation_eval_args(args) -> None:
    """One clear error for generation-eval settings that cannot work (a verifier that cannot be had included)."""
    if args.num_generations_eval < 1:
        raise ValueError(f"num_generations_eval must be >= 1, got {args.num_generations_eval}.")
    if args.eval_temperature is not None and args.eval_temperature < 0:
        raise ValueError(f"eval_temperature must be >= 0 (0: greedy), got {args.eval_temperature}.")
    if args.eval_temperature == 0 and args.num_generations_eval > 1:
        raise ValueError(f"num_generations_eval={args.num_generations_eval} greedy completions would all be the same: "
                         "set eval_temperature > 0 (e.g. 1.0) for pass@k, or num_generations_eval=1.")
    for name in ("eval_max_new_tokens", "eval_generation_prompts"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {getattr(args, name)}.")
    if isinstance(args.eval_reward_funcs, str):  # one name given as a string (a recipe, the API)
        args.eval_reward_funcs = [args.eval_reward_funcs]
    if not args.eval_reward_funcs:
        return
    resolve_verifiers(args.eval_reward_funcs, args.eval_answer_column or "answer", args.eval_answer_pattern)
    if args.padding_free or args.packing and args.eval_packing is not False:
        raise ValueError("Generation-based evaluation (eval_reward_funcs) completes each eval row's prompt, and packed "
                         "eval rows have none of their own: set padding_free=False and, with packing, eval_packing="
                         "False (training may stay packed).")
    if getattr(args, "sequence_parallel_size", 1) > 1:
        raise ValueError("Generation-based evaluation (eval_reward_funcs) with sequence_parallel_size > 1 is not "
                         "supported: generation runs on whole rows. Drop eval_reward_funcs, or evaluate the saved "
                         "student in a run without sequence parallelism.")

