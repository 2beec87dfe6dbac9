"""The tables `trainers.py` writes into the pages from its JSON: the full one (docs/benchmarks.md) and the README's
short form."""

from __future__ import annotations

from pathlib import Path

from _common import ROOT, replace_readme_block
from _common import median_range as _mmm

README_START, README_END = "<!-- bench:trainers:start -->", "<!-- bench:trainers:end -->"


def readme_block(rep: dict) -> str:
    """The README's headline table (between its markers), generated from the JSON like trainers.md."""
    mach, load = rep["machine"], rep.get("load_average_1min", {})
    lines = [
        f"Run of {mach['date'][:10]}: {rep['total_runtime_s']:.0f} s on {mach['cpus']} CPUs, 1-minute load "
        f"average {load.get('start', float('nan')):.1f} at the start and {load.get('end', float('nan')):.1f} at the "
        "end (2 = both cores busy). Median [min, max] over repeats, ratios repeat by repeat:",
        "",
        "| measure | ours | vs | ratio | goal | |",
        "|---|---|---|---|---|---|",
    ]
    for r in rep["ratios"].values():
        goal = f"{r['goal_op']} {r['goal']}" if r["goal"] is not None else ""
        met = "" if "met" not in r else ("met" if r["met"] else "**missed**")
        lines.append(f"| {r['what']} | {r['numerator']} | {r['denominator'] or '(itself)'} | {_mmm(r, '.2f')} | {goal} "
                     f"| {met} |")
    return "\n".join(lines)


def update_readme(rep: dict, readme: Path = ROOT / "docs" / "benchmarks.md") -> bool:
    """Replace the block between the README's markers; False when the README has no markers."""
    return replace_readme_block((README_START, README_END), readme_block(rep), readme)


SUMMARY_MARKERS = ("<!-- bench:small-shape:start -->", "<!-- bench:small-shape:end -->")
SUMMARY_RATIOS = ("tokens_vs_gkd_z2", "ga8_tokens_vs_gkd_z2", "tokens_vs_ours_z3_z3", "teacher_bytes_vs_gkd_z2",
                  "train_peak_vs_gkd_z2")


def summary_block(rep: dict) -> str:
    """The README's short form of the 128-token table: five ratios of ours to the contender a user would pick."""
    models, cfg = rep["models"], rep["plan"]
    lines = [f"| ours (ZeRO-2 student + ZeRO-3 teacher) vs, at {cfg['seq_len']} tokens (teacher "
             f"{models['teacher_params'] / 1e6:.0f}M, student {models['student_params'] / 1e6:.0f}M, "
             f"{cfg['vocab_size'] // 1000}k vocabulary, fp32, {cfg['repeats']} repeats, {rep['machine']['date'][:10]}) "
             "| ratio, median [min, max] | goal |", "|---|---|---|"]
    for key in SUMMARY_RATIOS:
        r = rep["ratios"][key]
        goal = "" if r["goal"] is None else f"{r['goal_op']} {r['goal']}, " + ("met" if r["met"] else "**missed**")
        lines.append(f"| {r['denominator']}: {r['what']} | {_mmm(r, '.2f')} | {goal} |")
    return "\n".join(lines)
