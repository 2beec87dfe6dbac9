"""The checks of the on-policy objective's settings: the full-distribution divergence (`divergence`, as off the
policy) or the sampled-token policy gradient with an optional task reward (`loss.sampled_token`); TRL GRPO's names
where it has one (`epsilon`, `epsilon_high`, the reward functions' signature). The fields are `DistillationConfig`'s,
the checks run in `run_plan.resolve`."""

from __future__ import annotations

from ..constants import OBJECTIVES


def refuse_own_text(alpha: float, lmbda: float, task_reward: bool, teacher: bool) -> None:
    """``alpha=0`` on the student's own samples (``lmbda > 0``) with a `teacher`: the loss is the cross-entropy of
    the student's own text alone, the teacher's judgement of it (and any task reward) weighted 0: a run that learns
    nothing of the teacher, in silence. One line. (``seq_kd`` with ``alpha=0`` trains on the teacher's samples:
    sequence-level KD, kept.)"""
    if teacher and alpha == 0 and lmbda > 0:
        raise ValueError(f"alpha=0 trains on the cross-entropy alone, and with lmbda={lmbda} the completions are "
                         "the student's own samples: it would learn its own text, the teacher's judgement of it "
                         f"weighted 0{' (and the task reward with it)' if task_reward else ''}. Set "
                         "alpha > 0 (1: the teacher's signal alone), or lmbda=0.")


def check_objective_args(args) -> None:
    """One line for on-policy objective settings that cannot work, before anything loads."""
    from ..evaluation.verifiers import as_names, resolve_verifiers

    named = args.teacher_model_name_or_path or args.teacher_server or args.teachers or args.teacher_cache
    # (without a teacher, the teacher's refusal names it)
    refuse_own_text(args.alpha, args.lmbda, bool(args.task_reward_funcs), bool(named))
    if args.on_policy_objective not in OBJECTIVES:
        raise ValueError(f"on_policy_objective must be one of {', '.join(OBJECTIVES)}, got "
                         f"{args.on_policy_objective!r}.")
    if args.on_policy_objective != "sampled_token":
        if args.task_reward_funcs:
            raise ValueError("task_reward_funcs add a task reward to the sampled-token objective's advantages: set "
                             "on_policy_objective='sampled_token' (with lmbda=1), or drop task_reward_funcs.")
        return
    if args.lmbda != 1.0 or args.seq_kd:
        raise ValueError("on_policy_objective='sampled_token' is a policy gradient on the student's own samples: set "
                         f"lmbda=1 and seq_kd=False (got lmbda={args.lmbda}, seq_kd={args.seq_kd}).")
    if args.temperature != 1.0:
        raise ValueError("on_policy_objective='sampled_token' scores the sampled tokens at the distributions they "
                         f"were sampled from: set temperature=1 (got {args.temperature}).")
    if args.teachers is not None and args.teacher_combine != "route":
        raise ValueError("on_policy_objective='sampled_token' takes one teacher per sampled row: route several "
                         "teachers (--teacher_combine route), or use on_policy_objective='divergence' to mix them.")
    if not 0.0 <= args.sampled_token_discount <= 1.0 or args.sampled_token_kl_coef < 0:
        raise ValueError(f"sampled_token_discount must be in [0, 1] and sampled_token_kl_coef >= 0, got "
                         f"{args.sampled_token_discount} and {args.sampled_token_kl_coef}.")
    if args.epsilon < 0 or (args.epsilon_high is not None and args.epsilon_high < 0) or args.epsilon >= 1:
        raise ValueError(f"epsilon must be in [0, 1) and epsilon_high >= 0, got {args.epsilon} and "
                         f"{args.epsilon_high}.")
    if args.task_reward_funcs:
        resolve_verifiers(as_names(args.task_reward_funcs), args.eval_answer_column or "answer",
                          args.eval_answer_pattern, "task_reward_funcs")
