"""Side by side with TRL: teacher memory per rank, peak RSS and off-policy KD throughput of
`trl_distill.DistillationTrainer` vs `trl.experimental.gkd.GKDTrainer` and a bare PyTorch loop.

    python benchmarks/trainers.py [--smoke] [--output_dir DIR] [--repeats N] [--steps N] [--warmup N]
    python benchmarks/trainers.py --report_only [--output_dir DIR]   # tables and plot again from DIR/trainers.json

Random-init Llama models (teacher ~106M, student ~20M parameters, one synthetic 32k-token vocabulary) are saved
once; every contender loads them from disk, trains on the same random-token batches (prompt masked, collated by
one function) with the same batch size, fp32, one torch thread per rank. Each run is a fresh launch of
`benchmarks/trainer_worker.py` (see there for what it measures). Within a repeat all contenders run back to back,
in reverse order every other repeat; every ratio is taken repeat by repeat, then summarised as median [min, max].
Timing excludes the first `--warmup` optimizer steps.

`trl.DistillationTrainer` (TRL 1.16) is not a contender: it is on-policy only (the student generates from
prompts), so it cannot run this off-policy workload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "trainer_worker.py"
sys.path.insert(0, str(WORKER.parent))  # benchmarks/, also when a test loads this file by path
from _common import machine, replace_readme_block  # noqa: E402
from _common import median_range as _mmm  # noqa: E402
from trainers_tables import README_END, README_START, SUMMARY_MARKERS, SUMMARY_RATIOS, summary_block, update_readme  # noqa: E402,F401

Z2, Z3 = str(ROOT / "configs/deepspeed/zero2_student.json"), str(ROOT / "configs/deepspeed/zero3_student.json")
FSDP2 = "fsdp2"  # in place of a DeepSpeed config: the student under accelerate's FSDP2 (`trainer_worker.FSDP2_ARGS`)
MIB = 1 << 20

# name: (trainer, student DeepSpeed config or FSDP2, processes, label). Listed so that compared runs are neighbours.
CONTENDERS = {
    "gkd_1p": ("gkd", None, 1, "GKD, 1 process, no DeepSpeed"),
    "ours_1p": ("ours", None, 1, "ours, 1 process, no DeepSpeed"),
    "bare_1p": ("bare", None, 1, "bare PyTorch loop, 1 process"),
    "gkd_z2": ("gkd", Z2, 2, "GKD, student ZeRO-2 (teacher stage 0, replicated)"),
    "ours_z2_z3": ("ours", Z2, 2, "ours, student ZeRO-2 + teacher ZeRO-3"),
    "ours_z3_z3": ("ours", Z3, 2, "ours, ZeRO-3 for both"),
    "gkd_z3": ("gkd", Z3, 2, "GKD, ZeRO-3 for both"),
    "ours_fsdp2": ("ours", FSDP2, 2, "ours, FSDP2 student + FSDP2 teacher"),
    "gkd_fsdp2": ("gkd", FSDP2, 2, "GKD, FSDP2 student (teacher replicated)"),
    # gradient accumulation 8, micro batch 1 (`plan()["ga8"]`): the teacher once per optimizer step pays off here
    "ours_1p_ga8": ("ours", None, 1, "ours, 1 process, no DeepSpeed, grad. accum. 8"),
    "gkd_z2_ga8": ("gkd", Z2, 2, "GKD, student ZeRO-2, grad. accum. 8"),
    "ours_z2_z3_ga8": ("ours", Z2, 2, "ours, ZeRO-2 + teacher ZeRO-3, grad. accum. 8"),
    "ours_z3_z3_ga8": ("ours", Z3, 2, "ours, ZeRO-3 for both, grad. accum. 8"),
    "ours_z2_z3_micro_ga8": ("ours_per_micro_batch", Z2, 2, "ours, teacher per micro-batch (before), grad. accum. 8"),
}
ACCUMULATED = "_ga8"  # contenders named so run with `plan()["ga8"]`'s batch shape
# name: (numerator, denominator, metric, goal comparison, goal, what it says)
RATIOS = {
    "teacher_bytes_vs_gkd_z2": ("ours_z2_z3", "gkd_z2", "teacher_mib", "<=", 0.55, "teacher bytes per rank"),
    "load_peak_vs_gkd_z2": ("ours_z2_z3", "gkd_z2", "load_peak_mib", "<=", 0.6, "peak RSS per rank, loading"),
    "load_growth_vs_gkd_z2": ("ours_z2_z3", "gkd_z2", "load_increment_mib", "<=", 0.6, "RSS growth per rank, loading"),
    "train_peak_vs_gkd_z2": ("ours_z2_z3", "gkd_z2", "train_peak_mib", None, None, "peak RSS per rank, training"),
    "tokens_vs_gkd_z2": ("ours_z2_z3", "gkd_z2", "tokens_per_s", ">=", 1.0, "tokens/s, 2 processes"),
    "tokens_vs_ours_z3_z3": ("ours_z2_z3", "ours_z3_z3", "tokens_per_s", ">=", 1.5, "tokens/s vs ZeRO-3 for both"),
    "tokens_vs_gkd_z3": ("ours_z2_z3", "gkd_z3", "tokens_per_s", ">=", 1.5, "tokens/s vs GKD ZeRO-3 for both"),
    "fsdp2_tokens_vs_ours_z2_z3": ("ours_fsdp2", "ours_z2_z3", "tokens_per_s", ">=", 1.0,
                                   "tokens/s, our FSDP2 pair / our DeepSpeed pair"),
    "fsdp2_train_peak_vs_ours_z2_z3": ("ours_fsdp2", "ours_z2_z3", "train_peak_mib", "<=", 1.0,
                                       "peak RSS per rank, training, FSDP2 pair / DeepSpeed pair"),
    "fsdp2_tokens_vs_gkd_fsdp2": ("ours_fsdp2", "gkd_fsdp2", "tokens_per_s", None, None, "tokens/s vs GKD with FSDP2"),
    "fsdp2_teacher_bytes_vs_gkd_fsdp2": ("ours_fsdp2", "gkd_fsdp2", "teacher_mib", "<=", 0.55,
                                         "teacher bytes per rank vs GKD with FSDP2"),
    "tokens_1p_vs_gkd_1p": ("ours_1p", "gkd_1p", "tokens_per_s", ">=", 1.2, "tokens/s, 1 process"),
    "step_time_vs_bare": ("ours_1p", "bare_1p", "step_s", "<=", 1.10, "step time vs bare loop, 1 process"),
    "gkd_step_time_vs_bare": ("gkd_1p", "bare_1p", "step_s", None, None, "GKD step time vs bare loop"),
    "teacher_load_growth": ("ours_z2_z3", None, "teacher_load_fraction", "<=", 0.55,
                            "teacher-attributable RSS growth, loading, / teacher bytes"),
    "ga8_tokens_vs_gkd_z2": ("ours_z2_z3_ga8", "gkd_z2_ga8", "tokens_per_s", ">=", 1.2, "tokens/s, grad. accum. 8"),
    "ga8_teacher_bytes_vs_gkd_z2": ("ours_z2_z3_ga8", "gkd_z2_ga8", "teacher_mib", "<=", 0.55,
                                    "teacher bytes per rank, grad. accum. 8"),
    "ga8_tokens_vs_ours_z3_z3": ("ours_z2_z3_ga8", "ours_z3_z3_ga8", "tokens_per_s", ">=", 1.3,
                                 "tokens/s vs ZeRO-3 for both, grad. accum. 8"),
    "ga8_step_pass_gain": ("ours_z2_z3_ga8", "ours_z2_z3_micro_ga8", "tokens_per_s", None, None,
                           "tokens/s, teacher once per step / per micro-batch, grad. accum. 8"),
    "ga8_step_time_2p_vs_1p": ("ours_z2_z3_ga8", "ours_1p_ga8", "step_s", "<=", 1.15,
                               "step time, 2 processes / 1, same per-rank batch, grad. accum. 8"),
}
METRICS = (
    "tokens_per_s", "step_s", "teacher_mib", "load_peak_mib", "load_increment_mib", "train_peak_mib", "train_loss",
    "teacher_load_fraction",
)  # fmt: skip


def plan(smoke: bool) -> dict:
    """The run's shape. `batch`/`steps`/`warmup` for the contenders without gradient accumulation; `ga8` for those
    named ``*_ga8`` (micro batch 1, 8 micro-batches per optimizer step; 4 in --smoke)."""
    if smoke:
        return {"vocab_size": 512, "seq_len": 32, "prompt_len_range": [8, 24], "batch": 2, "steps": 3, "warmup": 1,
                "ga8": {"batch": 1, "accumulation": 4, "steps": 3, "warmup": 1}, "repeats": 1, "timeout_s": 240,
                "teacher": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
                "student": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)}
    return {"vocab_size": 32000, "seq_len": 128, "prompt_len_range": [32, 96], "batch": 2, "steps": 8, "warmup": 2,
            "ga8": {"batch": 1, "accumulation": 8, "steps": 5, "warmup": 1}, "repeats": 3, "timeout_s": 600,
            "teacher": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12),
            "student": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4),
            }  # fmt: skip


# ---- models -------------------------------------------------------------------------------------------------
def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer over `vocab_size` synthetic tokens (4 specials first): both models share it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trl_distill.testing import SPECIAL_TOKENS

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def build_models(cfg: dict, directory: Path) -> dict:
    """Save the tokenizer, teacher and student under `directory`; return their paths and parameter counts."""
    from trl_distill.testing import build_tiny_model

    tokenizer = synthetic_tokenizer(cfg["vocab_size"])
    out = {"tokenizer": str(directory / "tokenizer")}
    tokenizer.save_pretrained(out["tokenizer"])
    for seed, size in enumerate(("teacher", "student")):
        model = build_tiny_model(tokenizer, size, seed=seed, max_position_embeddings=cfg["seq_len"], **cfg[size])
        out[size] = str(directory / size)
        out[f"{size}_params"] = sum(p.numel() for p in model.parameters())
        model.save_pretrained(out[size])
        del model
    return out


# ---- runs ---------------------------------------------------------------------------------------------------
def shape(name: str, cfg: dict) -> dict:
    """``batch``, ``accumulation``, ``steps`` and ``warmup`` of contender `name`."""
    if name.endswith(ACCUMULATED):
        return cfg["ga8"]
    return {"batch": cfg["batch"], "accumulation": cfg.get("accumulation", 1), "steps": cfg["steps"],
            "warmup": cfg["warmup"]}


def run_contender(name: str, cfg: dict, models: dict, out: Path, extra: dict | None = None) -> dict:
    """Launch one run of `name` (``extra``: more worker settings, e.g. ``log_distill_metrics``); return its per-rank
    records (or the error) and its wall time."""
    from trl_distill.testing import launch, read_rank_records

    trainer, deepspeed, nproc, _ = CONTENDERS[name]
    run = shape(name, cfg)
    spec = {
        "trainer": trainer, "deepspeed": None if deepspeed == FSDP2 else deepspeed, "fsdp2": deepspeed == FSDP2,
        "out": str(out), "student": models["student"],
        "teacher": models["teacher"], "tokenizer": models["tokenizer"], "vocab_size": cfg["vocab_size"],
        "seq_len": cfg["seq_len"], "prompt_len_range": cfg["prompt_len_range"], **run, "data_seed": 0,
        "num_examples": run["steps"] * run["batch"] * run["accumulation"] * nproc, **(extra or {}),
    }  # fmt: skip
    t0 = time.perf_counter()
    try:
        if nproc == 1:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
            proc = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], env=env, cwd=ROOT, text=True,
                                  capture_output=True, timeout=cfg["timeout_s"])  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
        else:
            launch(WORKER, json.dumps(spec), nproc=nproc, timeout=cfg["timeout_s"], cwd=ROOT,
                   env={"PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"})  # fmt: skip
        ranks = read_rank_records(out, nproc)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as err:
        return {"error": str(err)[-4000:], "wall_s": time.perf_counter() - t0}
    return {"metrics": metrics(ranks, cfg, run, models["student_params"] * 4 / MIB), "ranks": [_slim(r) for r in ranks],
            "wall_s": time.perf_counter() - t0}


def _contender_info(name: str) -> dict:
    trainer, deepspeed, nproc, label = CONTENDERS[name]
    config = os.path.relpath(deepspeed, ROOT) if deepspeed not in (None, FSDP2) else deepspeed
    return {"trainer": trainer, "student_deepspeed": config, "processes": nproc, "label": label}


def _slim(rank: dict) -> dict:
    return {k: v for k, v in rank.items() if k != "spec"}


def metrics(ranks: list[dict], cfg: dict, run: dict, student_mib: float) -> dict:
    """Per-run figures; memory figures are the largest over ranks (each rank's value is kept in `per_rank`).
    `teacher_load_fraction`: RSS growth while loading less the student's bytes (fp32), over the teacher's bytes."""
    world = len(ranks)
    seconds = max(r["timed_seconds"] for r in ranks)  # the slowest rank sets the pace
    steps = ranks[0]["timed_steps"]
    tokens = steps * run["batch"] * run["accumulation"] * cfg["seq_len"] * world
    per_rank = {
        "teacher_mib": [r["teacher_bytes"]["held"] / MIB for r in ranks],
        "load_peak_mib": [r["memory"]["teacher_ready"]["VmHWM"] / MIB for r in ranks],
        "load_increment_mib": [
            (r["memory"]["teacher_ready"]["VmHWM"] - r["memory"]["before_trainer"]["VmRSS"]) / MIB for r in ranks
        ],
        "train_peak_mib": [r["memory"]["after_train"]["VmHWM"] / MIB for r in ranks],
        "start_rss_mib": [r["memory"]["start"]["VmRSS"] / MIB for r in ranks],
        "before_trainer_rss_mib": [r["memory"]["before_trainer"]["VmRSS"] / MIB for r in ranks],
    }
    total_mib = ranks[0]["teacher_bytes"]["total"] / MIB
    per_rank["teacher_load_fraction"] = [(g - student_mib) / total_mib for g in per_rank["load_increment_mib"]]
    out = {k: max(v) for k, v in per_rank.items()}
    out.update(tokens_per_s=tokens / seconds, step_s=seconds / steps, per_rank=per_rank,
               teacher_total_mib=ranks[0]["teacher_bytes"]["total"] / MIB, train_loss=ranks[0]["train_loss"],
               loss_token_fraction=ranks[0]["loss_token_fraction"])  # fmt: skip
    return out


def summarize(runs: dict[str, list[dict]]) -> dict:
    """median/min/max of every metric over the repeats that succeeded, per contender."""
    out = {}
    for name, samples in runs.items():
        ok = [s["metrics"] for s in samples if "metrics" in s]
        out[name] = {"ok_repeats": len(ok), "errors": [s["error"] for s in samples if "error" in s]}
        for m in METRICS:
            vals = [s[m] for s in ok]
            if vals:
                out[name][m] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def ratios(runs: dict[str, list[dict]]) -> dict:
    """Each ratio repeat by repeat (repeat i of the numerator / repeat i of the denominator), then summarised."""
    out = {}
    for key, (num, den, metric, op, goal, what) in RATIOS.items():
        if num not in runs or (den is not None and den not in runs):
            continue
        if den is None:  # a target on one contender's own metric (already a fraction)
            pairs = [a["metrics"][metric] for a in runs[num] if "metrics" in a]
        else:
            pairs = [a["metrics"][metric] / b["metrics"][metric] for a, b in zip(runs[num], runs[den])
                     if "metrics" in a and "metrics" in b and b["metrics"][metric]]  # fmt: skip
        row = {"numerator": num, "denominator": den, "metric": metric, "what": what, "per_repeat": pairs,
               "goal_op": op, "goal": goal}  # fmt: skip
        if pairs:
            row.update(median=statistics.median(pairs), min=min(pairs), max=max(pairs))
            if goal is not None:
                row["met"] = row["median"] <= goal if op == "<=" else row["median"] >= goal
        out[key] = row
    return out


# ---- report -------------------------------------------------------------------------------------------------
def _load(rep: dict) -> str:
    load = rep.get("load_average_1min")
    if not load:
        return ""
    return f"; 1-minute load average {load['start']:.1f} at the start, {load['end']:.1f} at the end (2 = 2 busy cores)"


def markdown(rep: dict) -> str:
    c, mach, mod = rep["plan"], rep["machine"], rep["models"]
    lines = [
        "# Trainers side by side: trl_distill vs TRL GKD vs a bare PyTorch loop",
        "",
        f"Teacher {mod['teacher_params'] / 1e6:.1f}M parameters, student {mod['student_params'] / 1e6:.1f}M "
        f"(random-init Llama, shared {c['vocab_size']}-token vocabulary), fp32, {c['seq_len']}-token sequences "
        f"(prompt {c['prompt_len_range'][0]}-{c['prompt_len_range'][1]} tokens masked from the loss), batch "
        f"{c['batch']} per rank, {c['steps']} optimizer steps of which the first {c['warmup']} are warm-up (not "
        f"timed); `*_ga8`: micro batch {c['ga8']['batch']}, gradient accumulation {c['ga8']['accumulation']}, "
        f"{c['ga8']['steps']} steps of which {c['ga8']['warmup']} warm-up; {c['repeats']} repeat(s). Forward KL at "
        "T=1: ours `alpha=1`; GKD `lmbda=0, beta=0, seq_kd=False`. "
        "DeepSpeed on CPU (gloo), one torch thread per rank. Each cell: median [min, max] over repeats.",
        "",
        f"Machine: {mach['cpu']}, {mach['cpus']} CPUs, torch {mach['torch']}, transformers "
        f"{mach['transformers']}, trl {mach['trl']}, deepspeed {mach['deepspeed']}, {mach['date']}. "
        f"Total runtime {rep['total_runtime_s']:.0f} s{' (--smoke)' if rep['smoke'] else ''}" + _load(rep) + ".",
        "",
        "| setup | procs | teacher MiB per rank | peak RSS MiB per rank, loading | RSS growth MiB, loading "
        "| peak RSS MiB per rank, training | tokens/s | step ms | train loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in rep["summary"].items():
        _, _, nproc, label = CONTENDERS[name]
        ms = {k: v * 1e3 for k, v in s["step_s"].items()} if "step_s" in s else None
        lines.append(
            f"| {label} | {nproc} | {_mmm(s.get('teacher_mib'))} | {_mmm(s.get('load_peak_mib'))} "
            f"| {_mmm(s.get('load_increment_mib'))} | {_mmm(s.get('train_peak_mib'))} "
            f"| {_mmm(s.get('tokens_per_s'))} | {_mmm(ms)} | {_mmm(s.get('train_loss'), '.4f')} |"
            + (f" {len(s['errors'])} failed run(s)" if s["errors"] else "")
        )
    lines += ["", "| ratio (repeat by repeat) | ours | vs | median [min, max] | goal | |", "|---|---|---|---|---|---|"]
    for r in rep["ratios"].values():
        goal = f"{r['goal_op']} {r['goal']}" if r["goal"] is not None else ""
        met = "" if "met" not in r else ("met" if r["met"] else "**MISSED**")
        lines.append(f"| {r['what']} | {r['numerator']} | {r['denominator'] or '(itself)'} | {_mmm(r, '.3f')} | {goal} "
                     f"| {met} |")
    lines += ["", *notes(rep)]
    return "\n".join(lines) + "\n"


def notes(rep: dict) -> list[str]:
    ok = [s["metrics"] for samples in rep["runs"].values() for s in samples if "metrics" in s]
    frac = ok[0]["loss_token_fraction"] if ok else float("nan")
    base = statistics.median([m["before_trainer_rss_mib"] for m in ok]) if ok else float("nan")
    return [
        f"- tokens/s counts every input token (batch x sequence length x processes) over the timed steps, on the "
        f"slowest rank; {frac:.0%} of them carry loss (completion tokens). Step ms = timed seconds / timed steps.",
        f"- Every process holds about {base:.0f} MiB (torch, transformers, DeepSpeed, TRL, the dataset) before a "
        "trainer is built; peak RSS includes it, RSS growth does not.",
        *NOTES,
    ]


NOTES = [
    "- Teacher MiB per rank: bytes of teacher parameters a rank holds after training: its ZeRO-3 partitions plus "
    "any parameter held whole (replicated, or ZeRO-3 persistent). Memory columns: the largest rank.",
    "- Peak RSS, loading: `VmHWM` right after the teacher is loaded and prepared (ours: inside `train()`; GKD: "
    "at the end of `__init__`; bare: after `from_pretrained` of both models). RSS growth, loading: that peak minus "
    "`VmRSS` just before the trainer (both load the student too). The high-water mark is then reset "
    "(`/proc/self/clear_refs`), so peak RSS, training covers engine set-up and training only.",
    "- Train loss: the mean logged training loss, the same forward KL for every contender (GKD logs it divided by "
    "the number of processes: half at 2 processes).",
    "- `trl.DistillationTrainer` is not compared: it is on-policy only (the student generates from prompts). GKD "
    "beside a ZeRO-2 student prepares its teacher at ZeRO stage 0 (a full replica on every rank).",
    "- On CPU, DeepSpeed's all-gathers run over gloo (TCP on loopback): every step a ZeRO-3 teacher moves (N-1)/N "
    "of its bytes into each rank, whatever the batch size; GPUs with NVLink move them orders of magnitude faster.",
]


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("teacher_mib", "teacher MiB per rank", True),
        ("load_peak_mib", "peak RSS MiB per rank, loading", True),
        ("train_peak_mib", "peak RSS MiB per rank, training", True),
        ("tokens_per_s", "tokens/s", False),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(18, 5))
    for ax, (metric, title, two_proc_only) in zip(axes, panels):
        names = [n for n, s in rep["summary"].items() if metric in s and (CONTENDERS[n][2] == 2 or not two_proc_only)]
        vals = [rep["summary"][n][metric] for n in names]
        med = [v["median"] for v in vals]
        err = [[m - v["min"] for m, v in zip(med, vals)], [v["max"] - m for m, v in zip(med, vals)]]
        colors = ["tab:blue" if n.startswith("ours") else "tab:gray" if n.startswith("bare") else "tab:red"
                  for n in names]  # fmt: skip
        ax.bar(range(len(names)), med, yerr=err, capsize=3, color=colors)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"trl_distill (blue) vs TRL GKD (red) vs bare loop (gray); median, min-max over "
                 f"{rep['plan']['repeats']} repeat(s)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainers.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "trainers.md").write_text(markdown(report))
    plot(report, out / "trainers.png")
    if not report["smoke"] and out.resolve() == (ROOT / "benchmarks" / "results").resolve():
        update_readme(report)
        replace_readme_block(SUMMARY_MARKERS, summary_block(report), ROOT / "README.md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models, 1 repeat, 3 steps (about a minute)")
    ap.add_argument("--output_dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--steps", type=int, help="optimizer steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, help="untimed first steps (>= 1)")
    ap.add_argument("--only", nargs="+", choices=list(CONTENDERS), help="run only these contenders")
    ap.add_argument("--report_only", action="store_true", help="rewrite md and png from output_dir/trainers.json")
    args = ap.parse_args()
    out = Path(args.output_dir)
    if args.report_only:  # summaries, ratios, md and png again from the raw runs in the JSON
        report = json.loads((out / "trainers.json").read_text())
        report.update(summary=summarize(report["runs"]), ratios=ratios(report["runs"]))
        return write_outputs(report, out)

    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    cfg = plan(args.smoke)
    for key in ("repeats", "steps", "warmup"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    names = [n for n in CONTENDERS if not args.only or n in args.only]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="trl_distill_bench_") as tmp:
        models = build_models(cfg, Path(tmp) / "models")
        print(f"models: teacher {models['teacher_params']:,} student {models['student_params']:,} parameters",
              flush=True)  # fmt: skip
        for r in range(cfg["repeats"]):
            for name in names if r % 2 == 0 else names[::-1]:
                res = run_contender(name, cfg, models, Path(tmp) / f"r{r}" / name)
                runs[name].append(res)
                got = res.get("metrics", {})
                print(f"repeat {r} {name}: {res['wall_s']:.0f} s, " + (
                    f"{got['tokens_per_s']:.0f} tokens/s, teacher {got['teacher_mib']:.0f} MiB, "
                    f"load peak {got['load_peak_mib']:.0f} MiB" if got else "FAILED: " + res["error"][-600:]),
                    flush=True)  # fmt: skip
    report = {
        "benchmark": "trainers", "smoke": args.smoke, "plan": cfg, "machine": machine(),
        "models": {k: v for k, v in models.items() if k.endswith("_params")},
        "contenders": {n: _contender_info(n) for n in names},
        "token_count": "all input tokens (batch x seq_len x processes) of the timed steps",
        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "summary": summarize(runs), "ratios": ratios(runs), "runs": runs,
        "total_runtime_s": time.perf_counter() - t_start,
    }  # fmt: skip
    write_outputs(report, out)
    print(markdown(report))
    print(f"wrote {out}/trainers.{{json,md,png}} in {report['total_runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
