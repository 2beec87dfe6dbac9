"""The checks of the generation-based evaluation: its settings (`DistillationConfig`'s fields), run by
`run_plan.resolve`, and its eval splits, run by the trainer before anything trains."""

from __future__ import annotations

from ..runtime.sequence_parallel import sequence_parallel_size
from .verifiers import as_names, resolve_verifiers


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
    funcs = as_names(args.eval_reward_funcs)
    if not funcs:
        return
    resolve_verifiers(funcs, args.eval_answer_column or "answer", args.eval_answer_pattern)
    if args.padding_free or args.packing and args.eval_packing is not False:
        raise ValueError("Generation-based evaluation (eval_reward_funcs) completes each eval row's prompt, and packed "
                         "eval rows have none of their own: set padding_free=False and, with packing, eval_packing="
                         "False (training may stay packed).")
    if sequence_parallel_size(args) > 1:
        raise ValueError("Generation-based evaluation (eval_reward_funcs) with sequence_parallel_size > 1 is not "
                         "supported: generation runs on whole rows. Drop eval_reward_funcs, or evaluate the saved "
                         "student in a run without sequence parallelism.")



def check_eval_splits(evaluation: dict, evaluation_of, state) -> None:
    """`eval_reward_funcs`, before anything trains: an eval split whose rows have prompts, and verifiers that score
    its first rows (their reference completions) without raising or miscounting. `evaluation` maps each split's name
    to its prepared rows; `evaluation_of(dataset)` is the run's `GenerationEvaluation` of one."""
    from ..rollout.on_policy import promptless_rows  # (rollout imports the teacher kinds, which import this package)

    if all(dataset is None for dataset in evaluation.values()):
        raise ValueError("eval_reward_funcs judges what the student generates for the eval split's prompts, and "
                         "this run has no eval split: pass eval_dataset (--dataset_test_split), or drop "
                         "eval_reward_funcs.")
    for name, dataset in evaluation.items():
        bare = promptless_rows(dataset)
        if bare:
            raise ValueError(f"Generation-based evaluation (eval_reward_funcs) completes each eval row's prompt, "
                             f"and {bare} of the {len(dataset)} prepared rows of the {name} split have none "
                             "(language-modeling text): use a prompt-completion or conversational eval split.")
        evaluation_of(dataset).check(dataset, name, state)
