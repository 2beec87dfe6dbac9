"""The GPU run: bf16 CUDA training rows of ours against TRL's nearest equivalent (a teacher beside a ZeRO-2 student),
and the fused loss against Liger's Triton kernel. Run it through ``benchmarks/gpu/run.sh`` (which installs
the carried wheels first). A check, not a demo: it exits non-zero when any row fails.

    python benchmarks/gpu/gpu_bench.py --mode gpu|cpu-dry-run --output_dir DIR [--rows NAME,...]
                                       [--row_timeout_s S] [--deadline_s S]

* **Training rows** (`rows.ROWS`; random-init Llama, one 128 000-token vocabulary, a ~1.6B teacher and a ~0.46B
  student, rows of 4096 tokens with a ~10 % prompt, micro batch 1, bf16, forward KL at T = 1): off-policy in one
  plain ``python`` process and under ``torchrun --nproc_per_node 1`` against `GKDTrainer` (``lmbda=0, beta=0``);
  on-policy (``lmbda=1``, 256 tokens sampled with HF generate) against `GKDTrainer` with ``lmbda=1``; the
  sampled-token objective; a LoRA student against `GKDTrainer` with the same LoRA; a Mixture-of-Experts student with
  its router loss; a teacher of another tokenizer; `trl-distill cache-teacher` and training from that cache. Each
  is a fresh process (`train_worker.py`, run by `runner.py`: one row on the GPU at a time, the next one's start-up
  overlapping it): step time and tokens/s over the timed steps, peak GPU memory (`torch.cuda.max_memory_allocated`),
  peak RSS, the row's wall time.
* **Loss rows** (`loss_table.py`; one forward + backward from hidden states and lm_head weights, bf16, V = 128 000,
  teacher hidden 2048, student 1024, 4096 and 16384 tokens): ours, the naive full-logits loss and Liger's
  `LigerFusedLinearJSD` at ``jsd_beta=0`` (forward KL) and 1 (reverse KL): time (median of 5 after 2 warm-ups),
  extra peak GPU memory, each loss value against the naive one.

A failed row (non-zero exit, past ``--row_timeout_s``, or any exception of a loss row) is printed with its output's
last lines as it fails and again in the closing summary; the others still run, ``gpu_bench.json`` and
``gpu_bench.md`` are written, and the exit status is 1. ``--rows`` runs only the named rows (training rows and loss
methods, e.g. ``--rows gkd_on_policy,liger_forward_kl``): rerun what failed. The loss rows run first; the training
rows end by ``--deadline_s`` (none starts after it, a running one is stopped there), so the run keeps to its budget.

``--mode cpu-dry-run`` runs every row at tiny sizes on the CPU (fp32 loss; bf16 training where the CPU computes bf16
natively, fp32 elsewhere), so the test suite keeps the script working; Liger is skipped there (Triton needs a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/
sys.path.insert(0, str(HERE))  # benchmarks/gpu/
from _common import machine  # noqa: E402
from loss_table import METHODS, bench_loss  # noqa: E402
from report import failure_lines, markdown, training_figures  # noqa: E402
from rows import ROWS, build_models, models_needed, spec_of  # noqa: E402
from runner import run_rows  # noqa: E402

# Sized from the first H200 run (3 off-policy rows of 8 steps, 27-32 s each, 106 s with the loss table); README.md
# gives each row's estimate (about 4.5 minutes in all). A row's timeout is 2-3x its estimate; the deadline keeps the
# whole run within 5 minutes even when the estimates are off (the rows it cuts fail, to be rerun with --rows).
SIZES = {
    "gpu": {
        "vocab_size": 128000, "seq_len": 4096, "dtype": "bfloat16",
        "off_policy": {"steps": 6, "warmup": 2, "timeout_s": 60},
        "on_policy": {"steps": 2, "warmup": 1, "new_tokens": 256, "timeout_s": 75},
        "deadline_s": 280,
        "teacher": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16),
        "student": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16),
        "student_moe": dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=16,
                            num_key_value_heads=16, num_local_experts=8, num_experts_per_tok=2),
        "other_vocab_size": 16000, "cache_top_k": 64,
        "lora": dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"),
        "loss": {"vocab_size": 128000, "tokens": [4096, 16384], "teacher_hidden": 2048, "student_hidden": 1024,
                 "dtype": "bfloat16", "repeats": 5, "warmup": 2, "timeout_s": 30},
    },
    "cpu-dry-run": {
        "vocab_size": 1024, "seq_len": 64, "dtype": "bfloat16",
        "off_policy": {"steps": 2, "warmup": 1, "timeout_s": 300},
        "on_policy": {"steps": 2, "warmup": 1, "new_tokens": 8, "timeout_s": 300},
        "deadline_s": 1800,
        "teacher": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
        "student": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
        "student_moe": dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "other_vocab_size": 400, "cache_top_k": 8,
        "lora": dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"),
        "loss": {"vocab_size": 1024, "tokens": [128], "teacher_hidden": 64, "student_hidden": 32, "dtype": "float32",
                 "repeats": 2, "warmup": 1, "timeout_s": 120},
    },
}  # fmt: skip


def selected_rows(text: str | None) -> tuple[list[str], list[str]]:
    """(training rows, loss methods) that ``--rows`` names, in the run's order, with the rows they need; all when
    None. Exits with the known names for an unknown one."""
    if text is None:
        return list(ROWS), list(METHODS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS and n not in METHODS]
    if unknown or not names:
        sys.exit(f"gpu_bench.py: unknown row(s) {', '.join(unknown) or '(none given)'}; training rows: "
                 f"{', '.join(ROWS)}; loss rows: {', '.join(METHODS)}")
    wanted = set(names) | {ROWS[n].needs for n in names if n in ROWS and ROWS[n].needs}
    return [n for n in ROWS if n in wanted], [m for m in METHODS if m in wanted]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=list(SIZES), default="gpu")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--models_dir", help="where to save the models (default: a folder under /tmp)")
    ap.add_argument("--rows", help="comma-separated training rows and loss methods to run (default: all)")
    ap.add_argument("--row_timeout_s", type=float, help="each training row's timeout (default: the mode's, per phase)")
    ap.add_argument("--deadline_s", type=float, help="training rows end this many seconds after the start: none starts "
                    "after it, a running one is stopped there (default: the mode's)")
    args = ap.parse_args()
    import tempfile

    import torch

    from trl_distill.model.precision import cpu_supports_bf16

    if args.mode == "gpu" and not torch.cuda.is_available():
        sys.exit("gpu_bench.py: no CUDA device here; run benchmarks/gpu/run.sh --cpu-dry-run on a machine without GPU.")
    training_rows, loss_rows = selected_rows(args.rows)
    sizes, out, t0 = dict(SIZES[args.mode]), Path(args.output_dir), time.perf_counter()
    deadline = t0 + (args.deadline_s or sizes["deadline_s"])
    if args.mode == "cpu-dry-run" and not cpu_supports_bf16():  # torch would emulate bf16; trl_distill refuses it
        sizes.update(dtype="float32", bf16=False)
    out.mkdir(parents=True, exist_ok=True)
    walls, failed = {}, {}

    def ended(name: str, result: dict) -> None:
        wall = result.get("wall_s", 0.0)
        if "@" not in name:  # a loss row (method@tokens): the table's time is counted once, as a whole
            walls[name] = wall
        if "error" in result:
            failed[name] = result
            print(failure_lines(name, result), flush=True)
        elif "step_s" in result:
            print(f"{name}: {result['step_s']:.3f} s/step, {result['tokens_per_s']:.0f} tokens/s, peak GPU "
                  f"{result['peak_gpu_mib'] or 0:.0f} MiB; {wall:.1f} s", flush=True)
        else:
            print(f"{name}: done; {wall:.1f} s", flush=True)

    loss = None  # first: a few seconds, and the rows' deadline cannot cut it
    if loss_rows:
        started = time.perf_counter()
        loss = bench_loss(sizes["loss"], loss_rows, ended)
        walls["(loss table)"] = time.perf_counter() - started
    models, training = {}, {}
    with tempfile.TemporaryDirectory(prefix="trl_distill_gpu_", dir=args.models_dir) as tmp:
        if training_rows:
            started = time.perf_counter()
            models = build_models(sizes, Path(tmp) / "models", models_needed(training_rows))
            walls["(models)"] = time.perf_counter() - started
            print("models: " + ", ".join(f"{k[:-7]} {v:,}" for k, v in models.items() if k.endswith("_params"))
                  + f"; {walls['(models)']:.1f} s", flush=True)

        def figures(name: str, result: dict) -> None:
            if "record" in result:
                result = {**training_figures(name, result, sizes), "wall_s": result["wall_s"],
                          "process_s": result["process_s"]}  # fmt: skip
            training[name] = result
            ended(name, result)

        work = Path(tmp) / "rows"
        run_rows([(n, ROWS[n].launcher, ROWS[n].needs) for n in training_rows],
                 lambda name, row_out: spec_of(name, sizes, models, row_out, work),
                 lambda name: args.row_timeout_s or sizes[ROWS[name].phase]["timeout_s"], deadline, work, figures)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report = {"benchmark": "gpu", "mode": args.mode, "sizes": sizes, "rows": args.rows,
              "machine": machine(gpu=gpu, torch_cuda=torch.version.cuda),
              "models": {k: v for k, v in models.items() if k.endswith("_params")}, "training": training, "loss": loss,
              "failed": {name: {k: r.get(k) for k in ("error", "tail")} for name, r in failed.items()},
              "total_runtime_s": time.perf_counter() - t0}  # fmt: skip
    (out / "gpu_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu_bench.md").write_text(markdown(report))
    print(markdown(report))
    print("Wall seconds: " + ", ".join(f"{n} {s:.1f}" for n, s in walls.items())
          + f"; total {report['total_runtime_s']:.1f}", flush=True)
    if failed:
        print(f"\n{len(failed)} row(s) FAILED:", flush=True)
        for name, result in failed.items():
            print(failure_lines(name, result), flush=True)
        sys.exit(f"gpu_bench.py: failed: {', '.join(failed)} (errors and last lines in {out / 'gpu_bench.json'}); "
                 f"rerun them with --rows {','.join(failed)}")


if __name__ == "__main__":
    main()
