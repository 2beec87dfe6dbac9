"""The two-teacher experiment's numbers (`multi_teacher_kd.py`): pass@1 per task and on the union, the paired
comparisons of each two-teacher student against each single-teacher one, and the Markdown table."""

from __future__ import annotations

import statistics

from on_policy_report import area, paired

METHODS = ("sft", "mul only", "add only", "both routed", "both mixed")
SINGLE = ("mul only", "add only")
ON_POLICY = ("on-policy mul only", "on-policy add only", "on-policy both routed")
"""The same students on their own samples (``--on_policy``: lmbda 1, reverse KL): MOPD against each single teacher."""


def singles_of(method: str) -> tuple[str, ...]:
    """The single-teacher students a two-teacher `method` is compared with: those trained the same way."""
    prefix = method.split("both")[0]
    return tuple(prefix + single for single in SINGLE)


def summarize(report: dict) -> dict:
    """Per method: mean pass@1 on the union and on each task, mean pass@1 over the run (its curve's area), seconds;
    for a two-teacher student against each single-teacher one: per seed the union's difference, its paired standard
    error, on how many seeds it is ahead at all and by more than 3 of them."""
    seeds, tasks = report["plan"]["seeds"], list(report["tasks"])
    by = {(r["method"], r["seed"]): r for r in report["runs"]}
    out = {}
    for method in report.get("methods", METHODS):
        runs = [by[method, s] for s in seeds if (method, s) in by]
        if len(runs) < len(seeds):
            continue
        row = {"pass@1": statistics.mean(r["pass@1"] for r in runs),
               "tasks": {t: statistics.mean(r["tasks"][t]["pass@1"] for r in runs) for t in tasks},
               "teacher_nll": {t: statistics.mean(r["tasks"][t]["teacher_nll"] for r in runs) for t in tasks},
               "area": statistics.mean(area(r["curve"]) for r in runs),
               "seconds": statistics.mean(r["seconds"] for r in runs)}
        if "both" in method:
            for single, named in zip(SINGLE, singles_of(method), strict=True):
                versus = [paired(by[method, s]["passed"], by[named, s]["passed"]) for s in seeds]
                row[single] = {"deltas": [d for d, _ in versus], "standard_errors": [se for _, se in versus],
                               "ahead": sum(d > 0 for d, _ in versus),
                               "beyond_3se": sum(d > 3 * se for d, se in versus)}
            row["beats_both"] = sum(all(row[single]["deltas"][i] > 0 for single in SINGLE) for i in range(len(seeds)))
        out[method] = row
    return out


def markdown(report: dict) -> str:
    seeds, summary, plan, tasks = report["plan"]["seeds"], report["summary"], report["plan"], list(report["tasks"])
    by = {(r["method"], r["seed"]): r for r in report["runs"]}
    lines = ["| student | union pass@1, " + ", ".join(f"seed {s}" for s in seeds) + " | union mean | " +
             " | ".join(f"{t} pass@1" for t in tasks) + " | vs " + " | vs ".join(SINGLE) +
             " | beats both (seeds) | mean union pass@1 over the run | teacher NLL " + ", ".join(tasks) +
             " | s per run |", "|---|---|---|" + "---|" * (len(tasks) + len(SINGLE) + 4)]

    def versus(row: dict, single: str) -> str:
        if single not in row:
            return "—"
        d, se = row[single]["deltas"], row[single]["standard_errors"]
        counts = f"ahead {row[single]['ahead']}/{len(seeds)}, > 3 SE {row[single]['beyond_3se']}/{len(seeds)}"
        return f"{100 * statistics.mean(d):+.1f} pts, SE {100 * statistics.mean(se):.1f} ({counts})"

    for method, row in summary.items():
        cells = ", ".join(f"{100 * by[method, s]['pass@1']:.1f}" for s in seeds)
        beats = f"{row['beats_both']}/{len(seeds)}" if "beats_both" in row else "—"
        lines.append(f"| {method} | {cells} | {100 * row['pass@1']:.1f} | " +
                     " | ".join(f"{100 * row['tasks'][t]:.1f}" for t in tasks) + " | " +
                     " | ".join(versus(row, single) for single in SINGLE) +
                     f" | {beats} | {100 * row['area']:.1f} | " +
                     ", ".join(f"{row['teacher_nll'][t]:.3f}" for t in tasks) + f" | {row['seconds']:.0f} |")
    def per_task(result: dict) -> str:
        return ", ".join(f"{t} {100 * r['pass@1']:.1f}" for t, r in result["tasks"].items())

    teachers = "; ".join(f"teacher {name}: {per_task(score)}" for name, score in report["teachers"].items())
    warm = "; ".join(f"seed {w['seed']}: {per_task(w)}" for w in report["warm"])
    m = report["machine"]
    lines += ["", f"Held-out pass@1 (%, greedy, `last_number`) on {plan['test_rows']} test prompts of each task "
              "(`mul`: 2-digit multiplication worked out; `add`: 5-digit addition column by column), never trained "
              f"on. Teachers after {plan['teacher_steps']} steps of {plan['teacher_batch']} rows of their own "
              f"task only: {teachers}. Students SFT-warm-started {plan['warm_steps']} steps on the union: {warm}. "
              f"Each method then trains {plan['steps']} steps of {plan['batch']} union rows from the same warm "
              f"checkpoint and data order; KD at alpha 1, {report.get('objective', 'forward KL')}, temperature 1. "
              "\"vs\": the union's difference from that single-teacher student (trained the same way), mean over "
              "seeds, with the paired standard error on the same prompts. "
              f"Mean pass@1 over the run: the area under the run's own curve (its first {plan['curve_prompts']} test "
              f"prompts, both tasks, every {plan['eval_every']} steps). Teacher NLL: per token of the student's "
              f"completions under that task's expert. {m['cpus']} CPUs, torch {m['torch']}, {m['date']}; "
              f"{report['seconds']:.0f} s in all."]
    return "\n".join(lines) + "\n"
