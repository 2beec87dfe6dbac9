"""`DistillationConfig` fields of the generation-based evaluation, and their checks as the config is built."""

from __future__ import annotations

from dataclasses import dataclass, field

from .verifiers import BUILT_INS, resolve_verifiers


@dataclass
class GenerationEvalFields:
    """What `evaluate()` generates and how each completion is judged (`trl_distill.evaluation`)."""

    eval_reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Judge the student by what it generates: in evaluate() (every eval_steps, at the end, and called "
        f"directly) it completes the eval split's prompts and these verifiers score each completion: built-ins "
        f"({', '.join(BUILT_INS)}) or functions with TRL's reward signature as module:function (or module.function). "
        "The first one decides pass@k (a completion passes at score >= 1). Logs eval_pass@1, "
        "eval_rewards/NAME/mean, eval_generated_length, eval_eos_rate and eval_teacher_nll."})
    num_generations_eval: int = field(default=1, metadata={
        "help": "Completions per eval prompt (TRL's name): n > 1 also logs eval_pass@n (the unbiased estimator of "
        "Chen et al. 2021) and samples at eval_temperature."})
    eval_temperature: float | None = field(default=None, metadata={
        "help": "Sampling temperature of the eval completions; 0 is greedy. Default: greedy with one generation per "
        "prompt, generation_temperature with several."})
    eval_max_new_tokens: int | None = field(default=None, metadata={
        "help": "Tokens generated per eval completion at most (default: max_new_tokens)."})
    eval_generation_prompts: int | None = field(default=None, metadata={
        "help": "Generate for the eval split's first N prompts only (default: all); the loss is still taken on all."})
    eval_answer_column: str | None = field(default=None, metadata={
        "help": "The eval column the built-in verifiers compare with (default: 'answer', else 'solution')."})
    eval_answer_pattern: str | None = field(default=None, metadata={
        "help": "The regular expression regex_match extracts the answer with (its first group, if any)."})


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


def eval_sampling_temperature(args) -> float:
    """The eval completions' temperature: the field, else greedy for one generation, generation_temperature for n."""
    if args.eval_temperature is not None:
        return args.eval_temperature
    return 0.0 if args.num_generations_eval == 1 else args.generation_temperature
