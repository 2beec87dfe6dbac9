"""Summary, markdown table and plot of `kd_vs_sft.py`'s runs (statistics over seeds, KD paired against SFT)."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/
from _common import replace_readme_block  # noqa: E402

METRICS = ("ce", "ppl", "kl_to_teacher", "top1_agreement")
COLORS = {"sft": "black", "forward_kl": "tab:blue", "reverse_kl": "tab:red", "jsd": "tab:green"}


def stats(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[dict], methods: list[str]) -> dict[str, dict]:
    """Per method: final held-out metrics and the curve, over seeds; held-out CE minus SFT's, paired by seed."""
    sft_final = {r["seed"]: r["curve"][-1]["ce"] for r in runs if r["method"] == "sft"}
    summary = {}
    for name in methods:
        mine = sorted((r for r in runs if r["method"] == name), key=lambda r: r["seed"])
        steps = [point["step"] for point in mine[0]["curve"]]
        entry = {
            "divergence": mine[0]["divergence"], "alpha": mine[0]["alpha"], "seeds": [r["seed"] for r in mine],
            "final_step": steps[-1],
            "final": {k: stats([r["curve"][-1][k] for r in mine]) for k in METRICS},
            "curve": [{"step": s, **{k: stats([r["curve"][i][k] for r in mine]) for k in METRICS}}
                      for i, s in enumerate(steps)],
        }
        if name != "sft" and all(r["seed"] in sft_final for r in mine):
            deltas = [r["curve"][-1]["ce"] - sft_final[r["seed"]] for r in mine]
            entry["ce_minus_sft"] = {**stats(deltas), "seeds_better": sum(d < 0 for d in deltas)}
        summary[name] = entry
    return summary


def _pm(s: dict, fmt: str = ".3f") -> str:
    return f"{s['mean']:{fmt}} ± {s['sd']:{fmt}}"


def _label(name: str, entry: dict) -> str:
    if name == "sft":
        return "SFT only (α=0)"
    return f"{entry['divergence']} α={entry['alpha']:g}" + (" (+CE)" if entry["alpha"] < 1 else "")


def table(summary: dict) -> list[str]:
    rows = [
        "| method | held-out CE ↓ | perplexity ↓ | CE − SFT, paired [min, max] | KL(teacher‖student) ↓ | "
        "top-1 agreement ↑ |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in summary.items():
        f, delta = entry["final"], entry.get("ce_minus_sft")
        paired = "—" if delta is None else (
            f"{delta['mean']:+.3f} [{delta['min']:+.3f}, {delta['max']:+.3f}] "
            f"({delta['seeds_better']}/{delta['n']} seeds better)")
        rows.append(f"| {_label(name, entry)} | {_pm(f['ce'])} | {_pm(f['ppl'], '.1f')} | {paired} | "
                    f"{_pm(f['kl_to_teacher'])} | {_pm(f['top1_agreement'])} |")
    return rows


def findings(report: dict) -> list[str]:
    """Plain statements read off the numbers (no judgement beyond the sign of the paired difference)."""
    summary, teacher = report["summary"], report["teacher"]["heldout"]
    ref = report["reference_student"]["heldout"]
    lines = [f"- Teacher held-out CE {teacher['ce']:.3f} (perplexity {teacher['ppl']:.1f}); the student size trained "
             f"alone with the teacher's recipe reaches {ref['ce']:.3f} ({ref['ppl']:.1f}), "
             f"{ref['ce'] - teacher['ce']:+.3f} nats/token from the teacher."]
    kd = {n: e for n, e in summary.items() if "ce_minus_sft" in e}
    if kd and "sft" in summary:
        best = min(kd, key=lambda n: kd[n]["final"]["ce"]["mean"])
        d = kd[best]["ce_minus_sft"]
        lines.append(f"- Best held-out CE: {_label(best, kd[best])}, {d['mean']:+.3f} nats/token vs SFT only "
                     f"(paired over seeds, [{d['min']:+.3f}, {d['max']:+.3f}]; perplexity "
                     f"{summary['sft']['final']['ppl']['mean']:.1f} → {kd[best]['final']['ppl']['mean']:.1f}).")
        better = [_label(n, e) for n, e in kd.items() if e["ce_minus_sft"]["max"] < 0]
        worse = [_label(n, e) for n, e in kd.items() if e["ce_minus_sft"]["min"] > 0]
        lines.append(f"- Lower held-out CE than SFT only on every seed: {', '.join(better) or 'none'}.")
        lines.append(f"- Higher held-out CE than SFT only on every seed: {', '.join(worse) or 'none'}.")
    long = {n: e for n, e in report["teacher_budget"]["summary"].items() if "ce_minus_sft" in e}
    if long:
        lines.append("- At the teacher's budget, held-out CE minus SFT only's: " + ", ".join(
            f"{_label(n, e)} {e['ce_minus_sft']['mean']:+.3f}" for n, e in long.items()) + " (one seed).")
    return lines


def student_kind(student: dict) -> str:
    """"" for the dense (Llama) students; the Mixture-of-Experts students' routing and router loss."""
    if "model_type" not in student:
        return ""
    return (f"Mixture-of-Experts ({student['model_type']}: {student['num_local_experts']} experts of width "
            f"{student['intermediate_size']}, {student['num_experts_per_tok']} per token, router loss "
            f"`--router_aux_loss_coef {student['router_aux_loss_coef']:g}`), ")


def markdown(report: dict) -> str:
    s = report["settings"]
    t, sizes, c = s["training"], s["sizes"], s["corpus"]
    head = [
        "# Distillation vs SFT-only on a real corpus",
        "",
        f"Corpus: the source of the Python {c['python']} standard library (`*.py`, built by `stdlib_corpus.py`; no "
        f"tests, demos or data tables), split {c['split']}: {c['train_files']} train files, {c['heldout_files']} "
        f"held-out files, cut into pieces of whole lines of up to {c['max_chars']} characters. Kept: "
        f"{c['train_pieces']} train pieces ({c['train_tokens'] / 1e6:.2f}M tokens, drawn from "
        f"{c['train_files_used']} files) and {c['heldout_pieces']} held-out pieces ({c['heldout_tokens']} tokens, "
        f"from {c['heldout_files_used']} files) for scoring. BPE tokenizer (vocabulary {s['vocab_size']}) trained on "
        f"the kept train pieces only; sequences of up to {t['max_length']} tokens. Every model is trained by the "
        "`trl-distill` CLI (`DistillationTrainer`, 1 process, 1 thread, fp32, CPU).",
        "",
        f"Teacher: Llama, hidden {sizes['teacher']['hidden_size']} × {sizes['teacher']['num_hidden_layers']} layers, "
        f"{report['teacher']['params'] / 1e6:.2f}M parameters, {s['teacher_steps']} steps × batch "
        f"{s['teacher_batch']} of cross-entropy (`--alpha 0`, learning rate {s['teacher_learning_rate']:g}), one pass "
        f"over the train pieces. Students: {student_kind(sizes['student'])}hidden {sizes['student']['hidden_size']} × "
        f"{sizes['student']['num_hidden_layers']} layers, {s['student_params'] / 1e6:.2f}M parameters, "
        f"{s['steps']} steps × batch {s['batch']}, learning rate {t['learning_rate']:g} ({t['lr_scheduler_type']}, "
        f"{t['warmup_steps']} warm-up steps), temperature {t['temperature']:g}, seeds {s['seeds']} (a seed fixes "
        "the initial student, the same for every method, and the data order). loss = α·KD + (1 − α)·CE.",
        "",
        f"Held-out metrics after {s['steps']} steps, per token, mean ± standard deviation over "
        f"{len(s['seeds'])} seed(s); CE − SFT is each seed's CE minus the SFT-only student's of the same seed.",
        "",
    ]
    long = report["teacher_budget"]["summary"]
    middle = ["", f"At the teacher's own budget ({s['teacher_steps']} steps × batch {s['teacher_batch']}, the "
              f"initial student of seed {s['seeds'][0]}, one data order): the SFT-only row is the student size "
              "trained alone like the teacher (at the students' learning rate).", "", *table(long)] if long else []
    machine = report["machine"]
    name = "kd_vs_sft_moe" if "model_type" in sizes["student"] else "kd_vs_sft"
    tail = ["", *findings(report), "",
            f"Whole experiment: {report['wall_seconds'] / 60:.1f} min wall, {machine['cpu_seconds'] / 60:.1f} CPU-min, "
            f"on {machine['cpus']} × {machine['cpu']} (torch {machine['torch']}, {machine['date']}; load average "
            f"{machine['load_average'][2]:.1f} over the last 15 min). Curves: `{name}.png`; every run: "
            f"`{name}.json`.",
            ""]
    return "\n".join(head + table(report["summary"]) + middle + tail)


def plot(report: dict, path: Path) -> None:
    """Held-out CE, KL(teacher‖student) and top-1 agreement vs step: mean over seeds, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ce", "held-out cross-entropy (nats/token), students' budget"),
              ("kl_to_teacher", "held-out KL(teacher‖student)"),
              ("top1_agreement", "held-out top-1 agreement with teacher")]
    fig, grid = plt.subplots(2, 2, figsize=(14, 10))
    axes = grid.flatten()
    s = report["settings"]
    long_title = f"held-out cross-entropy, teacher's budget ({s['teacher_steps']} × {s['teacher_batch']}, 1 seed)"
    jobs = [(ax, key, title, report["summary"]) for ax, (key, title) in zip(axes, panels)]
    jobs.append((axes[3], "ce", long_title, report["teacher_budget"]["summary"]))
    for ax, key, title, summary in jobs:
        for name, entry in summary.items():
            points = entry["curve"][1:]  # step 0 (untrained) would flatten the interesting range
            steps = [p["step"] for p in points]
            color = COLORS["sft" if name == "sft" else entry["divergence"]]
            style = "-" if entry["alpha"] in (0.0, 1.0) else "--"
            ax.plot(steps, [p[key]["mean"] for p in points], style, color=color, marker=".", lw=1.6,
                    label=_label(name, entry))
            ax.fill_between(steps, [p[key]["min"] for p in points], [p[key]["max"] for p in points], color=color,
                            alpha=0.12, lw=0)
        ax.set_title(title)
        ax.set_xlabel("student training step (the untrained step 0 is left out)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="upper right")  # the methods, before the reference lines join the CE panels
    teacher, ref = report["teacher"]["heldout"], report["reference_student"]["heldout"]
    lines = [ax.axhline(teacher["ce"], color="gray", ls=":", lw=1.5, label=f"teacher ({teacher['ce']:.2f})")
             for ax in (axes[0], axes[3])]
    if math.isfinite(ref["ce"]):
        lines.insert(1, axes[0].axhline(ref["ce"], color="gray", ls="-.", lw=1.2,
                                        label=f"student alone, teacher's budget ({ref['ce']:.2f})"))
    axes[0].legend(handles=lines[:-1], fontsize=8, loc="lower left")
    axes[3].legend(fontsize=8, loc="lower left")
    sizes = f"students ({s['student_params'] / 1e6:.2f}M) vs a {report['teacher']['params'] / 1e6:.2f}M teacher"
    fig.suptitle(f"KD vs SFT only, {sizes}: mean over seeds {s['seeds']}, band = min-max", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


README_START, README_END = "<!-- experiment:kd_vs_sft:start -->", "<!-- experiment:kd_vs_sft:end -->"


def readme_block(report: dict) -> str:
    """The README's table (between its markers): the students' table and what the teacher and the run were."""
    s, machine = report["settings"], report["machine"]
    teacher, ref = report["teacher"]["heldout"], report["reference_student"]["heldout"]
    return "\n".join([
        f"Run of {machine['date'][:10]} (Python {s['corpus']['python']}): {report['wall_seconds'] / 60:.1f} min wall, "
        f"{machine['cpu_seconds'] / 60:.1f} CPU-min on {machine['cpus']} cores (load average "
        f"{machine['load_average'][2]:.1f} over the last 15 min). Teacher held-out CE {teacher['ce']:.3f}; the "
        f"student size trained alone with the teacher's budget {ref['ce']:.3f}. Students after {s['steps']} steps, "
        f"mean ± sd over seeds {s['seeds']}:",
        "",
        *table(report["summary"]),
    ])


def update_readme(report: dict, readme: Path) -> bool:
    """Replace the block between the README's markers with `readme_block`; False when there are no markers."""
    return replace_readme_block((README_START, README_END), readme_block(report), readme)
