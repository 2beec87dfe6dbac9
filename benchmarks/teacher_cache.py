"""The teacher cache vs the online ZeRO-3 teacher, measured in one run (`make bench-cache`, ~8 min on 2 idle cores).

    python benchmarks/teacher_cache.py [--output_dir benchmarks/results] [--work_dir outputs/bench_cache] [--smoke]

1. The quickstart's models: a tokenizer and a teacher trained on the bundled corpus, an untrained student.
2. `trl-distill cache-teacher` on 2 processes (ZeRO-3 teacher) with k = 8, 64 and 256, each in the packed 7bit
   encoding (the default) and with float32 log-probs, and k = 64 in float16: bytes per loss token on disk (measured
   at this vocabulary, and computed for a 128k one with `cache.packing.bytes_per_token`) and the wall time of each.
3. The quickstart's distillation recipe on 2 processes (ZeRO-2 student, forward KL, alpha 1, T 1): with the live
   ZeRO-3 teacher, then from each float32 cache and the packed k = 8 and 64 ones (k = 64 float32 and packed twice
   each, in the order A B B A). Step time: the median over the steps after the first 5, and the wall time of
   `train()` (the live teacher's includes loading it). The runs alternate (online, caches, online again), and each
   cache run is compared with the median of the two online ones; packed vs float32: the medians of their runs.
4. The teacher served by vLLM (`make vllm-env`; fp32, on the same 2 CPUs): the engine's start time, reported apart;
   `cache-teacher --teacher_server` (k = 64, packed) on 2 processes, its loss tokens per second against the ZeRO-3
   teacher's k = 64 packed cache; then, with the server up, training against the live server and from that cache,
   in the order live, cache, live: step time live vs from the cache.
5. Held-out quality on the corpus' held-out topics (the quickstart's `compare`): each student's cross-entropy,
   KL(teacher‖student) and top-1 agreement, and the gap of the cached students to the online (dense) one; the
   packed cache's student also against the float32 cache's of the same k (same seed, same steps).

Writes `teacher_cache.json` and `teacher_cache.md` to --output_dir, and the table into README.md between
``<!-- bench:cache:start -->`` and ``<!-- bench:cache:end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples"))

from _common import machine, replace_readme_block  # noqa: E402
from quickstart import CORPUS, MAX_LENGTH, compare, teach_teacher  # noqa: E402

from trl_distill.cache.packing import bytes_per_token  # noqa: E402
from trl_distill.testing import launch, vllm_server  # noqa: E402

WARMUP = 5
README_MARKERS = ("<!-- bench:cache:start -->", "<!-- bench:cache:end -->")


def cli_flags(work: Path, steps: int) -> list[str]:
    return ["--config", str(ROOT / "configs/recipes/quickstart.yaml"), "--model_name_or_path", str(work / "student"),
            "--dataset_name", str(Path(CORPUS) / "train.jsonl"), "--deepspeed",
            str(ROOT / "configs/deepspeed/zero2_student.json"), "--max_steps", str(steps), "--logging_steps", "50"]


def cache_teacher(work: Path, name: str, k: int, dtype: str, steps: int, teacher: list[str] | None = None) -> dict:
    directory = work / "caches" / name
    start = time.time()
    teacher = teacher or ["--teacher_model_name_or_path", str(work / "teacher")]
    launch("trl_distill", "cache-teacher", *cli_flags(work, steps), *teacher, "--teacher_cache", str(directory),
           "--cache_top_k", str(k), "--cache_log_prob_dtype", dtype, launcher_args=("-m",), cwd=ROOT, timeout=900)
    seconds = time.time() - start
    manifest = json.loads((directory / "manifest.json").read_text())
    tokens = sum(s["tokens"] for s in manifest["shards"])
    size = sum(s["bytes"] for s in manifest["shards"])
    print(f"cache {name}: {size / tokens:.1f} bytes per loss token, {seconds:.0f} s", flush=True)
    return {"name": name, "k": k, "dtype": dtype, "dir": str(directory), "rows": manifest["num_rows"],
            "loss_tokens": tokens, "bytes": size, "bytes_per_token": size / tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds}


def served_teacher(work: Path, steps: int, zero3_cache: dict) -> tuple[dict, list[dict], list[dict]]:
    """vLLM serving the teacher: engine start, a cache written from it, and training live vs from that cache."""
    start = time.time()
    with vllm_server(work / "teacher", max_model_len=MAX_LENGTH + 1) as url:  # + the one token vLLM generates
        engine_seconds = time.time() - start
        print(f"vLLM engine up in {engine_seconds:.0f} s", flush=True)
        served = ["--teacher_server", url, "--teacher_model_name_or_path", "teacher"]
        cache = cache_teacher(work, "k64_7bit_served", 64, "7bit", steps, served)
        live = served + ["--teacher_server_top_k", "64"]
        runs = [train(work, "served_live", steps, live),
                train(work, "served_cache", steps, ["--teacher_cache", cache["dir"]]),
                train(work, "served_live_again", steps, live)]
    summary = {"engine_start_seconds": engine_seconds,
               "cache_tokens_per_second_vs_zero3": cache["tokens_per_second"] / zero3_cache["tokens_per_second"],
               "live_step_time_vs_cache": statistics.median(r["step_seconds"] for r in runs if "live" in r["name"])
               / runs[1]["step_seconds"]}
    print(f"served: {summary}", flush=True)
    return summary, [cache], runs


def train(work: Path, name: str, steps: int, teacher_flags: list[str]) -> dict:
    out = work / "students" / name
    launch(HERE / "cache_train_worker.py", *cli_flags(work, steps), *teacher_flags, "--output_dir", str(out),
           cwd=ROOT, timeout=900)
    times = json.loads((out / "step_times.json").read_text())
    ends = [times["start"]] + times["ends"]
    steps_s = [b - a for a, b in zip(ends, ends[1:], strict=False)][WARMUP:]
    record = {"name": name, "dir": str(out), "step_seconds": statistics.median(steps_s),
              "step_seconds_min_max": [min(steps_s), max(steps_s)], "train_seconds": times["train_seconds"]}
    print(f"train {name}: median step {record['step_seconds'] * 1000:.0f} ms, train() {record['train_seconds']:.0f} s",
          flush=True)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=str(HERE / "results"))
    parser.add_argument("--work_dir", default=str(ROOT / "outputs" / "bench_cache"))
    parser.add_argument("--smoke", action="store_true", help="a few steps, k = 8 only (the test suite's check)")
    args = parser.parse_args(argv)
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    begin = time.time()
    work, out = Path(args.work_dir).resolve(), Path(args.output_dir).resolve()
    teacher_steps, steps = (4, 2 * WARMUP + 2) if args.smoke else (300, 200)
    corpus = load_dataset("json", data_files={s: os.path.join(CORPUS, f"{s}.jsonl") for s in ("train", "heldout")})
    tokenizer, teacher, _ = teach_teacher(str(work), teacher_steps, corpus["train"])
    teacher.eval()
    heldout = corpus["heldout"]["text"][:8] if args.smoke else corpus["heldout"]["text"]
    plans = [("k8", 8, "float32"), ("k8_7bit", 8, "7bit")] if args.smoke else [
        (f"k{k}{suffix}", k, dtype) for k in (8, 64, 256) for suffix, dtype in (("", "float32"), ("_7bit", "7bit"))
    ] + [("k64_fp16", 64, "float16")]
    caches = [cache_teacher(work, name, k, dtype, steps) for name, k, dtype in plans]
    online_flags = ["--teacher_model_name_or_path", str(work / "teacher")]
    by_cache = {c["name"]: c for c in caches}
    # k = 64, packed vs float32: twice each, in the order A B B A, so a drift of the machine's speed cancels
    order = ["k8", "k8_7bit"] if args.smoke else ["k8", "k8_7bit", "k64", "k64_7bit", "k64_7bit_again",
                                                  "k64_again", "k256"]
    runs = [train(work, "online", steps, online_flags)]
    runs += [train(work, name, steps, ["--teacher_cache", by_cache[name.removesuffix("_again")]["dir"]])
             for name in order]
    runs.append(train(work, "online_again", steps, online_flags))
    served = None
    if not args.smoke:
        served, served_caches, served_runs = served_teacher(work, steps, by_cache["k64_7bit"])
        caches += served_caches
        runs += served_runs
    for cache in caches:
        cache["bytes_per_token_128k"] = bytes_per_token(cache["k"], 128256, cache["dtype"])
    for run in runs:
        student = AutoModelForCausalLM.from_pretrained(run.pop("dir")).eval()
        run["heldout"] = compare(student, teacher, tokenizer, heldout)
    online = [r for r in runs if r["name"].startswith("online")]
    base = {key: statistics.median(r[key] for r in online) for key in ("step_seconds", "train_seconds")}
    for run in runs:
        run["step_time_vs_online"] = run["step_seconds"] / base["step_seconds"]
        run["train_time_vs_online"] = run["train_seconds"] / base["train_seconds"]
        run["gap_to_online"] = {key: run["heldout"][key] - online[0]["heldout"][key]
                                for key in ("student_ce", "kl_to_teacher", "top1_agreement")}
    for run in runs:  # a packed cache's student against the float32 cache's of the same k (median of its runs)
        cache = run["name"].removesuffix("_again")
        exact = [r for r in runs if r["name"].removesuffix("_again") == cache.removesuffix("_7bit")]
        packed = [r for r in runs if r["name"].removesuffix("_again") == cache]
        if cache.endswith("_7bit") and exact:
            run["vs_float32_cache"] = {
                "student_ce": run["heldout"]["student_ce"] - exact[0]["heldout"]["student_ce"],
                "step_time": statistics.median(r["step_seconds"] for r in packed)
                / statistics.median(r["step_seconds"] for r in exact)}
    report = {"steps": steps, "warmup_steps": WARMUP, "caches": caches, "runs": runs, "served": served,
              "machine": machine(), "seconds": time.time() - begin}
    out.mkdir(parents=True, exist_ok=True)
    (out / "teacher_cache.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "teacher_cache.md").write_text("# Teacher cache vs the online ZeRO-3 teacher\n\n" + table)
    if not args.smoke:
        replace_readme_block(README_MARKERS, table)
    print(table)


def markdown(report: dict) -> str:
    lines = ["| cache | bytes per loss token (measured, this vocabulary) | computed, 128k vocabulary | "
             "cache-teacher wall s | loss tokens/s |", "|---|---|---|---|---|"]
    lines += [f"| {c['name']}: k={c['k']}, {c['dtype']} | {c['bytes_per_token']:.0f} | "
              f"{c['bytes_per_token_128k']:.0f} | {c['seconds']:.0f} | {c['tokens_per_second']:.0f} |"
              for c in report["caches"]]
    lines += ["", "| student trained with | step time vs online | train() time vs online | held-out CE | "
              "CE − online | CE − float32 cache | step time vs float32 cache | KL(teacher‖student) | "
              "top-1 agreement |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        h, gap, exact = r["heldout"], r["gap_to_online"], r.get("vs_float32_cache")
        versus = f"{exact['student_ce']:+.4f} | {exact['step_time']:.2f}" if exact else " | "
        lines.append(f"| {r['name']} | {r['step_time_vs_online']:.2f} | {r['train_time_vs_online']:.2f} | "
                     f"{h['student_ce']:.3f} | {gap['student_ce']:+.3f} | {versus} | {h['kl_to_teacher']:.3f} | "
                     f"{h['top1_agreement']:.3f} |")
    served = report.get("served")
    if served:
        lines += ["", f"Served by vLLM (fp32, sharing the 2 CPUs with training): engine start "
                  f"{served['engine_start_seconds']:.0f} s (not in any time above); cache-teacher via the server vs "
                  f"via the ZeRO-3 teacher (k = 64, 7bit): {served['cache_tokens_per_second_vs_zero3']:.2f}x the loss "
                  f"tokens/s; training step time against the live server vs from its cache (median of the live runs "
                  f"before and after): {served['live_step_time_vs_cache']:.2f}x."]
    m = report["machine"]
    lines += ["", f"{report['steps']} steps of the quickstart recipe on 2 processes (ZeRO-2 student; online: ZeRO-3 "
              f"teacher), step time = median after {report['warmup_steps']} warm-up steps, ratios to the median of "
              f"the two online runs (run first and last). {m['cpus']} CPUs, torch {m['torch']}, {m['date']}, load "
              f"average {m['load_average'][0]:.1f} at the end; whole benchmark {report['seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
