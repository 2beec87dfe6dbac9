"""The GPU run: bf16 CUDA training with a ZeRO-3 teacher beside a ZeRO-2 student, ours vs TRL's GKD, and the fused
loss vs Liger's Triton kernel. Run it through ``benchmarks/gpu/run.sh`` (which installs the carried wheels first).

    python benchmarks/gpu/gpu_bench.py --mode gpu|cpu-dry-run --output_dir DIR

* **Training** (random-init Llama, one 128 000-token vocabulary, a ~1.6B teacher and a ~0.46B student, rows of 4096
  tokens with a ~10 % prompt, micro batch 1, bf16, forward KL at T = 1): ours in one plain ``python`` process (world
  size 1: the ZeRO-2 student and the ZeRO-3 teacher are two DeepSpeed engines of one process), ours under ``torchrun
  --nproc_per_node 1``, and `trl.experimental.gkd.GKDTrainer` (``lmbda=0, beta=0``) with the same ZeRO-2 student
  config under torchrun. Each is a fresh process (`train_worker.py`): tokens/s over the timed steps, peak GPU memory
  (`torch.cuda.max_memory_allocated`), peak RSS.
* **Loss** (one forward + backward of the KD loss from hidden states and lm_head weights, bf16, V = 128 000, teacher
  hidden 2048, student 1024, 4096 and 16384 tokens): ours (`trl_distill.loss.fused.chunked_divergence`), the naive
  full-logits loss (`trl_distill.loss.divergences.divergence`), and Liger's `LigerFusedLinearJSD` at ``jsd_beta=0``
  (its forward KL) and 1 (reverse KL). Time (CUDA events, median of 5 after 2 warm-ups), extra peak GPU memory, and
  each loss value against the naive one.

``--mode cpu-dry-run`` runs every step at tiny sizes on the CPU (fp32 loss; bf16 training where the CPU computes bf16
natively, fp32 elsewhere), so the test suite keeps the script working; Liger is skipped there (Triton needs a GPU).
Writes ``gpu_bench.json`` and ``gpu_bench.md`` to ``--output_dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # benchmarks/
from _common import machine  # noqa: E402

Z2 = str(ROOT / "configs/deepspeed/zero2_student.json")
MIB = 1 << 20
SIZES = {
    "gpu": {
        "vocab_size": 128000, "seq_len": 4096, "steps": 8, "warmup": 3, "timeout_s": 420, "dtype": "bfloat16",
        "teacher": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16),
        "student": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16),
        "loss": {"vocab_size": 128000, "tokens": [4096, 16384], "teacher_hidden": 2048, "student_hidden": 1024,
                 "dtype": "bfloat16", "repeats": 5, "warmup": 2},
    },
    "cpu-dry-run": {
        "vocab_size": 1024, "seq_len": 64, "steps": 2, "warmup": 1, "timeout_s": 240, "dtype": "bfloat16",
        "teacher": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
        "student": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
        "loss": {"vocab_size": 1024, "tokens": [128], "teacher_hidden": 64, "student_hidden": 32, "dtype": "float32",
                 "repeats": 2, "warmup": 1},
    },
}  # fmt: skip
TRAIN_RUNS = {  # name: (trainer_worker's trainer, launcher)
    "ours_one_process": ("ours", "python"),
    "ours_torchrun_1": ("ours", "torchrun"),
    "gkd_torchrun_1": ("gkd", "torchrun"),
}


# ---- training -----------------------------------------------------------------------------------------------
def build_models(sizes: dict, directory: Path) -> dict:
    """Tokenizer, teacher and student saved under `directory` (built on the GPU when there is one, in bf16)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_distill.testing import tiny_llama_config

    sys.path.insert(0, str(HERE.parent))
    from trainers import synthetic_tokenizer

    tokenizer = synthetic_tokenizer(sizes["vocab_size"])
    out = {"tokenizer": str(directory / "tokenizer")}
    tokenizer.save_pretrained(out["tokenizer"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed, role in enumerate(("teacher", "student")):
        torch.manual_seed(seed)
        config = tiny_llama_config(tokenizer, role, max_position_embeddings=sizes["seq_len"], **sizes[role])
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, sizes["dtype"]))
        out[role], out[f"{role}_params"] = str(directory / role), sum(p.numel() for p in model.parameters())
        model.save_pretrained(out[role])
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def run_training(name: str, sizes: dict, models: dict, out: Path) -> dict:
    """One fresh run of `name`; its figures, or the error."""
    from trl_distill.testing import launch, read_rank_records

    trainer, launcher = TRAIN_RUNS[name]
    seq = sizes["seq_len"]
    spec = {"trainer": trainer, "deepspeed": Z2, "out": str(out), "student": models["student"],
            "teacher": models["teacher"], "tokenizer": models["tokenizer"], "vocab_size": sizes["vocab_size"],
            "seq_len": seq, "prompt_len_range": [seq * 3 // 40, seq * 5 // 40], "batch": 1, "accumulation": 1,
            "steps": sizes["steps"], "warmup": sizes["warmup"], "data_seed": 0, "num_examples": sizes["steps"],
            "bf16": sizes.get("bf16", True), "log_distill_metrics": False}  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}  # fmt: skip
    worker = HERE / "train_worker.py"
    t0 = time.perf_counter()
    try:
        if launcher == "python":
            proc = subprocess.run([sys.executable, str(worker), json.dumps(spec)], env=env, cwd=ROOT, text=True,
                                  capture_output=True, timeout=sizes["timeout_s"])  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
        else:
            launch(worker, json.dumps(spec), nproc=1, timeout=sizes["timeout_s"], cwd=ROOT, env=env)
        (rank,) = read_rank_records(out, 1)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as error:
        return {"error": str(error)[-4000:], "wall_s": time.perf_counter() - t0}
    timed = rank["timed_seconds"]
    cuda = rank.get("cuda") or {}
    return {
        "tokens_per_s": rank["timed_steps"] * seq / timed, "step_s": timed / rank["timed_steps"],
        "peak_gpu_mib": cuda.get("max_allocated", 0) / MIB or None, "device": cuda.get("device"),
        "peak_rss_mib": max(rank["memory"]["teacher_ready"]["VmHWM"], rank["memory"]["after_train"]["VmHWM"]) / MIB,
        "teacher_mib": rank["teacher_bytes"]["held"] / MIB, "train_loss": rank["train_loss"],
        "dtypes": rank.get("dtypes"), "wall_s": time.perf_counter() - t0,
    }  # fmt: skip


# ---- the loss -----------------------------------------------------------------------------------------------
def loss_methods():
    """name -> (function of (hs, ws, ht, wt) -> scalar loss, or the reason it cannot run here)."""
    import torch

    from trl_distill.loss.divergences import divergence
    from trl_distill.loss.fused import chunked_divergence

    def ours(kind):
        return lambda hs, ws, ht, wt: chunked_divergence(hs, ws, ht, wt, None, kind, temperature=1.0)

    def naive(kind):
        return lambda hs, ws, ht, wt: divergence(hs @ ws.T, ht @ wt.T, kind, temperature=1.0)

    methods = {f"{name}_{kind}": make(kind) for name, make in (("ours", ours), ("naive", naive))
               for kind in ("forward_kl", "reverse_kl")}  # fmt: skip
    if not torch.cuda.is_available():
        return methods, "Liger's kernels are Triton: they need a GPU"
    try:
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD
    except ImportError as error:
        return methods, f"liger_kernel is not installed ({error}); run benchmarks/gpu/wheels.sh here first"
    forward, reverse = LigerFusedLinearJSD(jsd_beta=0.0), LigerFusedLinearJSD(jsd_beta=1.0)
    methods["liger_forward_kl"] = lambda hs, ws, ht, wt: forward(hs, ws, ht, wt)
    methods["liger_reverse_kl"] = lambda hs, ws, ht, wt: reverse(hs, ws, ht, wt)
    return methods, None


def bench_loss(cfg: dict) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda" if cuda else "cpu"), getattr(torch, cfg["dtype"])
    methods, liger_skipped = loss_methods()
    results = []
    for n in cfg["tokens"]:
        g = torch.Generator(device=device).manual_seed(0)
        v, h_s, h_t = cfg["vocab_size"], cfg["student_hidden"], cfg["teacher_hidden"]
        ws = (torch.randn(v, h_s, generator=g, device=device) * h_s**-0.5).to(dtype).requires_grad_()
        wt = (torch.randn(v, h_t, generator=g, device=device) * h_t**-0.5).to(dtype)
        hs0 = torch.randn(n, h_s, generator=g, device=device).to(dtype)
        ht = torch.randn(n, h_t, generator=g, device=device).to(dtype)
        for name, fn in methods.items():
            results.append({"method": name, "tokens": n, **_time_one(fn, hs0, ws, ht, wt, cfg, cuda)})
        del ws, wt, hs0, ht
    for row in results:  # each loss value against the naive loss of the same divergence and shape
        exact = next(r for r in results if r["tokens"] == row["tokens"]
                     and r["method"] == "naive_" + row["method"].split("_", 1)[1])  # fmt: skip
        if "loss" in row and "loss" in exact:
            row["loss_vs_naive"] = abs(row["loss"] - exact["loss"]) / max(abs(exact["loss"]), 1e-12)
    return {"config": cfg, "results": results, "liger_skipped": liger_skipped}


def _time_one(fn, hs0, ws, ht, wt, cfg: dict, cuda: bool) -> dict:
    import torch

    times, loss = [], None
    try:
        for i in range(cfg["warmup"] + cfg["repeats"]):
            hs = hs0.clone().requires_grad_()
            ws.grad = None
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            value = fn(hs, ws, ht, wt)
            value.backward()
            if cuda:
                torch.cuda.synchronize()
            if i >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
            loss = float(value.detach())
        extra = (torch.cuda.max_memory_allocated() - base) / MIB if cuda else None
    except (RuntimeError, ValueError, AssertionError) as error:  # an out-of-memory or a kernel's shape limit
        return {"error": str(error).splitlines()[0][:300]}
    finally:
        if cuda:
            torch.cuda.empty_cache()
    return {"ms": statistics.median(times) * 1e3, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3,
            "extra_peak_gpu_mib": extra, "loss": loss}  # fmt: skip


# ---- report -------------------------------------------------------------------------------------------------
def markdown(rep: dict) -> str:
    s, mod = rep["sizes"], rep["models"]
    dt = "bf16" if s.get("bf16", True) else "fp32"
    lines = [f"# The GPU run ({rep['mode']})", "",
             f"{rep['machine'].get('gpu') or 'no GPU'}; teacher {mod['teacher_params'] / 1e6:,.1f}M, student "
             f"{mod['student_params'] / 1e6:,.1f}M parameters (random-init Llama, {s['vocab_size']}-token vocabulary), "
             f"{s['seq_len']}-token rows, micro batch 1, {dt}, {s['steps']} steps of which {s['warmup']} warm-up; "
             f"{rep['total_runtime_s']:.0f} s in all, {rep['machine']['date'][:16]}.", "",
             "| training run | tokens/s | step s | peak GPU MiB | peak RSS MiB | teacher MiB held | train loss |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in rep["training"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].strip().splitlines()[-1][:160]} | | | | | |")
            continue
        gpu = f"{r['peak_gpu_mib']:.0f}" if r["peak_gpu_mib"] else "n/a"
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {gpu} | {r['peak_rss_mib']:.0f} "
                     f"| {r['teacher_mib']:.0f} | {r['train_loss']:.4f} |")  # fmt: skip
    ours, gkd = rep["training"].get("ours_torchrun_1", {}), rep["training"].get("gkd_torchrun_1", {})
    if "tokens_per_s" in ours and "tokens_per_s" in gkd:
        lines += ["", f"ours / GKD under torchrun: tokens/s {ours['tokens_per_s'] / gkd['tokens_per_s']:.2f}×"
                  + (f", peak GPU memory {ours['peak_gpu_mib'] / gkd['peak_gpu_mib']:.2f}×" if gkd["peak_gpu_mib"]
                     else "") + "."]  # fmt: skip
    loss = rep["loss"]
    lines += ["", f"Loss, one forward + backward, {loss['config']['dtype']}, V = {loss['config']['vocab_size']}, "
              f"hidden {loss['config']['student_hidden']} (student) / {loss['config']['teacher_hidden']} (teacher)"
              + (f"; Liger skipped: {loss['liger_skipped']}" if loss["liger_skipped"] else "") + ".", "",
              "| method | tokens | ms median [min, max] | extra peak GPU MiB | loss | vs naive |",
              "|---|---|---|---|---|---|"]
    for r in loss["results"]:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['tokens']} | failed: {r['error']} | | | |")
            continue
        extra = f"{r['extra_peak_gpu_mib']:.0f}" if r["extra_peak_gpu_mib"] is not None else "n/a"
        lines.append(f"| {r['method']} | {r['tokens']} | {r['ms']:.1f} [{r['ms_min']:.1f}, {r['ms_max']:.1f}] "
                     f"| {extra} "
                     f"| {r['loss']:.6f} | {r.get('loss_vs_naive', float('nan')):.1e} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=list(SIZES), default="gpu")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--models_dir", help="where to save the models (default: a folder under /tmp)")
    args = ap.parse_args()
    import tempfile

    import torch

    from trl_distill.model.precision import cpu_supports_bf16

    if args.mode == "gpu" and not torch.cuda.is_available():
        sys.exit("gpu_bench.py: no CUDA device here; run benchmarks/gpu/run.sh --cpu-dry-run on a machine without GPU.")
    sizes, out, t0 = dict(SIZES[args.mode]), Path(args.output_dir), time.perf_counter()
    if args.mode == "cpu-dry-run" and not cpu_supports_bf16():  # torch would emulate bf16; trl_distill refuses it
        sizes.update(dtype="float32", bf16=False)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trl_distill_gpu_", dir=args.models_dir) as tmp:
        models = build_models(sizes, Path(tmp) / "models")
        print(f"models: teacher {models['teacher_params']:,}, student {models['student_params']:,}", flush=True)
        training = {}
        for name in TRAIN_RUNS:
            training[name] = run_training(name, sizes, models, Path(tmp) / name)
            r = training[name]
            done = f"{r['tokens_per_s']:.0f} tokens/s, peak GPU {r['peak_gpu_mib']} MiB" if "error" not in r else None
            print(f"{name}: " + (done or "FAILED " + r["error"][-1500:]), flush=True)
    loss = bench_loss(sizes["loss"])
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report = {"benchmark": "gpu", "mode": args.mode, "sizes": sizes,
              "machine": machine(gpu=gpu, torch_cuda=torch.version.cuda),
              "models": {k: v for k, v in models.items() if k.endswith("_params")}, "training": training, "loss": loss,
              "total_runtime_s": time.perf_counter() - t0}  # fmt: skip
    (out / "gpu_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu_bench.md").write_text(markdown(report))
    print(markdown(report))
    failed = [n for n, r in training.items() if "error" in r] + [r["method"] for r in loss["results"] if "error" in r]
    if failed:
        sys.exit(f"gpu_bench.py: failed: {', '.join(failed)} (their errors are in {out / 'gpu_bench.json'})")


if __name__ == "__main__":
    main()
