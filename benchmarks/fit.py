"""Will my teacher fit beside my student? The largest teacher each contender trains at a fixed memory cap per process.

    python benchmarks/fit.py [--smoke] [--cap_mib N] [--output_dir DIR]

Every process of a 2-process run gets the same heap cap (`RLIMIT_DATA`, `trainer_worker.cap_memory`), so a run that
does not fit fails with torch's own out-of-memory error, and glibc is told to return freed memory (`ALLOCATOR`).
The student is `real_shapes.py`'s (~69M, a 128 000-token vocabulary); the teacher has a fixed width (hidden 1024,
intermediate 4096) and L layers. For each contender (ours: ZeRO-2 student + ZeRO-3 teacher; TRL's GKD with the same
ZeRO-2 student, which replicates its teacher) the largest L that trains two optimizer steps (bf16, 1024-token rows,
micro batch 1) is found by doubling L until a run fails, then bisecting. Beside it: the largest L for which
`trl-distill plan` (the same shapes, 2 "GPUs" of the cap less the heap a process maps before any model, measured by
`base_mib`) keeps its setup ``ours`` / ``replicated`` within that budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import real_shapes
import trainers as small
from _common import ROOT, machine, replace_readme_block

CONTENDERS = {"ours_z2_z3": "ours", "gkd_z2": "replicated"}  # fit contender: its setup in `trl-distill plan`
# glibc keeps freed blocks under its (self-raising) mmap threshold in the heap: a rank that gathers a ZeRO-3 teacher
# layer by layer kept ~3x its partitions resident (L = 31: peak RSS 4606 MiB, 3132 with these). A fixed 1 MiB
# threshold and trim return freed memory, as a GPU's caching allocator reuses it, for every contender alike.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "1048576"}
MIB = 1 << 20


def plan(smoke: bool) -> dict:
    if smoke:
        return {"vocab_size": 2048, "seq_len": 64, "cap_mib": 1700, "max_layers": 8, "timeout_s": 300,
                "student": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
                "teacher_width": dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4)}
    return {"vocab_size": 128000, "seq_len": 1024, "cap_mib": 5632, "max_layers": 128, "timeout_s": 1200,
            "student": real_shapes.plan(False)["student"],
            "teacher_width": dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16)}  # fmt: skip


class Teachers:
    """Teachers of one width and L layers (random-init, bf16), each saved when a probe needs it and deleted after."""

    def __init__(self, cfg: dict, directory: Path):
        from trl_distill.testing import tiny_llama_config

        self.directory, self.tokenizer = directory, small.synthetic_tokenizer(cfg["vocab_size"])
        self.config = tiny_llama_config(self.tokenizer, "teacher", max_position_embeddings=cfg["seq_len"],
                                        **cfg["teacher_width"])  # fmt: skip

    def config_dir(self, layers: int) -> str:
        """A directory holding only the `layers`-layer config (what `trl-distill plan` reads)."""
        out = self.directory / f"config_{layers}"
        out.mkdir(parents=True, exist_ok=True)
        self._config(layers).save_pretrained(str(out))
        return str(out)

    def _config(self, layers: int):
        config = self.config.__class__.from_dict(self.config.to_dict())
        config.num_hidden_layers = layers
        return config

    def save(self, layers: int) -> tuple[str, int]:
        """The saved `layers`-layer teacher's directory and its parameter count."""
        import torch
        from transformers import AutoModelForCausalLM

        out = self.directory / f"teacher_{layers}"
        torch.manual_seed(layers)
        model = AutoModelForCausalLM.from_config(self._config(layers), dtype=torch.bfloat16)
        model.save_pretrained(str(out))
        self.tokenizer.save_pretrained(str(out))
        params = sum(p.numel() for p in model.parameters())
        del model
        return str(out), params

    def remove(self, layers: int) -> None:
        shutil.rmtree(self.directory / f"teacher_{layers}", ignore_errors=True)


def fits(name: str, layers: int, cfg: dict, models: dict, teachers: Teachers, out: Path) -> dict:
    teacher, params = teachers.save(layers)
    seq = cfg["seq_len"]
    case = {"vocab_size": cfg["vocab_size"], "seq_len": seq, "prompt_len_range": [seq * 3 // 40, seq * 5 // 40],
            "batch": 1, "accumulation": 1, "steps": 2, "warmup": 1, "timeout_s": cfg["timeout_s"]}  # fmt: skip
    extra = {"bf16": True, "memory_cap_mib": cfg["cap_mib"], "log_distill_metrics": False}
    result = small.run_contender(name, case, {**models, "teacher": teacher}, out / f"{name}_{layers}", extra)
    teachers.remove(layers)
    ok = "metrics" in result
    oom = not ok and ("can't allocate memory" in result["error"] or "MemoryError" in result["error"])
    row = {"layers": layers, "teacher_params": params, "fits": ok, "out_of_memory": oom, "wall_s": result["wall_s"]}
    if ok:
        row["peak_rss_mib"] = max(result["metrics"]["load_peak_mib"], result["metrics"]["train_peak_mib"])
    elif not oom:
        row["error"] = result["error"][-1500:]
    print(f"{name} L={layers} ({params / 1e6:.0f}M): " + ("fits" if ok else "out of memory" if oom else "FAILED"),
          flush=True)  # fmt: skip
    return row


def largest(name: str, cfg: dict, models: dict, teachers: Teachers, out: Path) -> dict:
    """Doubling from 1 layer until a run does not fit, then bisection: the largest L that fits, and every probe."""
    probes, good, bad = [], 0, None
    layers = 1
    while layers <= cfg["max_layers"]:
        probes.append(fits(name, layers, cfg, models, teachers, out))
        if not probes[-1]["fits"]:
            bad = layers
            break
        good, layers = layers, layers * 2
    if bad is None and good < cfg["max_layers"]:  # fitted at every power of two: try the maximum
        probes.append(fits(name, cfg["max_layers"], cfg, models, teachers, out))
        good, bad = (cfg["max_layers"], None) if probes[-1]["fits"] else (good, cfg["max_layers"])
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        probes.append(fits(name, middle, cfg, models, teachers, out))
        good, bad = (middle, bad) if probes[-1]["fits"] else (good, middle)
    failed = [p for p in probes if not p["fits"] and not p["out_of_memory"]]
    return {"largest_layers": good, "first_failing_layers": bad, "probes": probes, "failed_otherwise": len(failed),
            "largest_params": next((p["teacher_params"] for p in probes if p["layers"] == good), 0)}


def base_mib() -> float:
    """The heap (``VmData``, what `RLIMIT_DATA` counts: mapped, touched or not) of a process that has imported what
    the worker imports, before any model: torch's and gloo's reservations are most of it."""
    code = ("import torch, transformers, deepspeed, trl, datasets, trl_distill; torch.set_num_threads(1); "
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmData')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    return int(out.stdout.split()[-1]) / 1024


def plan_boundary(setup: str, cfg: dict, teachers: Teachers, student_dir: str, budget_mib: float) -> dict:
    """The largest L whose `trl-distill plan` estimate (`runtime.plan.evaluate`, exact parameter counts from the
    configs) for `setup` is within `budget_mib` per "GPU", 2 of them; and the estimate at each L up to it."""
    from trl_distill.runtime.plan import Settings, evaluate, spec_from_config

    settings = Settings(gpus_per_node=2, gpu_memory_gb=budget_mib / 1024, dtype="bf16", seq_len=cfg["seq_len"])
    student, best, totals = spec_from_config(student_dir), 0, {}
    for layers in range(1, cfg["max_layers"] + 1):
        teacher = spec_from_config(teachers.config_dir(layers))
        totals[layers] = evaluate(student, teacher, settings)[setup]["total"] / MIB
        if totals[layers] > budget_mib:
            break
        best = layers
    return {"largest_layers": best, "estimate_mib": totals}


def run(cfg: dict, out: Path) -> dict:
    base = base_mib()
    with tempfile.TemporaryDirectory(prefix="trl_distill_fit_") as tmp:
        models = student_model(cfg, Path(tmp) / "models")
        teachers = Teachers(cfg, Path(tmp) / "teachers")
        contenders = {}
        for name, setup in CONTENDERS.items():
            measured = largest(name, cfg, models, teachers, Path(tmp) / "runs")
            predicted = plan_boundary(setup, cfg, teachers, models["student"], cfg["cap_mib"] - base)
            contenders[name] = {"plan_setup": setup, "measured": measured, "plan": predicted}
    ours, gkd = (contenders[n]["measured"]["largest_params"] for n in CONTENDERS)
    return {"contenders": contenders, "base_mib": base, "ratio_params": ours / gkd if gkd else None,
            "student_params": models["student_params"]}


def student_model(cfg: dict, directory: Path) -> dict:
    """The tokenizer and the student (`trainers.build_models`' student), saved under `directory`."""
    from trl_distill.testing import build_tiny_model

    tokenizer = small.synthetic_tokenizer(cfg["vocab_size"])
    out = {"tokenizer": str(directory / "tokenizer"), "student": str(directory / "student")}
    tokenizer.save_pretrained(out["tokenizer"])
    model = build_tiny_model(tokenizer, "student", seed=1, max_position_embeddings=cfg["seq_len"], **cfg["student"])
    out["student_params"] = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out["student"])
    return out


def markdown(rep: dict) -> str:
    c = rep["plan"]
    lines = [f"Heap cap {c['cap_mib']} MiB per process (2 processes), bf16, {c['seq_len']}-token rows, student "
             f"{rep['models_student_params'] / 1e6:.0f}M, teacher of width {c['teacher_width']['hidden_size']} "
             f"(intermediate {c['teacher_width']['intermediate_size']}) with L layers. The cap counts a process's "
             f"mapped heap (`VmData`), {rep['result']['base_mib']:.0f} MiB of which it holds before any model "
             "(libraries, torch's and gloo's reservations); `plan`'s budget is the cap less that. glibc returns freed "
             "memory (`fit.ALLOCATOR`) in every run. "
             f"{rep['total_runtime_s'] / 60:.0f} min, {rep['machine']['date'][:16]}.", "",
             "| contender | largest L that trains | teacher parameters | first L that does not | plan's largest L |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, row in rep["result"]["contenders"].items():
        m = row["measured"]
        lines.append(f"| {real_shapes.CONTENDERS[name]} | {m['largest_layers']} | {m['largest_params'] / 1e6:.0f}M | "
                     f"{m['first_failing_layers'] or '> ' + str(c['max_layers'])} | {row['plan']['largest_layers']} |")
    ratio = rep["result"]["ratio_params"]
    lines += ["", f"Ours trains a teacher {ratio:.2f}x the parameters of the largest GKD trains beside the same "
              "student (goal >= 1.8)." if ratio else "GKD trained no teacher at this cap."]
    return "\n".join(lines) + "\n"


MARKERS = ("<!-- bench:fit:start -->", "<!-- bench:fit:end -->")
SUMMARY_MARKERS = ("<!-- bench:fit-summary:start -->", "<!-- bench:fit-summary:end -->")


def summary(rep: dict) -> str:
    """The README's short form of the fit table."""
    c, rows = rep["plan"], rep["result"]["contenders"]
    ratio = rep["result"]["ratio_params"]
    lines = [f"| at {c['cap_mib']} MiB of heap per process, beside the {rep['result']['student_params'] / 1e6:.0f}M "
             "student | largest teacher that trains | `plan` predicts |", "|---|---|---|"]
    for name, row in rows.items():
        m = row["measured"]
        lines.append(f"| {real_shapes.CONTENDERS[name]} | {m['largest_layers']} layers, "
                     f"{m['largest_params'] / 1e6:.0f}M | {row['plan']['largest_layers']} layers |")
    if ratio:
        met = "met" if ratio >= 1.8 else "**missed**"
        lines.append(f"| ours / GKD | {ratio:.2f}× the parameters (goal ≥ 1.8, {met}) | |")
    return "\n".join(lines)


def write_outputs(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "fit.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "fit.md").write_text("# The fit question: the largest teacher beside one student\n\n" + markdown(report))
    if not report["smoke"] and out.resolve() == (ROOT / "benchmarks" / "results").resolve():
        replace_readme_block(MARKERS, markdown(report))  # docs/benchmarks.md
        replace_readme_block(SUMMARY_MARKERS, summary(report), ROOT / "README.md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models (about two minutes)")
    ap.add_argument("--cap_mib", type=int, help="RLIMIT_DATA per process")
    ap.add_argument("--output_dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--report_only", action="store_true", help="rewrite fit.md and the tables from fit.json")
    args = ap.parse_args()
    cfg, out, t0 = plan(args.smoke), Path(args.output_dir), time.perf_counter()
    if args.report_only:
        return write_outputs(json.loads((out / "fit.json").read_text()), out)
    os.environ.update(ALLOCATOR)  # every worker inherits it (`trainers.run_contender`, `testing.launch`)
    if args.cap_mib:
        cfg["cap_mib"] = args.cap_mib
    result = run(cfg, out)
    report = {"benchmark": "fit", "smoke": args.smoke, "plan": cfg, "machine": machine(), "result": result,
              "models_student_params": result["student_params"], "total_runtime_s": time.perf_counter() - t0}
    write_outputs(report, out)
    print(markdown(report))


if __name__ == "__main__":
    main()
