"""The report's text: the run's settings, each logged metric from first to last (and its best), the best
evaluation, in Markdown. Numbers are printed with 6 significant digits, as `trainer_state.json` holds them."""

from __future__ import annotations

from .history import RunHistory

HEADING = "# Distillation report: "  # the summary's first line: `write.write_report` knows its own by it

# The metrics the table lists first, in this order (then any other logged one), and which way is better
ORDER = ("loss", "kd_loss", "policy_loss", "ce_loss", "top1_agreement", "kl_teacher_student", "teacher_ce",
         "student_entropy", "teacher_entropy", "teacher_tail_mass", "aligned_token_share", "on_policy_fraction",
         "generated_length", "generated_repetition_rate", "task_reward", "sampled_token_teacher_gap", "clip_ratio")
HIGHER_IS_BETTER = {"top1_agreement", "eval_top1_agreement", "aligned_token_share", "task_reward",
                    "sampled_token_teacher_gap"}
NOT_METRICS = {"learning_rate", "grad_norm", "total_flos"}


def number(value: float) -> str:
    return f"{value:.6g}"


def higher_is_better(name: str) -> bool:
    """A rate of agreement or of passing (pass@k, a verifier's mean): the best is the highest."""
    return name in HIGHER_IS_BETTER or "pass@" in name or "rewards/" in name


def _best(name: str, series: list[tuple[int, float]]) -> tuple[int, float]:
    pick = max if higher_is_better(name) else min
    return pick(series, key=lambda point: point[1])


def summary(history: RunHistory, picture: str | None = None) -> str:
    """The Markdown summary of `history` (``picture``: the PNG's file name, linked at the top)."""
    lines = [f"{HEADING}`{history.directory}`", ""]
    if picture:
        lines += [f"![curves]({picture})", ""]
    settings = dict(history.run.get("settings", {}))
    lines += ["## Settings", "", f"- steps: {history.global_step} of {history.max_steps}"]
    if "world_size" in history.run:
        lines.append(f"- processes: {history.run['world_size']} (DeepSpeed: {history.run.get('deepspeed')})")
    lines += [f"- {name}: {value}" for name, value in settings.items() if value is not None]
    lines += [f"- read from: `{history.state_file}`"]
    lines += [f"- passed over (unreadable): `{path}`" for path in history.passed_over] + [""]
    names = [n for n in ORDER if history.values(n)] + sorted(
        n for n in history.series if n not in ORDER and n not in NOT_METRICS and not n.startswith("eval_")
        and not n.endswith(("_runtime", "_per_second")))
    lines += ["## Training: first → last", "", "| metric | first (step) | last (step) | best (step) |",
              "|---|---|---|---|"]
    for name in names:
        series = history.values(name)
        (s0, v0), (s1, v1), (sb, vb) = series[0], series[-1], _best(name, series)
        lines.append(f"| {name} | {number(v0)} ({s0}) | {number(v1)} ({s1}) | {number(vb)} ({sb}) |")
    evals = sorted(n for n in history.series if n.startswith("eval_")
                   and not n.endswith(("_runtime", "_per_second", "_generation_prompts")))
    lines.append("")
    if evals:
        step, best = _best("eval_loss", history.values("eval_loss")) if history.values("eval_loss") else (None, None)
        lines += ["## Evaluation", ""]
        if best is not None:
            lines += [f"Best eval_loss: {number(best)} at step {step}.", ""]
        lines += ["| metric | first (step) | last (step) | best (step) |", "|---|---|---|---|"]
        for name in evals:
            series = history.values(name)
            (s0, v0), (s1, v1), (sb, vb) = series[0], series[-1], _best(name, series)
            lines.append(f"| {name} | {number(v0)} ({s0}) | {number(v1)} ({s1}) | {number(vb)} ({sb}) |")
        lines.append("")
    else:
        lines += ["No evaluation was logged (pass an eval dataset and eval_strategy to see held-out curves).", ""]
    return "\n".join(lines)
