"""At the shapes users distil with: a 128k vocabulary, rows of 1024 and 4096 tokens, bf16 and fp32, 2 processes.

    python benchmarks/real_shapes.py [--smoke] [--output_dir DIR] [--repeats N] [--cases 1024/bf16/ga1 ...]
    python benchmarks/real_shapes.py --report_only [--output_dir DIR]   # tables again from DIR/real_shapes.json

The headline of `make bench` (the 128-token configuration, `benchmarks/trainers.py`, is its second table). Random-init
Llama models with one synthetic 128 000-token vocabulary (teacher ~144M parameters, student ~69M: vocabulary-
dominated, like real small models; the teacher's non-embedding size is ~4x the student's), saved once. Every case
(sequence length / dtype / gradient accumulation) runs the same four contenders, each a fresh 2-process launch of
`benchmarks/trainer_worker.py` on the same random-token rows (a prompt of ~10 %, masked from the loss):

* ours, student ZeRO-2 + teacher ZeRO-3 (the teacher once per optimizer step),
* TRL's `GKDTrainer` with a ZeRO-2 student (which replicates its teacher on every rank),
* ZeRO-3 for both, ours and GKD's.

`trl.DistillationTrainer` (TRL 1.16) cannot run this work: it is on-policy only. Within a repeat the contenders of a
case run back to back, in reverse order every other repeat; ratios are taken repeat by repeat. Each process's heap is
capped (`--memory_cap_mib`, `RLIMIT_DATA`) so that a contender that does not fit fails with its own out-of-memory
error, which the table reports, instead of the machine's OOM killer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import trainers as small  # benchmarks/trainers.py: the models, the launch, the per-run figures
from _common import ROOT, machine, replace_readme_block
from _common import median_range as _mmm

CONTENDERS = {  # name: label; `trainers.CONTENDERS[name]` is the launch
    "ours_z2_z3": "ours, ZeRO-2 student + ZeRO-3 teacher",
    "gkd_z2": "GKD, ZeRO-2 student (teacher replicated)",
    "ours_z3_z3": "ours, ZeRO-3 for both",
    "gkd_z3": "GKD, ZeRO-3 for both",
}
# key: (denominator, metric, comparison, goal, what it says); the numerator is always ours_z2_z3
RATIOS = {
    "tokens_vs_gkd_z2": ("gkd_z2", "tokens_per_s", ">=", 1.5, "tokens/s vs GKD, ZeRO-2 student"),
    "tokens_vs_zero3_both": ("ours_z3_z3", "tokens_per_s", ">=", 1.5, "tokens/s vs ours, ZeRO-3 for both"),
    "tokens_vs_gkd_z3": ("gkd_z3", "tokens_per_s", ">=", 1.5, "tokens/s vs GKD, ZeRO-3 for both"),
    "peak_vs_gkd_z2": ("gkd_z2", "peak_rss_mib", "<=", 0.45, "peak RSS per rank vs GKD, ZeRO-2 student"),
    "teacher_bytes_vs_gkd_z2": ("gkd_z2", "teacher_mib", "<=", 0.55, "teacher bytes per rank vs GKD, ZeRO-2"),
}
METRICS = ("tokens_per_s", "step_s", "peak_rss_mib", "teacher_mib", "train_loss")


def plan(smoke: bool) -> dict:
    """Models, the cases and their steps. A case is ``"<tokens>/<dtype>/ga<accumulation>"``, micro batch 1."""
    if smoke:
        return {"vocab_size": 2048, "repeats": 1, "timeout_s": 300, "memory_cap_mib": 0,
                "cases": ["64/fp32/ga1", "64/bf16/ga2"], "steps": {1: (2, 1), 2: (2, 1)},
                "teacher": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
                "student": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)}
    return {"vocab_size": 128000, "repeats": 2, "timeout_s": 1800, "memory_cap_mib": 10240,
            # gradient accumulation 8 at 4096 tokens would take ~2 hours more on 2 cores: pass it in --cases
            "cases": ["1024/fp32/ga1", "1024/bf16/ga1", "4096/fp32/ga1", "4096/bf16/ga1", "1024/fp32/ga8",
                      "1024/bf16/ga8"],
            "steps": {1: (3, 1), 8: (2, 1)},  # accumulation: (optimizer steps, of which warm-up)
            "teacher": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8),
            "student": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4),
            }  # fmt: skip


def parse_case(case: str) -> tuple[int, str, int]:
    tokens, dtype, accumulation = case.split("/")
    if dtype not in ("fp32", "bf16") or not accumulation.startswith("ga"):
        raise ValueError(f"case {case!r}: expected <tokens>/<fp32|bf16>/ga<accumulation>, e.g. 1024/bf16/ga8")
    return int(tokens), dtype, int(accumulation[2:])


def case_config(cfg: dict, case: str) -> dict:
    """`trainers.run_contender`'s configuration for one case (micro batch 1)."""
    tokens, _, accumulation = parse_case(case)
    steps, warmup = cfg["steps"].get(accumulation, cfg["steps"][max(cfg["steps"])])
    run = {"batch": 1, "accumulation": accumulation, "steps": steps, "warmup": warmup}
    prompt = max(1, tokens // 10)
    return {"vocab_size": cfg["vocab_size"], "seq_len": tokens, "prompt_len_range": [prompt * 3 // 4, prompt * 5 // 4],
            **run, "timeout_s": cfg["timeout_s"]}  # fmt: skip


def run_case(name: str, case: str, cfg: dict, models: dict, out: Path) -> dict:
    _, dtype, _ = parse_case(case)
    extra = {"bf16": dtype == "bf16", "memory_cap_mib": cfg["memory_cap_mib"], "log_distill_metrics": False,
             "split": True}
    result = small.run_contender(name, case_config(cfg, case), models, out, extra)
    if "metrics" in result:
        got = result["metrics"]
        got["peak_rss_mib"] = max(got["load_peak_mib"], got["train_peak_mib"])
    else:
        result["out_of_memory"] = "can't allocate memory" in result["error"] or "MemoryError" in result["error"]
    return result


def summarize(runs: dict) -> dict:
    out = {}
    for case, by_name in runs.items():
        out[case] = {}
        for name, samples in by_name.items():
            ok = [s["metrics"] for s in samples if "metrics" in s]
            row = {"ok_repeats": len(ok), "failed": len(samples) - len(ok),
                   "out_of_memory": sum(bool(s.get("out_of_memory")) for s in samples)}  # fmt: skip
            for metric in METRICS:
                if values := [m[metric] for m in ok]:
                    row[metric] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            out[case][name] = row
    return out


def ratios(runs: dict) -> dict:
    out = {}
    for case, by_name in runs.items():
        out[case] = {}
        for key, (den, metric, op, goal, what) in RATIOS.items():
            pairs = [a["metrics"][metric] / b["metrics"][metric] for a, b in zip(by_name.get("ours_z2_z3", []),
                     by_name.get(den, [])) if "metrics" in a and "metrics" in b and b["metrics"][metric]]  # fmt: skip
            row = {"denominator": den, "metric": metric, "what": what, "goal_op": op, "goal": goal, "per_repeat": pairs}
            if pairs:
                row.update(median=statistics.median(pairs), min=min(pairs), max=max(pairs))
                row["met"] = row["median"] >= goal if op == ">=" else row["median"] <= goal
            elif any(s.get("out_of_memory") for s in by_name.get(den, [])):
                row["note"] = f"{den} ran out of memory"
            out[case][key] = row
    return out


# ---- report -------------------------------------------------------------------------------------------------
def _cell(row: dict, metric: str, fmt: str = ".0f") -> str:
    if metric in row:
        return _mmm(row[metric], fmt)
    return "out of memory" if row.get("out_of_memory") else "failed" if row.get("failed") else "n/a"


def header(rep: dict) -> list[str]:
    c, mach, mod, load = rep["plan"], rep["machine"], rep["models"], rep["load_average_1min"]
    return [
        f"Teacher {mod['teacher_params'] / 1e6:.0f}M parameters, student {mod['student_params'] / 1e6:.0f}M "
        f"(random-init Llama, one {c['vocab_size']}-token vocabulary), 2 processes, micro batch 1, a prompt of ~10 % "
        f"masked from the loss; forward KL at T = 1. Heap capped at {c['memory_cap_mib']} MiB per process. "
        f"{c['repeats']} repeat(s), median [min, max]; ratios repeat by repeat. "
        f"Machine: {mach['cpu']}, {mach['cpus']} CPUs, torch {mach['torch']}, trl {mach['trl']}, deepspeed "
        f"{mach['deepspeed']}, {mach['date'][:16]}; {rep['total_runtime_s'] / 60:.0f} min in all; 1-minute load "
        f"average {load['start']:.1f} at the start, {load['end']:.1f} at the end (2 = both cores busy)."
        + ("" if len(rep.get("parts", ())) < 2 else " Run in parts: " + "; ".join(
            f"{', '.join(part['cases'])} on {part['date'][:16]}" for part in rep["parts"]) + "."),
    ]


def headline_table(rep: dict) -> list[str]:
    """Per case: tokens/s and peak RSS of each contender, and ours' ratios against each."""
    lines = ["| case (tokens / dtype / accumulation) | " + " | ".join(f"{n} tokens/s" for n in CONTENDERS)
             + " | ours vs GKD-ZeRO-2 | ours vs ZeRO-3 both (ours, GKD) | peak RSS MiB ours / GKD-ZeRO-2 |",
             "|---|" + "---|" * (len(CONTENDERS) + 3)]  # fmt: skip
    for case, rows in rep["summary"].items():
        r = rep["ratios"][case]
        peak = f"{_cell(rows.get('ours_z2_z3', {}), 'peak_rss_mib')} / {_cell(rows.get('gkd_z2', {}), 'peak_rss_mib')}"
        peak += f" ({_ratio(r['peak_vs_gkd_z2'])})" if "median" in r["peak_vs_gkd_z2"] else ""
        lines.append(f"| {case} | " + " | ".join(_cell(rows.get(n, {}), "tokens_per_s") for n in CONTENDERS)
                     + f" | {_ratio(r['tokens_vs_gkd_z2'])} | {_ratio(r['tokens_vs_zero3_both'])}, "
                     f"{_ratio(r['tokens_vs_gkd_z3'])} | {peak} |")  # fmt: skip
    return lines


def _ratio(row: dict) -> str:
    if "median" not in row:
        return row.get("note", "n/a")
    mark = "" if row["met"] else " **missed**"
    return f"{row['median']:.2f}× [{row['min']:.2f}, {row['max']:.2f}]{mark}"


def markdown(rep: dict) -> str:
    lines = ["# At the shapes users run: 128k vocabulary, 1024 and 4096 tokens, bf16 and fp32", "", *header(rep), "",
             *headline_table(rep), "", "Goals (ours, ZeRO-2 student + ZeRO-3 teacher): "
             + "; ".join(f"{w} {op} {g}" for _, _, op, g, w in RATIOS.values()) + ".", ""]  # fmt: skip
    for case, rows in rep["summary"].items():
        lines += [f"## {case}", "", "| contender | tokens/s | step s | peak RSS MiB per rank | teacher MiB per rank "
                  "| train loss |", "|---|---|---|---|---|---|"]  # fmt: skip
        for name, row in rows.items():
            step = {k: v for k, v in row["step_s"].items()} if "step_s" in row else None
            lines.append(f"| {CONTENDERS[name]} | {_cell(row, 'tokens_per_s')} | {_mmm(step, '.1f')} "
                         f"| {_cell(row, 'peak_rss_mib')} | {_cell(row, 'teacher_mib')} "
                         f"| {_cell(row, 'train_loss', '.4f')} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


MARKERS = ("<!-- bench:real-shapes:start -->", "<!-- bench:real-shapes:end -->")


def write_outputs(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_shapes.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "real_shapes.md").write_text(markdown(report))
    if not report["smoke"] and out.resolve() == (ROOT / "benchmarks" / "results").resolve():
        block = "\n".join([*header(report), "", *headline_table(report)])
        replace_readme_block(MARKERS, block, ROOT / "README.md")


def _part(rep: dict) -> dict:
    return {"date": rep["machine"]["date"], "cases": list(rep["runs"]), "total_runtime_s": rep["total_runtime_s"],
            "load_average_1min": rep["load_average_1min"]}


def merged(old: dict, new: dict) -> dict:
    """`new`'s cases added to (or replacing) `old`'s, the same models and settings; the cases in the plan's order,
    each part of the run (its date, cases, time and load) recorded under ``parts``."""
    for key in ("models", "smoke"):
        if old[key] != new[key]:
            raise SystemExit(f"--merge: this run's {key} ({new[key]}) are not those of the results there ({old[key]})")
    order = [c for c in plan(new["smoke"])["cases"] if c in old["runs"] or c in new["runs"]]
    order += [c for c in [*old["runs"], *new["runs"]] if c not in order]
    runs = {c: new["runs"][c] if c in new["runs"] else old["runs"][c] for c in order}
    parts = [*old.get("parts", [_part(old)]), _part(new)]
    load = {"start": parts[0]["load_average_1min"]["start"], "end": parts[-1]["load_average_1min"]["end"]}
    return {**new, "plan": {**new["plan"], "cases": order}, "runs": runs, "summary": summarize(runs),
            "ratios": ratios(runs), "parts": parts, "load_average_1min": load,
            "total_runtime_s": sum(part["total_runtime_s"] for part in parts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models and rows, 1 repeat (about a minute)")
    ap.add_argument("--output_dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--cases", nargs="+", help="e.g. 1024/bf16/ga1 4096/fp32/ga8 (default: the plan's)")
    ap.add_argument("--only", nargs="+", choices=list(CONTENDERS), help="run only these contenders")
    ap.add_argument("--memory_cap_mib", type=int, help="RLIMIT_DATA per process (0: none)")
    ap.add_argument("--report_only", action="store_true", help="rewrite the tables from output_dir/real_shapes.json")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other cases of output_dir/real_shapes.json: this run adds (or redoes) --cases")
    args = ap.parse_args()
    out = Path(args.output_dir)
    if args.report_only:
        report = json.loads((out / "real_shapes.json").read_text())
        report.update(summary=summarize(report["runs"]), ratios=ratios(report["runs"]))
        return write_outputs(report, out)
    cfg = plan(args.smoke)
    for key in ("repeats", "cases", "memory_cap_mib"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    for case in cfg["cases"]:
        parse_case(case)
    names = [n for n in CONTENDERS if not args.only or n in args.only]
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    runs: dict = {case: {n: [] for n in names} for case in cfg["cases"]}
    with tempfile.TemporaryDirectory(prefix="trl_distill_real_shapes_") as tmp:
        longest = max(parse_case(c)[0] for c in cfg["cases"])
        models = small.build_models({**cfg, "seq_len": longest}, Path(tmp) / "models")
        print(f"models: teacher {models['teacher_params']:,} student {models['student_params']:,} parameters",
              flush=True)  # fmt: skip
        for r in range(cfg["repeats"]):
            for case in cfg["cases"]:
                for name in names if r % 2 == 0 else names[::-1]:
                    res = run_case(name, case, cfg, models, Path(tmp) / f"r{r}" / case.replace("/", "_") / name)
                    runs[case][name].append(res)
                    got = res.get("metrics")
                    print(f"repeat {r} {case} {name}: {res['wall_s']:.0f} s, " + (
                        f"{got['tokens_per_s']:.0f} tokens/s, peak {got['peak_rss_mib']:.0f} MiB" if got else
                        ("OUT OF MEMORY" if res["out_of_memory"] else "FAILED: " + res["error"][-800:])),
                        flush=True)  # fmt: skip
    report = {
        "benchmark": "real_shapes", "smoke": args.smoke, "plan": cfg, "machine": machine(),
        "models": {k: v for k, v in models.items() if k.endswith("_params")},
        "contenders": {n: small._contender_info(n) for n in names},
        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "summary": summarize(runs), "ratios": ratios(runs), "runs": runs,
        "total_runtime_s": time.perf_counter() - t_start,
    }  # fmt: skip
    if args.merge:
        report = merged(json.loads((out / "real_shapes.json").read_text()), report)
    write_outputs(report, out)
    print(markdown(report))
    print(f"wrote {out}/real_shapes.{{json,md}} in {report['total_runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
