"""What a teacher with another tokenizer costs per step: cross-tokenizer KD vs same-tokenizer KD, in one run.

    make bench-cross         # about 4 minutes on 2 cores
    python benchmarks/cross_tokenizer_cost.py [--output_dir benchmarks/results] [--work_dir outputs/bench_cross]

The quickstart's model sizes and recipe on its bundled corpus, 2 processes (ZeRO-2 student, ZeRO-3 teacher): one
student (a BPE-2048 tokenizer) distilled from a teacher with the same tokenizer and from a teacher of the same size
with another one (BPE-4096, other merges), both teachers untrained (step time does not depend on what they know).
The runs go same, across, across, same; step time is the median after the warm-up steps, and the ratio is across /
same over the medians of each pair. The one-off alignment of the data happens before training and is reported
apart (the wall time of the whole command minus `train()`, the fastest run of each pair).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples"))

from _common import machine, replace_readme_block  # noqa: E402
from quickstart import CORPUS, MAX_LENGTH, SIZES  # noqa: E402

from trl_distill.testing import build_tiny_model, build_tokenizer, launch  # noqa: E402

WARMUP = 5
README_MARKERS = ("<!-- bench:cross:start -->", "<!-- bench:cross:end -->")


def models(work: Path) -> None:
    texts = [json.loads(line)["text"] for line in open(Path(CORPUS) / "train.jsonl")]
    half = len(texts) // 2
    student_tok, other_tok = build_tokenizer(2048, corpus=texts[:half]), build_tokenizer(4096, corpus=texts[half:])
    for name, tokenizer, size in (("student", student_tok, "student"), ("teacher_same", student_tok, "teacher"),
                                  ("teacher_other", other_tok, "teacher")):
        build_tiny_model(tokenizer, size, seed=0, max_position_embeddings=MAX_LENGTH, **SIZES[size]).save_pretrained(
            work / name)
        tokenizer.save_pretrained(work / name)


def run(work: Path, name: str, teacher: str, steps: int) -> dict:
    out = work / "runs" / name
    flags = ["--config", str(ROOT / "configs/recipes/quickstart.yaml"), "--model_name_or_path", str(work / "student"),
             "--teacher_model_name_or_path", str(work / teacher), "--dataset_name", str(Path(CORPUS) / "train.jsonl"),
             "--deepspeed", str(ROOT / "configs/deepspeed/zero2_student.json"), "--max_steps", str(steps),
             "--logging_steps", "50", "--output_dir", str(out)]
    start = time.time()
    launch(HERE / "cache_train_worker.py", *flags, cwd=ROOT, timeout=900)
    wall = time.time() - start
    times = json.loads((out / "step_times.json").read_text())
    ends = [times["start"]] + times["ends"]
    step = statistics.median([b - a for a, b in zip(ends, ends[1:], strict=False)][WARMUP:])
    record = {"name": name, "teacher": teacher, "step_seconds": step, "train_seconds": times["train_seconds"],
              "setup_seconds": wall - times["train_seconds"]}
    print(f"{name}: median step {step * 1000:.0f} ms, set-up {record['setup_seconds']:.0f} s", flush=True)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=str(HERE / "results"))
    parser.add_argument("--work_dir", default=str(ROOT / "outputs" / "bench_cross"))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    begin, work = time.time(), Path(args.work_dir).resolve()
    models(work)
    order = [("same", "teacher_same"), ("across", "teacher_other"), ("across_again", "teacher_other"),
             ("same_again", "teacher_same")]
    runs = [run(work, name, teacher, args.steps) for name, teacher in order]
    median = {kind: statistics.median(r["step_seconds"] for r in runs if r["name"].startswith(kind))
              for kind in ("same", "across")}
    # set-up: the fastest of each pair (the very first run also warms the disk cache and DeepSpeed's op builds)
    setup = {kind: min(r["setup_seconds"] for r in runs if r["name"].startswith(kind)) for kind in ("same", "across")}
    report = {"steps": args.steps, "warmup_steps": WARMUP, "runs": runs,
              "step_time_across_vs_same": median["across"] / median["same"],
              "setup_seconds_across_minus_same": setup["across"] - setup["same"], "machine": machine(),
              "seconds": time.time() - begin}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cross_tokenizer_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "cross_tokenizer_cost.md").write_text("# Cross-tokenizer KD: cost per step\n\n" + table)
    replace_readme_block(README_MARKERS, table)
    print(table)


def markdown(report: dict) -> str:
    lines = ["| run | teacher tokenizer | median step (ms) | set-up before train() (s) |", "|---|---|---|---|"]
    lines += [f"| {r['name']} | {'the student’s' if r['teacher'] == 'teacher_same' else 'another (BPE 4096)'} | "
              f"{r['step_seconds'] * 1000:.0f} | {r['setup_seconds']:.0f} |" for r in report["runs"]]
    m = report["machine"]
    lines += ["", f"Step time across tokenizers / same tokenizer: **{report['step_time_across_vs_same']:.2f}x** "
              f"(medians of each pair, run same, across, across, same); aligning the data adds "
              f"{max(report['setup_seconds_across_minus_same'], 0.0):.1f} s of set-up (the fastest run of each pair). "
              f"{report['steps']} steps of the "
              f"quickstart recipe, 2 processes (ZeRO-2 student, ZeRO-3 teacher), median after "
              f"{report['warmup_steps']} warm-up steps; {m['cpus']} CPUs, torch {m['torch']}, {m['date']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
