"""What the logged diagnostics (`log_distill_metrics`: agreement, KL, CEs, entropies, measured inside the fused loss)
cost: step time of the same run without them, with them as by default (measured on the logged steps; a log every 10
steps here) and measured on every step (`distill_metrics_every_step`, the upper bound), 2 processes, ZeRO-2
student + ZeRO-3 teacher, at the quickstart's size and at `make bench`'s.

    python benchmarks/metrics_cost.py [--smoke] [--repeats N] [--output_dir DIR]

Each run is a fresh launch of `benchmarks/trainer_worker.py` (the `make bench` worker: synthetic batches, fp32, one
thread per rank, the first steps untimed). Within a repeat the two variants run back to back, in reverse order
every other repeat; each cost is taken repeat by repeat (step time with / without − 1) and summarised as median
[min, max]. Goal: ≤ 3 % (the default). Writes ``metrics_cost.{json,md}`` and the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, replace_readme_block  # noqa: E402
from trainers import build_models, plan, run_contender  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MARKERS = ("<!-- metrics-cost:start -->", "<!-- metrics-cost:end -->")
GOAL = 0.03
LOGGING_STEPS = 10
# variant: the worker's settings (every variant logs every LOGGING_STEPS steps)
VARIANTS = {"off": {"log_distill_metrics": False}, "logged": {},
            "every_step": {"distill_metrics_every_step": True}}


def sizes(smoke: bool) -> dict[str, dict]:
    """``quickstart``: the quickstart's models and batch (examples/quickstart.py, its recipe); ``bench``: `make
    bench`'s plan."""
    bench = plan(smoke)
    quickstart = {**bench, "vocab_size": 2048, "seq_len": 128, "prompt_len_range": [32, 96], "batch": 8,
                  "teacher": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4),
                  "student": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2)}
    if smoke:
        quickstart.update(vocab_size=512, seq_len=32, prompt_len_range=[8, 24], batch=2)
    else:
        bench.update(steps=10, warmup=2)
        quickstart.update(steps=30, warmup=5)
    return {"quickstart": quickstart, "bench": bench}


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def markdown(report: dict) -> str:
    lines = [f"| size | step time without | cost, default (logged steps, 1 log / {LOGGING_STEPS} steps) | cost, every "
             "step (upper bound) | goal ≤ 3 % (default) |", "|---|---|---|---|---|"]
    for name, row in report["sizes"].items():
        if "error" in row:
            lines.append(f"| {name} | failed: {row['error'][:80]} | | | |")
            continue
        cost = {k: row["cost"][k] for k in ("logged", "every_step")}
        cells = [f"{c['median']:+.1%} [{c['min']:+.1%}, {c['max']:+.1%}]" for c in cost.values()]
        lines.append(f"| {name} ({row['shape']}) | {row['step_s']['off']['median'] * 1e3:.1f} ms | {cells[0]} | "
                     f"{cells[1]} | {'met' if cost['logged']['median'] <= GOAL else 'missed'} |")
    m = report["machine"]
    lines += ["", f"{m['cpu']}, {m['cpus']} CPUs, load average {m['load_average'][0]:.2f} at the start; "
              f"{report['repeats']} repeats, variants interleaved; cost = step time / the run without − 1, per "
              "repeat, median [min, max]."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models, 1 repeat (about a minute)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--output_dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.smoke else 3)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "repeats": repeats, "smoke": args.smoke, "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in sizes(args.smoke).items():
            models = build_models(cfg, Path(tmp) / name)
            times = {variant: [] for variant in VARIANTS}
            failed = None
            for repeat in range(repeats):
                order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
                for variant in order:
                    run = run_contender("ours_z2_z3", cfg, models, Path(tmp) / f"{name}_{variant}_{repeat}",
                                        {**VARIANTS[variant], "logging_steps": LOGGING_STEPS})
                    if "error" in run:
                        failed = run["error"]
                        break
                    times[variant].append(run["metrics"]["step_s"])
                    print(f"{name} repeat {repeat} {variant}: {run['metrics']['step_s'] * 1e3:.1f} ms/step", flush=True)
                if failed:
                    break
            if failed:
                report["sizes"][name] = {"error": failed}
                continue
            report["sizes"][name] = {
                "shape": f"V={cfg['vocab_size']}, {cfg['seq_len']} tokens, batch {cfg['batch']}, teacher "
                         f"{models['teacher_params'] / 1e6:.1f}M, student {models['student_params'] / 1e6:.1f}M",
                "step_s": {v: summarise(t) for v, t in times.items()},
                "cost": {v: summarise([a / b - 1 for a, b in zip(times[v], times["off"], strict=True)])
                         for v in ("logged", "every_step")},
                "per_repeat": times}
    (out / "metrics_cost.json").write_text(json.dumps(report, indent=1))
    (out / "metrics_cost.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    if not args.smoke:
        replace_readme_block(MARKERS, markdown(report))


if __name__ == "__main__":
    main()
