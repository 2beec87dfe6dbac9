"""Does cross-tokenizer distillation work? A teacher with one tokenizer, students with another: KD vs SFT-only.

    make experiment-cross    # about 7 minutes on 2 cores (385 s measured)
    python benchmarks/quality/cross_tokenizer_kd.py [--smoke] [--output_dir DIR] [--work_dir DIR]

Like `kd_vs_sft.py` (same corpus, model sizes, recipe and CLI runs), but the two sides do not share a tokenizer:

1. The corpus: the Python standard library's own source, split into train and held-out by file.
2. Two byte-level BPE tokenizers with different merges: the teacher's (4096 tokens) trained on the first half of
   the train pieces, the students' (2048) on the second half.
3. The teacher (its tokenizer) is trained with ``--alpha 0``, one pass over the train pieces.
4. Students (their tokenizer), 3 seeds: SFT-only (``--alpha 0``) and distilled from the teacher across tokenizers
   (``--alpha 0.5``, forward KL, the trainer's cross-tokenizer mode switching on by itself), same initial weights and
   data order per seed.
5. Each student's held-out cross-entropy on its own tokens, paired by seed.

Writes `cross_tokenizer_kd.{json,md,png}` to --output_dir (default benchmarks/quality/results) and the README table
between ``<!-- experiment:cross:start -->`` and ``<!-- experiment:cross:end -->``.
"""

from __future__ import annotations

import argparse
import json
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
from kd_vs_sft import MAX_LENGTH, SIZES, cli, say  # noqa: E402
from stdlib_corpus import build as build_corpus  # noqa: E402

from trl_distill.testing import build_tiny_model, build_tokenizer  # noqa: E402

README_MARKERS = ("<!-- experiment:cross:start -->", "<!-- experiment:cross:end -->")
PLANS = {
    "full": dict(seeds=[1, 2, 3], teacher_vocab=4096, student_vocab=2048, max_chars=352, teacher_steps=800,
                 teacher_batch=16, teacher_learning_rate=2e-3, train_pieces=800 * 16, heldout_pieces=128, steps=300,
                 batch=8, alpha=0.5),
    "smoke": dict(seeds=[1], teacher_vocab=512, student_vocab=384, max_chars=352, teacher_steps=4, teacher_batch=4,
                  teacher_learning_rate=2e-3, train_pieces=64, heldout_pieces=8, steps=4, batch=4, alpha=0.5),
}


def prepare(work: Path, plan: dict, texts: list[str]) -> dict[str, Path]:
    """The two tokenizers (each on its half of the train pieces), the untrained teacher and a student per seed."""
    half = len(texts) // 2
    tokenizers = {"teacher": build_tokenizer(plan["teacher_vocab"], corpus=texts[:half]),
                  "student": build_tokenizer(plan["student_vocab"], corpus=texts[half:])}
    paths = {"teacher_init": work / "init" / "teacher"}
    models = {"teacher_init": build_tiny_model(tokenizers["teacher"], "teacher", seed=0,
                                               max_position_embeddings=MAX_LENGTH, **SIZES["teacher"])}
    for seed in plan["seeds"]:
        paths[f"student_{seed}"] = work / "init" / f"student_seed{seed}"
        models[f"student_{seed}"] = build_tiny_model(tokenizers["student"], "student", seed=seed,
                                                     max_position_embeddings=MAX_LENGTH, **SIZES["student"])
    for key, model in models.items():
        model.save_pretrained(paths[key])
        tokenizers["teacher" if key == "teacher_init" else "student"].save_pretrained(paths[key])
    return paths


@torch.no_grad()
def heldout_ce(model_dir: Path, texts: list[str]) -> float:
    """Mean next-token cross-entropy (nats) of the model on its own tokens of the held-out pieces."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    total, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")["input_ids"]
        if ids.shape[1] < 2:
            continue
        logits = model.eval()(ids).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return total / count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--output_dir", default=str(HERE / "results"))
    parser.add_argument("--work_dir", default=None)
    args = parser.parse_args(argv)
    plan = PLANS["smoke" if args.smoke else "full"]
    work = Path(args.work_dir or ROOT / "outputs" / ("cross_kd_smoke" if args.smoke else "cross_kd")).resolve()
    torch.set_num_threads(1)
    from datasets import load_dataset

    begin = time.time()
    data = work / "corpus"
    build_corpus(data, max_chars=plan["max_chars"], train_pieces=plan["train_pieces"],
                 heldout_pieces=plan["heldout_pieces"])
    corpus = load_dataset("json", data_files={s: str(data / f"{s}.jsonl") for s in ("train", "heldout")})
    texts = list(corpus["heldout"]["text"])
    paths = prepare(work, plan, list(corpus["train"]["text"]))
    teacher = work / "teacher"
    say("training the teacher (its own tokenizer)")
    cli(paths["teacher_init"], paths["teacher_init"], teacher, data=data / "train.jsonl", steps=plan["teacher_steps"],
        batch=plan["teacher_batch"], seed=0, alpha=0.0, divergence="forward_kl", save_every=None,
        learning_rate=plan["teacher_learning_rate"])

    def student(seed: int, method: str) -> dict:
        init, out = paths[f"student_{seed}"], work / "students" / f"{method}_s{seed}"
        alpha = plan["alpha"] if method == "kd" else 0.0
        seconds = cli(init, teacher if method == "kd" else init, out, data=data / "train.jsonl", steps=plan["steps"],
                      batch=plan["batch"], seed=seed, alpha=alpha, divergence="forward_kl", save_every=None)
        log = (out.parent / f"{out.name}.log").read_text()
        ce = heldout_ce(out, texts)
        say(f"{method} seed {seed}: held-out CE {ce:.4f} ({seconds:.0f} s)")
        return {"method": method, "seed": seed, "seconds": seconds, "heldout_ce": ce,
                "cross_tokenizer": "cross-tokenizer distillation" in log}

    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda job: student(*job), [(s, m) for s in plan["seeds"] for m in ("sft", "kd")]))
    pairs = [{"seed": s, **{r["method"]: r["heldout_ce"] for r in runs if r["seed"] == s}} for s in plan["seeds"]]
    report = {"plan": plan, "teacher_heldout_ce": heldout_ce(teacher, texts),
              "initial_student_ce": heldout_ce(paths[f"student_{plan['seeds'][0]}"], texts), "runs": runs,
              "pairs": pairs, "kd_better": sum(p["kd"] < p["sft"] for p in pairs), "seconds": time.time() - begin,
              "machine": machine()}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "cross_tokenizer_kd" + ("_smoke" if args.smoke else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / f"{stem}.md").write_text("# Cross-tokenizer KD vs SFT-only\n\n" + table)
    plot(report, out / f"{stem}.png")
    if not args.smoke:
        replace_readme_block(README_MARKERS, table)
    print(table)


def markdown(report: dict) -> str:
    plan = report["plan"]
    lines = ["| seed | SFT-only held-out CE | cross-tokenizer KD held-out CE | KD − SFT |", "|---|---|---|---|"]
    lines += [f"| {p['seed']} | {p['sft']:.4f} | {p['kd']:.4f} | {p['kd'] - p['sft']:+.4f} |" for p in report["pairs"]]
    m = report["machine"]
    lines += ["", f"KD better on {report['kd_better']} of {len(report['pairs'])} seeds. Teacher: byte-level BPE "
              f"{plan['teacher_vocab']} tokens (trained on one half of the train pieces), held-out CE "
              f"{report['teacher_heldout_ce']:.3f} on its own tokens; students: BPE {plan['student_vocab']} (the "
              f"other half: other merges), {plan['steps']} steps of {plan['batch']}, KD at alpha {plan['alpha']} "
              f"(forward KL), the untrained student {report['initial_student_ce']:.3f}. Held-out: stdlib files never "
              f"trained on, each student on its own tokens. {m['cpus']} CPUs, torch {m['torch']}, {m['date']}; "
              f"{report['seconds']:.0f} s in all."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for pair in report["pairs"]:
        ax.plot([0, 1], [pair["sft"], pair["kd"]], marker="o", label=f"seed {pair['seed']}")
    ax.set_xticks([0, 1], ["SFT only", "cross-tokenizer KD"])
    ax.set_ylabel("held-out CE (nats/token)")
    ax.set_title("Students with another tokenizer than the teacher's")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
