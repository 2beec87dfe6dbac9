"""Does on-policy distillation help here? Students distilled on their own samples (GKD) vs off-policy and SFT-only.

    make experiment-on-policy   # also run by `make experiment`
    python benchmarks/quality/on_policy_kd.py [--smoke] [--output_dir DIR] [--work_dir DIR]

Like `kd_vs_sft.py` (same corpus, model sizes, recipe and CLI runs), on prompt–completion rows: each stdlib piece is
cut at the line break nearest a third of it, the prompt before, the completion after.

1. The teacher (trained as in `kd_vs_sft.py`, ``--alpha 0`` on the whole pieces, one pass). Prompts are at most 96
   characters, so a prompt and its sampled completion fit the models' 128 positions.
2. Students, 3 seeds, each method from the same initial weights and data order per seed:
   SFT-only (``--alpha 0``); off-policy forward KL (``--alpha 1``, the dataset's completions); on-policy
   (``--lmbda 1``: every step's completions sampled by the student with its HF `generate`, ``max_new_tokens`` 48)
   with reverse KL and with JSD; mixed (``--lmbda 0.5``, reverse KL); and on-policy reverse KL against the teacher
   served by vLLM (``--teacher_server``, its top-64 on the sampled rows, `make vllm-env`).
3. Held-out: the completions of held-out files' pieces after their prompts: the student's cross-entropy on them
   (nats per completion token), paired per seed against SFT-only and against off-policy forward KL.

Writes `on_policy_kd.{json,md}` to --output_dir (default benchmarks/quality/results) and the table into
docs/benchmarks.md between ``<!-- experiment:on-policy:start -->`` and ``<!-- experiment:on-policy:end -->``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # benchmarks/

from _common import machine, replace_readme_block  # noqa: E402
from kd_vs_sft import MAX_LENGTH, PLANS, cli, prepare, say  # noqa: E402
from stdlib_corpus import build as build_corpus  # noqa: E402

README_MARKERS = ("<!-- experiment:on-policy:start -->", "<!-- experiment:on-policy:end -->")
NEW_TOKENS = 48  # prompt (<= 96 characters) + sampled tokens stay inside the models' 128 positions
METHODS = {  # name: (alpha, divergence, extra CLI flags; "served": against the teacher's vLLM server)
    "sft": (0.0, "forward_kl", {}),
    "off-policy forward KL": (1.0, "forward_kl", {}),
    "on-policy reverse KL": (1.0, "reverse_kl", {"lmbda": 1.0}),
    "on-policy JSD": (1.0, "jsd", {"lmbda": 1.0}),
    "mixed λ=0.5 reverse KL": (1.0, "reverse_kl", {"lmbda": 0.5}),
    "on-policy reverse KL, served teacher": (1.0, "reverse_kl", {"lmbda": 1.0, "served": True}),
}
SMOKE_METHODS = ["sft", "on-policy reverse KL"]


def split(text: str) -> dict:
    """A piece as prompt–completion: cut at the line break nearest a third of it, at most 96 characters in (else
    there)."""
    third = min(len(text) // 3, 96)
    breaks = [i + 1 for i, c in enumerate(text) if c == "\n" and i + 1 <= 96 and i + 1 < len(text) - 8
              and text[: i + 1].strip()]  # a prompt with something in it
    cut = min(breaks, key=lambda i: abs(i - third)) if breaks else max(third, len(text) - len(text.lstrip()) + 1)
    return {"prompt": text[:cut], "completion": text[cut:]}


@torch.no_grad()
def completion_ce(model_dir: Path, rows: list[dict]) -> float:
    """Mean cross-entropy (nats) of the model on the completion tokens of `rows`, after their prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    total, count = 0.0, 0
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        ids = (prompt + tokenizer(row["completion"], add_special_tokens=False)["input_ids"])[:MAX_LENGTH]
        if len(ids) <= len(prompt):
            continue
        logits = model.eval()(torch.tensor([ids])).logits[0, :-1].float()
        target = torch.tensor(ids[1:])
        losses = torch.nn.functional.cross_entropy(logits, target, reduction="none")[len(prompt) - 1:]
        total, count = total + losses.sum().item(), count + losses.numel()
    return total / count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--output_dir", default=str(HERE / "results"))
    parser.add_argument("--work_dir", default=None)
    args = parser.parse_args(argv)
    plan = dict(PLANS["smoke" if args.smoke else "full"])
    methods = SMOKE_METHODS if args.smoke else list(METHODS)
    work = Path(args.work_dir or ROOT / "outputs" / ("on_policy_kd_smoke" if args.smoke else "on_policy_kd")).resolve()
    torch.set_num_threads(1)
    from datasets import Dataset, load_dataset

    begin = time.time()
    data = work / "corpus"
    build_corpus(data, max_chars=plan["max_chars"], train_pieces=plan["train_pieces"],
                 heldout_pieces=plan["heldout_pieces"])
    corpus = load_dataset("json", data_files={s: str(data / f"{s}.jsonl") for s in ("train", "heldout")})
    rows = {name: [split(t) for t in corpus[name]["text"]] for name in ("train", "heldout")}
    Dataset.from_list(rows["train"]).to_json(str(data / "train_prompt_completion.jsonl"))
    paths = prepare(work, plan, list(corpus["train"]["text"]))
    teacher, first = work / "teacher", plan["seeds"][0]
    say("training the teacher on the whole pieces")
    cli(paths["teacher_init"], paths[f"student_init_{first}"], teacher, data=data / "train.jsonl",
        steps=plan["teacher_steps"], batch=plan["teacher_batch"], seed=0, alpha=0.0, divergence="forward_kl",
        save_every=None, learning_rate=plan["teacher_learning_rate"])

    def student(seed: int, method: str, url: str | None) -> dict:
        alpha, divergence, extra = METHODS[method]
        extra = {k: v for k, v in extra.items() if k != "served"} | {"max_new_tokens": NEW_TOKENS}
        init, out = paths[f"student_init_{seed}"], work / "students" / f"{method.replace(' ', '_')}_s{seed}"
        served = METHODS[method][2].get("served")
        if served:
            # the server's context is the models' 128 positions, one of which vLLM's own generated token takes
            extra |= {"teacher_server": url, "teacher_server_top_k": 64, "max_length": MAX_LENGTH - 1}
        named = "teacher" if served else teacher if alpha > 0 else init  # a server is asked by its served name
        seconds = cli(init, named, out, data=data / "train_prompt_completion.jsonl",
                      steps=plan["steps"], batch=plan["batch"], seed=seed, alpha=alpha, divergence=divergence,
                      save_every=None, extra=extra)
        ce = completion_ce(out, rows["heldout"])
        say(f"{method} seed {seed}: held-out completion CE {ce:.4f} ({seconds:.0f} s)")
        return {"method": method, "seed": seed, "seconds": seconds, "heldout_ce": ce}

    local = [(s, m) for m in methods if not METHODS[m][2].get("served") for s in plan["seeds"]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda job: student(*job, None), local))
    served = [m for m in methods if METHODS[m][2].get("served")]
    if served:
        from trl_distill.testing import vllm_server

        with vllm_server(teacher, name="teacher") as url:
            runs += [student(s, m, url) for m in served for s in plan["seeds"]]
    report = {"plan": plan, "methods": methods, "new_tokens": NEW_TOKENS, "runs": runs,
              "teacher_heldout_ce": completion_ce(teacher, rows["heldout"]),
              "initial_student_ce": completion_ce(paths[f"student_init_{first}"], rows["heldout"]),
              "seconds": time.time() - begin, "machine": machine()}
    report["summary"] = summarize(report)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "on_policy_kd" + ("_smoke" if args.smoke else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / f"{stem}.md").write_text("# On-policy KD vs off-policy and SFT-only\n\n" + table)
    if not args.smoke:
        replace_readme_block(README_MARKERS, table)
    print(table)


def summarize(report: dict) -> dict:
    """Per method: mean held-out CE, and per seed its difference to SFT-only and to off-policy forward KL."""
    by = {(r["method"], r["seed"]): r["heldout_ce"] for r in report["runs"]}
    seeds = report["plan"]["seeds"]
    out = {}
    for method in report["methods"]:
        row = {"mean": statistics.mean(by[method, s] for s in seeds)}
        for base in ("sft", "off-policy forward KL"):
            if base in report["methods"] and base != method:
                deltas = [by[method, s] - by[base, s] for s in seeds]
                row[base] = {"deltas": deltas, "better": sum(d < 0 for d in deltas)}
        out[method] = row
    return out


def markdown(report: dict) -> str:
    seeds, summary = report["plan"]["seeds"], report["summary"]
    by = {(r["method"], r["seed"]): r["heldout_ce"] for r in report["runs"]}
    lines = ["| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | vs SFT-only (seeds better) | "
             "vs off-policy forward KL (seeds better) |", "|---|" + "---|" * (len(seeds) + 3)]
    def versus(row: dict, base: str) -> str:
        if base not in row:
            return "—"
        return f"{statistics.mean(row[base]['deltas']):+.4f} ({row[base]['better']}/{len(seeds)})"

    for method in report["methods"]:
        row = summary[method]
        cells = [f"{by[method, s]:.4f}" for s in seeds]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {row['mean']:.4f} | {versus(row, 'sft')} | "
                     f"{versus(row, 'off-policy forward KL')} |")
    m, plan = report["machine"], report["plan"]
    lines += ["", f"Held-out completion cross-entropy (nats per token, after the prompt) on stdlib files never trained "
              f"on; the teacher {report['teacher_heldout_ce']:.3f}, the untrained student "
              f"{report['initial_student_ce']:.3f}. Students: {plan['steps']} steps of {plan['batch']} rows, alpha 1 "
              f"for KD, temperature 1, {report['new_tokens']} new tokens a sampled completion. {m['cpus']} CPUs, "
              f"torch {m['torch']}, {m['date']}; {report['seconds']:.0f} s in all."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
