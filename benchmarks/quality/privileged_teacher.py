"""Does a teacher that sees the answer teach better? (`teacher_prompt`, issue 44)

    python benchmarks/quality/privileged_teacher.py [--work_dir DIR] [--results FILE] [--output_dir DIR]

Builds on `on_policy_kd.py --plan objective` (run it first): its work dir (the task's data, the untrained teacher, the
warm students) and its results JSON (the plain teacher's on-policy reverse KL students, per prompt). A second
teacher of the same size is trained, as the plain one was, on rows whose prompt starts with the answer
(``"{answer} {prompt}"``); then, per seed, the same on-policy reverse KL steps from the same warm student and data
order, with that teacher reading ``--teacher_prompt "{answer} {prompt}"`` while the student reads the prompt alone.
Scored as the objective plan scores (held-out pass@1, greedy, `last_number`; the teacher NLL under the plain
teacher) and compared per prompt with the plain teacher's students. Goal: the privileged teacher's students ≥ the
plain teacher's. Writes ``privileged_teacher.{json,md}`` and the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # benchmarks/

from _common import machine, replace_readme_block  # noqa: E402
from kd_vs_sft import cli, say  # noqa: E402
from on_policy_kd import PLANS, eval_flags, score  # noqa: E402
from on_policy_report import paired  # noqa: E402

HINT = "{answer} {prompt}"
MARKERS = ("<!-- experiment:privileged:start -->", "<!-- experiment:privileged:end -->")
PLAIN = "on-policy reverse KL"


def hinted(source: Path, target: Path) -> None:
    """`source`'s rows with the answer written before the prompt (what the privileged teacher trains on)."""
    target.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (source / f"{split}.jsonl").read_text().splitlines()]
        (target / f"{split}.jsonl").write_text("".join(
            json.dumps({**row, "prompt": HINT.format(**row)}) + "\n" for row in rows))


def markdown(report: dict) -> str:
    lines = ["| teacher of the on-policy reverse KL students | teacher's own pass@1 | pass@1 seed 1, 2, 3 | mean | vs "
             "the plain teacher's students (paired SE; seeds ahead) | teacher NLL of samples |",
             "|---|---|---|---|---|---|"]
    for name, row in report["rows"].items():
        versus = row.get("versus")
        cell = "—" if versus is None else (f"{100 * statistics.mean(versus['deltas']):+.1f} pts, SE "
                                            f"{100 * statistics.mean(versus['standard_errors']):.1f} "
                                            f"({versus['ahead']}/{len(versus['deltas'])})")
        seeds = ", ".join(f"{100 * p:.1f}" for p in row["pass@1"])
        mean, nll = 100 * statistics.mean(row["pass@1"]), statistics.mean(row["teacher_nll"])
        lines.append(f"| {name} | {100 * row['teacher_pass@1']:.1f} | {seeds} | {mean:.1f} | {cell} | {nll:.3f} |")
    plan, m = report["plan"], report["machine"]
    lines += ["", f"Held-out pass@1 (%, greedy, `last_number`) on {plan['test_rows']} test prompts; each student "
              f"trains {plan['steps']} on-policy steps (lmbda 1, reverse KL, alpha 1) of {plan['batch']} rows from "
              f"the same warm checkpoint and data order; the privileged teacher ({plan['teacher_steps']} steps on rows "
              f"prompted `{HINT}`) reads `--teacher_prompt \"{HINT}\"`, the student the prompt alone. A teacher's own "
              "pass@1: greedy on its own prompts. Teacher NLL: of the student's completions under the plain teacher. "
              f"{m['cpus']} CPUs, torch {m['torch']}, {m['date']}; {report['seconds']:.0f} s in all."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", default=str(HERE.parents[1] / "outputs" / "on_policy_kd_objective"))
    parser.add_argument("--results", default=str(HERE / "results" / "on_policy_kd_objective.json"))
    parser.add_argument("--output_dir", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from concurrent.futures import ThreadPoolExecutor

    from datasets import load_dataset

    begin, work, plan = time.time(), Path(args.work_dir).resolve(), dict(PLANS["objective"])
    plain_runs = {r["seed"]: r for r in json.loads(Path(args.results).read_text())["runs"] if r["method"] == PLAIN}
    hinted(work / "data", work / "hinted")
    test = list(load_dataset("json", data_files=str(work / "data" / "test.jsonl"), split="train"))
    hinted_test = list(load_dataset("json", data_files=str(work / "hinted" / "test.jsonl"), split="train"))
    teacher = work / "teacher_privileged"
    say(f"training the privileged teacher ({plan['teacher_steps']} steps)")
    cli(work / "init" / "teacher_init", None, teacher, data=work / "hinted", steps=plan["teacher_steps"],
        batch=plan["teacher_batch"], seed=0, alpha=0.0, divergence="forward_kl", save_every=None)
    own = score(teacher, teacher, hinted_test)["pass@1"]
    say(f"privileged teacher: pass@1 {own:.3f} on its own prompts")

    def student(seed: int) -> dict:
        out = work / "students_privileged" / f"s{seed}"
        flags = eval_flags(plan) | {"lmbda": 1.0, "teacher_prompt": HINT}
        seconds = cli(work / f"warm{plan['warm_steps']}" / f"s{seed}", teacher, out, data=work / "data",
                      steps=plan["steps"], batch=plan["batch"], seed=seed, alpha=1.0, divergence="reverse_kl",
                      save_every=None, extra=flags)
        result = score(out, work / "teacher", test)
        say(f"privileged teacher's student seed {seed}: pass@1 {result['pass@1']:.3f} ({seconds:.0f} s)")
        return {"seed": seed, "seconds": seconds, **result}

    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(student, plan["seeds"]))
    plain_own = json.loads((work / "teacher.json").read_text())[1]["pass@1"]
    versus = [paired(r["passed"], plain_runs[r["seed"]]["passed"]) for r in runs]
    rows = {
        "plain (reads the prompt)": {"teacher_pass@1": plain_own,
                                     "pass@1": [plain_runs[s]["pass@1"] for s in plan["seeds"]],
                                     "teacher_nll": [plain_runs[s]["teacher_nll"] for s in plan["seeds"]]},
        "privileged (reads answer + prompt)": {
            "teacher_pass@1": own, "pass@1": [r["pass@1"] for r in runs],
            "teacher_nll": [r["teacher_nll"] for r in runs],
            "versus": {"deltas": [d for d, _ in versus], "standard_errors": [se for _, se in versus],
                       "ahead": sum(d >= 0 for d, _ in versus)}},
    }
    report = {"plan": plan, "hint": HINT, "rows": rows, "runs": runs, "seconds": time.time() - begin,
              "machine": machine()}
    for run in runs:
        run["passed"] = "".join(str(int(p)) for p in run["passed"])
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "privileged_teacher.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "privileged_teacher.md").write_text("# A teacher that sees the answer\n\n" + table)
    replace_readme_block(MARKERS, table)
    print(table)


if __name__ == "__main__":
    main()
