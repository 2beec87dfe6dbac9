"""What routing saves: two live teachers, each row routed to one of them, with each teacher's forward on its own rows
(now) against each teacher's forward on the whole micro-batch (before issue 44), in one process, the same run.

    python benchmarks/routed_teachers.py [--smoke] [--repeats N] [--output_dir DIR]

Two teachers (Llama, 4 layers, hidden 256) and a student (2 layers, hidden 64); rows routed half and half. Two
scenarios: off the policy (the once-per-step pass, gradient accumulation 2) and on the student's samples (``lmbda``
1: the teacher per micro-batch). "before" sets `routes_own_rows` off on both teachers, which is exactly the earlier
code path (each teacher over every row, the loss picking its own). Measured per optimizer step after the first
(untimed): the seconds inside the teachers' forwards and the whole step; the variants alternate (in reverse order
every other repeat) and each ratio is taken repeat by repeat, median [min, max]. Goal (issue 44): teacher forward
time per step ≤ 0.6× before. Writes ``routed_teachers.{json,md}`` and the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, replace_readme_block, summarise, timed_into, train_timed  # noqa: E402
from trainers import synthetic_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MARKERS = ("<!-- routed-teachers:start -->", "<!-- routed-teachers:end -->")
GOAL = 0.6
SIZES = {"teacher": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4),
         "student": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2)}
SCENARIOS = {"off-policy (once-per-step pass, GA 2)": dict(gradient_accumulation_steps=2),
             "on the student's samples (lmbda 1)": dict(lmbda=1.0, max_new_tokens=32, divergence="reverse_kl")}


def plan(smoke: bool) -> dict:
    if smoke:
        return dict(vocab_size=256, rows=64, prompt=8, completion=8, batch=4, steps=2,
                    teacher=dict(SIZES["teacher"], hidden_size=64, intermediate_size=128, num_hidden_layers=2),
                    student=dict(SIZES["student"], hidden_size=32, intermediate_size=64))
    return dict(vocab_size=2048, rows=512, prompt=64, completion=64, batch=8, steps=6, **SIZES)


def build(cfg: dict, directory: Path) -> dict:
    """The tokenizer, two teachers of other weights and a student, saved; rows of random tokens, each routed."""
    from datasets import Dataset

    from trl_distill.testing import build_tiny_model

    tokenizer = synthetic_tokenizer(cfg["vocab_size"])
    paths = {"tokenizer": str(directory / "tokenizer")}
    tokenizer.save_pretrained(paths["tokenizer"])
    width = cfg["prompt"] + cfg["completion"] + 64
    for seed, (name, size) in enumerate((("a", "teacher"), ("b", "teacher"), ("student", "student"))):
        paths[name] = str(directory / name)
        build_tiny_model(tokenizer, size, seed=seed, max_position_embeddings=width, **cfg[size]).save_pretrained(
            paths[name])
    generator = torch.Generator().manual_seed(0)

    def text(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(8, 200, (n,), generator=generator))

    rows = [{"prompt": text(cfg["prompt"]), "completion": text(cfg["completion"]), "teacher": "ab"[i % 2]}
            for i in range(cfg["rows"])]
    paths["data"] = Dataset.from_list(rows)
    return paths


def run(paths: dict, cfg: dict, scenario: dict, own_rows: bool, out: Path) -> dict:
    """One run; the teachers' forward seconds and the step seconds of each optimizer step after the first."""
    from transformers import AutoTokenizer

    from trl_distill import DistillationConfig, DistillationTrainer

    args = DistillationConfig(output_dir=str(out), max_steps=cfg["steps"] + 1, per_device_train_batch_size=cfg["batch"],
                              logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                              disable_tqdm=True, seed=0, max_length=cfg["prompt"] + cfg["completion"] + 32,
                              teachers=[f"a={paths['a']}", f"b={paths['b']}"], log_level="warning", **scenario)
    trainer = DistillationTrainer(paths["student"], args=args, train_dataset=paths["data"],
                                  processing_class=AutoTokenizer.from_pretrained(paths["tokenizer"]))
    spent = [0.0]
    for member in trainer.teacher.members.values():
        member.routes_own_rows = own_rows
        member.features = timed_into(member.features, spent)
    # (the once-per-step pass runs in `get_batch_samples`, before `on_step_begin`: inside the step it times)
    return train_timed(trainer, spent)


def markdown(report: dict) -> str:
    lines = ["| scenario | teacher forward / step, before → now | ratio (goal ≤ 0.6) | whole step, ratio |",
             "|---|---|---|---|"]
    for name, row in report["scenarios"].items():
        forward, step = row["ratio"]["teacher_s"], row["ratio"]["step_s"]
        lines.append(f"| {name} | {row['before']['teacher_s'] * 1e3:.0f} → {row['now']['teacher_s'] * 1e3:.0f} ms "
                     f"(medians) | {forward['median']:.2f} [{forward['min']:.2f}, {forward['max']:.2f}] "
                     f"{'met' if forward['median'] <= GOAL else 'missed'} | {step['median']:.2f} "
                     f"[{step['min']:.2f}, {step['max']:.2f}] |")
    m = report["machine"]
    lines += ["", f"One process, {m['cpu']}, {m['cpus']} CPUs, one thread, load average {m['load_average'][0]:.2f} at "
              f"the start; {report['repeats']} repeats of {report['plan']['steps']} timed steps, the variants "
              "alternating; ratio = now / before per repeat, median [min, max]. Two live teachers (4 layers, hidden "
              "256), rows routed half and half, batch 8 of 128 tokens."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models, 1 repeat (under a minute)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--output_dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    repeats = args.repeats or (1 if args.smoke else 3)
    cfg = plan(args.smoke)
    report = {"plan": {k: v for k, v in cfg.items() if k not in ("teacher", "student")}, "sizes": SIZES,
              "repeats": repeats, "machine": machine(), "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(cfg, Path(tmp))
        for name, scenario in SCENARIOS.items():
            runs = {"now": [], "before": []}
            for repeat in range(repeats):
                order = ("now", "before") if repeat % 2 == 0 else ("before", "now")
                for variant in order:
                    runs[variant].append(run(paths, cfg, scenario, variant == "now", Path(tmp) / f"r{repeat}"))
                    print(name, variant, runs[variant][-1], flush=True)
            ratio = {key: summarise([n[key] / b[key] for n, b in zip(runs["now"], runs["before"], strict=True)])
                     for key in ("teacher_s", "step_s")}
            report["scenarios"][name] = {
                "runs": runs, "ratio": ratio,
                **{v: {k: statistics.median(r[k] for r in runs[v]) for k in ("teacher_s", "step_s")} for v in runs}}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routed_teachers.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "routed_teachers.md").write_text("# Routed teachers: each on its own rows\n\n" + table + "\n")
    if not args.smoke:
        replace_readme_block(MARKERS, table)
    print(table)


if __name__ == "__main__":
    main()
