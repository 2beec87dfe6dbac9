"""Two teachers, each expert at a different task: does a student distilled from both beat each single-teacher one?

    make experiment-multi      # python benchmarks/quality/multi_teacher_kd.py [--smoke] [--output_dir DIR]

Students are judged by what they generate, as in `on_policy_kd.py`: held-out pass@1 (greedy, ``last_number``) on
two verifiable tasks with long worked answers (`arithmetic_task.py`): ``mul``, 2-digit multiplication worked out,
and ``add``, 5-digit addition worked column by column. Every run is the `trl-distill` CLI (one process, one thread,
two runs at a time).

1. Teacher ``mul`` (Llama, 2 layers, hidden 128) is trained with ``--alpha 0`` on multiplication rows only, teacher
   ``add`` on addition rows only: each is expert at its task and has never seen the other's prompts.
2. Per seed, a smaller student (hidden 32) is SFT-warm-started for `warm_steps` on the union (the two tasks' rows
   interleaved, each row's task in its ``teacher`` column) to partial accuracy on both.
3. From that warm checkpoint and the same data order, `steps` more steps on the union of each method: SFT only; KD
   (alpha 1, forward KL) from ``mul`` alone, from ``add`` alone; from both routed (each row learns from its task's
   expert: ``--teachers mul=DIR add=DIR``, the ``teacher`` column); from both mixed with equal weights
   (``--teacher_combine mixture``).
4. Scored at the end on every test prompt of both tasks: pass@1 per task and on the union (per prompt, so two
   students are compared on the same prompts with the paired standard error), and the teacher NLL of the student's
   completions under that task's expert.

Goal (issue 43): the routed student beats each single-teacher student on the union's pass@1, 3 seeds of 3. Writes
`multi_teacher_kd.{json,md}` to --output_dir (default benchmarks/quality/results) and the table into
docs/benchmarks.md between its ``experiment:multi_teacher`` markers; models and CLI logs go to --work_dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # benchmarks/

import arithmetic_task  # noqa: E402
from _common import machine, replace_readme_block  # noqa: E402
from kd_vs_sft import cli, say  # noqa: E402
from multi_teacher_report import METHODS, ON_POLICY, markdown, summarize  # noqa: E402
from on_policy_kd import NEW_TOKENS, SIZES, eval_flags, score, untrained_models  # noqa: E402
from on_policy_report import curve_of  # noqa: E402

TASKS = {"mul": "multiplication", "add": "addition"}  # the teacher (routing) name: its task
README_START, README_END = "<!-- experiment:multi_teacher:start -->", "<!-- experiment:multi_teacher:end -->"
ON_POLICY_MARKERS = ("<!-- experiment:multi_teacher_on_policy:start -->",
                     "<!-- experiment:multi_teacher_on_policy:end -->")
ON_POLICY_OBJECTIVE = "reverse KL on the student's own samples (lmbda 1, HF generate, 48 new tokens)"
PLANS = {
    "full": dict(seeds=[1, 2, 3], train_rows=100000, test_rows=500, curve_prompts=200, teacher_steps=5000,
                 teacher_batch=32, warm_steps=2000, steps=1000, batch=32, eval_every=100),
    "smoke": dict(seeds=[1], train_rows=200, test_rows=6, curve_prompts=6, teacher_steps=6, teacher_batch=8,
                  warm_steps=4, steps=4, batch=4, eval_every=2),
}


def prepare(work: Path, plan: dict) -> dict[str, Path]:
    """The union's splits (``data/``), each task's train rows alone (``data_NAME.jsonl``), the one-character
    tokenizer, the untrained teacher and one untrained student per seed."""
    from datasets import Dataset

    split_rows = arithmetic_task.union(TASKS, plan["train_rows"], plan["test_rows"])
    paths = arithmetic_task.write(work / "data", 0, 0, split_rows=split_rows)
    for name in TASKS:
        paths[f"train_{name}"] = work / f"data_{name}.jsonl"
        Dataset.from_list([r for r in split_rows["train"] if r["teacher"] == name]).to_json(str(paths[f"train_{name}"]))
    return paths | untrained_models(work, plan["seeds"])


def score_tasks(model_dir: Path, teachers: dict[str, Path], test: list[dict]) -> dict:
    """`score` on each task's test prompts with that task's expert as the NLL teacher; the union's outcomes are the
    tasks' in TASKS order."""
    per_task = {name: score(model_dir, teachers[name], [r for r in test if r["teacher"] == name]) for name in TASKS}
    passed = [p for name in TASKS for p in per_task[name]["passed"]]
    return {"passed": passed, "pass@1": sum(passed) / len(passed),
            "tasks": {name: {k: v for k, v in result.items() if k != "passed"} for name, result in per_task.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps, 1 seed (about two minutes)")
    parser.add_argument("--output_dir", default=str(HERE / "results"))
    parser.add_argument("--work_dir", default=None, help="default outputs/multi_teacher_kd")
    parser.add_argument("--reuse_teachers", action="store_true",
                        help="keep the teachers an earlier run of the same plan trained in --work_dir")
    parser.add_argument("--on_policy", action="store_true",
                        help="the students on their own samples instead (MOPD: lmbda 1, reverse KL): each teacher "
                        "alone and both routed; writes multi_teacher_on_policy_kd.{json,md}")
    args = parser.parse_args(argv)
    name = "smoke" if args.smoke else "full"
    plan = dict(PLANS[name])
    work = Path(args.work_dir or ROOT / "outputs" / f"multi_teacher_{name}").resolve()
    torch.set_num_threads(1)
    from datasets import load_dataset

    begin = time.time()
    paths = prepare(work, plan)
    data = paths["train"].parent
    test = list(load_dataset("json", data_files=str(paths["test"]), split="train"))
    teachers = {task: work / f"teacher_{task}" for task in TASKS}

    def train_teacher(task: str) -> float:
        kept = teachers[task] / "trainer_state.json"
        if args.reuse_teachers and kept.exists():  # trained before by the same plan: deterministic
            say(f"reusing the teacher in {teachers[task]}")
            state = json.loads(kept.read_text())
            return next(h["train_runtime"] for h in state["log_history"] if "train_runtime" in h)
        return cli(paths["teacher_init"], None, teachers[task], data=paths[f"train_{task}"],
                   steps=plan["teacher_steps"], batch=plan["teacher_batch"], seed=0, alpha=0.0,
                   divergence="forward_kl", save_every=None)

    def warm(seed: int) -> dict:
        out = work / "warm" / f"s{seed}"
        seconds = cli(paths[f"student_init_{seed}"], None, out, data=data, steps=plan["warm_steps"],
                      batch=plan["batch"], seed=seed, alpha=0.0, divergence="forward_kl", save_every=None)
        return {"seed": seed, "seconds": seconds, **score_tasks(out, teachers, test)}

    say(f"training the teachers ({plan['teacher_steps']} steps each), then warm-starting the students")
    with ThreadPoolExecutor(max_workers=2) as pool:
        seconds = dict(zip(TASKS, pool.map(train_teacher, TASKS), strict=True))  # both, before either scores
        scored = dict(zip(TASKS, pool.map(lambda task: score_tasks(teachers[task], teachers, test), TASKS),
                          strict=True))
        teacher_scores = {task: {"seconds": seconds[task], **scored[task]} for task in TASKS}
        for task, result in teacher_scores.items():
            say(f"teacher {task}: pass@1 " + ", ".join(f"{t} {r['pass@1']:.3f}" for t, r in result["tasks"].items()))
        warmed = list(pool.map(warm, plan["seeds"]))
    for w in warmed:
        say(f"warm student seed {w['seed']}: " + ", ".join(f"{t} {r['pass@1']:.3f}" for t, r in w["tasks"].items()))

    def student(method: str, seed: int) -> dict:
        teacher, alpha, extra = None, 1.0, dict(eval_flags(plan))
        if method.startswith("on-policy"):
            extra |= {"lmbda": 1.0, "max_new_tokens": NEW_TOKENS}
        plain = method.removeprefix("on-policy ")
        if plain == "sft":
            alpha = 0.0
        elif plain in (f"{task} only" for task in TASKS):
            teacher = teachers[plain.split()[0]]
        else:
            extra |= {"teachers": [f"{task}={teachers[task]}" for task in TASKS],
                      "teacher_combine": "route" if plain == "both routed" else "mixture"}
        out = work / "students" / f"{method.replace(' ', '_')}_s{seed}"
        seconds = cli(work / "warm" / f"s{seed}", teacher, out, data=data, steps=plan["steps"], batch=plan["batch"],
                      seed=seed, alpha=alpha, divergence="reverse_kl" if method.startswith("on-policy") else
                      "forward_kl", save_every=None, extra=extra)
        result = score_tasks(out, teachers, test)
        say(f"{method} seed {seed}: union {result['pass@1']:.3f} (" +
            ", ".join(f"{t} {r['pass@1']:.3f}" for t, r in result["tasks"].items()) + f"), {seconds:.0f} s")
        return {"method": method, "seed": seed, "seconds": seconds, **result, **curve_of(out)}

    methods = ON_POLICY if args.on_policy else METHODS
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda job: student(*job), [(m, s) for m in methods for s in plan["seeds"]]))
    report = {"plan": plan, "tasks": TASKS, "sizes": SIZES, "runs": runs, "warm": warmed, "teachers": teacher_scores,
              "seconds": time.time() - begin, "machine": machine(), "methods": list(methods)}
    if args.on_policy:
        report["objective"] = ON_POLICY_OBJECTIVE
    report["summary"] = summarize(report)
    for run in report["runs"] + report["warm"] + list(report["teachers"].values()):
        run["passed"] = "".join(str(int(p)) for p in run["passed"])  # kept per prompt, compactly
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "multi_teacher_on_policy_kd" if args.on_policy else "multi_teacher_kd"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / f"{stem}.md").write_text("# Two expert teachers: students judged by what they generate\n\n" + table)
    if not args.smoke:
        replace_readme_block(ON_POLICY_MARKERS if args.on_policy else (README_START, README_END), table)
    print(table)


if __name__ == "__main__":
    main()
