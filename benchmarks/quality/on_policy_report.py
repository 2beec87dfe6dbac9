"""The on-policy experiment's numbers (`on_policy_kd.py`): each run's held-out curve from its own log, the paired
comparisons between methods, and the Markdown table."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

BASES = ("sft", "off-policy forward KL")


def curve_of(out: Path) -> dict:
    """From a CLI run's `trainer_state.json`: its generation-eval curve ``[[step, pass@1, teacher NLL, CE], ...]``,
    its training seconds, and the last evaluation's teacher-forced CE on the test completions."""
    state = json.loads((out / "trainer_state.json").read_text())
    evals = [h for h in state["log_history"] if "eval_pass@1" in h]
    curve = [[h["step"], h["eval_pass@1"], h.get("eval_teacher_nll"), h.get("eval_ce_loss")] for h in evals]
    runtime = next((h["train_runtime"] for h in state["log_history"] if "train_runtime" in h), None)
    eval_seconds = [h["eval_generation_runtime"] for h in evals]
    return {"curve": curve, "train_runtime": runtime, "max_steps": state["max_steps"],
            "teacher_forced_ce": curve[-1][3] if curve else None,
            "eval_generation_seconds": statistics.median(eval_seconds) if eval_seconds else None}


def area(curve: list) -> float:
    """The mean pass@1 over the run: the trapezoid area under the curve divided by the steps it spans."""
    if len(curve) < 2:
        return curve[0][1] if curve else math.nan
    total = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(curve, curve[1:], strict=False))
    return total / (curve[-1][0] - curve[0][0])


def at_seconds(run: dict, seconds: float) -> float | None:
    """pass@1 of the run's last evaluation done within `seconds` of its start (its steps spread evenly over its
    training time; None when none was)."""
    per_step = run["train_runtime"] / run["max_steps"]
    done = [point[1] for point in run["curve"] if point[0] * per_step <= seconds + 1e-9]
    return done[-1] if done else None


def paired(a: str, b: str) -> tuple[float, float]:
    """Mean difference of two runs' per-prompt outcomes (strings or lists of 0/1) and its standard error."""
    x, y = [float(v) for v in a], [float(v) for v in b]
    d = [p - q for p, q in zip(x, y, strict=True)]
    mean = sum(d) / len(d)
    sd = statistics.pstdev(d) if len(d) > 1 else 0.0
    return mean, sd / math.sqrt(len(d))


def summarize(report: dict) -> dict:
    """Per method: mean pass@1, area under the curve, teacher NLL, teacher-forced CE, pass@1 at the SFT run's
    wall-clock time; against each base, per seed the difference, its paired standard error, and whether it is
    more than 3 of them."""
    seeds = report["plan"]["seeds"]
    by = {(r["method"], r["seed"]): r for r in report["runs"]}
    methods = [m for m in report["plan"]["methods"] if all((m, s) in by for s in seeds)]
    out = {}
    for method in methods:
        runs = [by[method, s] for s in seeds]
        row = {"pass@1": statistics.mean(r["pass@1"] for r in runs),
               "area": statistics.mean(area(r["curve"]) for r in runs),
               "teacher_nll": statistics.mean(r["teacher_nll"] for r in runs),
               "seconds": statistics.mean(r["seconds"] for r in runs)}
        costs = [r["eval_generation_seconds"] for r in runs if r["eval_generation_seconds"] is not None]
        row["eval_generation_seconds"] = statistics.mean(costs) if costs else None
        ce = [r["teacher_forced_ce"] for r in runs if r["teacher_forced_ce"] is not None]
        row["teacher_forced_ce"] = statistics.mean(ce) if ce else None
        if "sft" in methods:
            equal = [at_seconds(by[method, s], by["sft", s]["train_runtime"]) for s in seeds]
            row["at_sft_seconds"] = statistics.mean(equal) if None not in equal else None
        for base in report["plan"].get("bases", BASES):
            if base in methods and base != method:
                versus = [paired(by[method, s]["passed"], by[base, s]["passed"]) for s in seeds]
                row[base] = {"deltas": [d for d, _ in versus], "standard_errors": [se for _, se in versus],
                             "beyond_3se": sum(d > 3 * se for d, se in versus),
                             "area_deltas": [area(by[method, s]["curve"]) - area(by[base, s]["curve"])
                                             for s in seeds]}
        out[method] = row
    return out


def markdown(report: dict) -> str:
    seeds, summary, plan = report["plan"]["seeds"], report["summary"], report["plan"]
    by = {(r["method"], r["seed"]): r for r in report["runs"]}
    first, second = plan.get("bases", BASES)
    lines = ["| method | " + " | ".join(f"pass@1 seed {s}" for s in seeds) + f" | mean | vs {first} (seeds > 3 SE) | "
             f"vs {second} (seeds > 3 SE) | mean pass@1 over the run | at SFT's wall-clock | teacher NLL "
             "of samples | teacher-forced CE | s per run |", "|---|" + "---|" * (len(seeds) + 8)]

    def versus(row: dict, base: str) -> str:
        if base not in row:
            return "—"
        d, se = row[base]["deltas"], row[base]["standard_errors"]
        return f"{100 * statistics.mean(d):+.1f} pts, SE {100 * statistics.mean(se):.1f} ({row[base]['beyond_3se']}/" \
               f"{len(seeds)})"

    def number(value, fmt=".3f"):
        return "—" if value is None else f"{value:{fmt}}"

    for method, row in summary.items():
        cells = [f"{100 * by[method, s]['pass@1']:.1f}" for s in seeds]
        equal = None if row.get("at_sft_seconds") is None else 100 * row["at_sft_seconds"]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {100 * row['pass@1']:.1f} | {versus(row, first)} | "
                     f"{versus(row, second)} | {100 * row['area']:.1f} | {number(equal, '.1f')} | "
                     f"{row['teacher_nll']:.3f} | {number(row['teacher_forced_ce'])} | {row['seconds']:.0f} |")
    teacher, warm, m = report["teacher"], report["warm"], report["machine"]
    warm_text = ", ".join(f"{100 * w['pass@1']:.1f} (seed {w['seed']})" for w in warm)
    lines += ["", f"Held-out pass@1 (%, greedy, `last_number`) on {len(teacher['passed'])} test prompts never trained "
              f"on; the teacher {100 * teacher['pass@1']:.1f} after {plan['teacher_steps']} steps of "
              f"{plan['teacher_batch']} rows; the warm-started students {warm_text} after {plan['warm_steps']} SFT "
              f"steps. Each method then trains {plan['steps']} steps of {plan['batch']} rows from the same warm "
              f"checkpoint and data order; alpha 1 for KD, temperature 1, {report['new_tokens']} new tokens a sampled "
              f"completion. SE: the paired standard error of the difference on the same prompts; \"mean pass@1 over "
              f"the run\": the area under the run's own pass@1 curve (its first {plan['curve_prompts']} test prompts, "
              f"every {plan['eval_every']} steps) over its steps; \"at SFT's wall-clock\": that curve's value at the "
              f"time the SFT run took. Teacher NLL: per token of the student's greedy completions. {m['cpus']} CPUs, "
              f"torch {m['torch']}, {m['date']}; {report['seconds']:.0f} s in all."]
    hf, served = (summary.get(name, {}).get("eval_generation_seconds") for name in
                  ("on-policy reverse KL", "on-policy reverse KL, vLLM rollouts"))
    if hf and served:
        lines += ["", f"Evaluation cost: {plan['curve_prompts']} prompts greedy with teacher scoring, median per "
                  f"evaluation, mean over seeds: {hf:.1f} s with HF `generate` vs {served:.1f} s from the vLLM rollout "
                  f"server (synced first): {served / hf:.1f}x HF's time, in the same experiment (at this size the "
                  "server's per-request overhead dominates)."]
    return "\n".join(lines) + "\n"
