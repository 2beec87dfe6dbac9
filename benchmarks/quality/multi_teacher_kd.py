"""Two teachers at once: does a student distilled from both specialists beat each single-teacher student?

    make experiment-multi      # python benchmarks/quality/multi_teacher_kd.py [--smoke] [--output_dir DIR]

Everything goes through the `trl-distill` CLI (one process, one thread per run, two runs at a time):

1. The corpus: the Python standard library's source (`stdlib_corpus.py`), split into train and held-out by file,
   then into two halves BY TOPIC: a file's topic is its top-level package or module (`email/...` -> `email`), and a
   topic goes to half A or B by the SHA-1 of its name, so no package has files in both halves. A BPE tokenizer is
   trained on the train pieces.
2. Teacher A is trained (cross-entropy only, ``--alpha 0``) on half A's train pieces, teacher B on half B's.
3. Students of one size, steps, batch, data and seeds, all on the union of both halves' train pieces (KD + CE,
   alpha 0.5, forward KL, temperature 1): from A alone, from B alone, from both routed (each row learns from its
   half's teacher: ``--teachers a=A b=B``, the row's ``teacher`` column), from both mixed with equal weights
   (``--teacher_combine mixture``), and SFT only for reference. Seed s fixes a student's initial weights and its
   data order.
4. Each final student is scored on the held-out pieces of both halves: token-weighted cross-entropy on the union
   and on each half.

Goal (issue 30): the two-teacher student beats each single-teacher student on the union, 3 seeds of 3, routed and
mixed. Writes `multi_teacher_kd.{json,md}` to --output_dir (default benchmarks/quality/results) and the table in
docs/benchmarks.md; models and CLI logs go to --work_dir.
"""

from __future__ import annotations

import argparse
import hashlib
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

from kd_vs_sft import SIZES, cli, machine, say  # noqa: E402
from quickstart import MAX_LENGTH  # noqa: E402
from stdlib_corpus import build as build_corpus  # noqa: E402

from trl_distill.testing import build_tiny_model, build_tokenizer  # noqa: E402

METHODS = ("sft", "teacher_a", "teacher_b", "both_routed", "both_mixed")
PLANS = {
    "full": dict(seeds=[1, 2, 3], vocab_size=2048, max_chars=352, train_pieces=12800, heldout_pieces=256,
                 teacher_steps=600, teacher_batch=16, teacher_learning_rate=2e-3, steps=300, batch=8),
    "smoke": dict(seeds=[1], vocab_size=512, max_chars=352, train_pieces=64, heldout_pieces=16,
                  teacher_steps=3, teacher_batch=4, teacher_learning_rate=2e-3, steps=3, batch=4),
}
README_START, README_END = "<!-- experiment:multi_teacher:start -->", "<!-- experiment:multi_teacher:end -->"


def half_of(file: str) -> str:
    """"a" or "b": the topic half of a stdlib file (its top-level package or module, hashed)."""
    topic = file.split("/", 1)[0].removesuffix(".py")
    return "a" if int(hashlib.sha1(topic.encode()).hexdigest(), 16) % 2 == 0 else "b"


def split_by_topic(corpus_dir: Path) -> dict:
    """Add each piece's half (the `teacher` column) to train/heldout.jsonl and write each half's train pieces."""
    counts = {}
    for split in ("train", "heldout"):
        rows = [json.loads(line) for line in (corpus_dir / f"{split}.jsonl").read_text().splitlines()]
        for row in rows:
            row["teacher"] = half_of(row["file"])
        (corpus_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for half in ("a", "b"):
            mine = [r for r in rows if r["teacher"] == half]
            counts[f"{split}_{half}"] = {"pieces": len(mine), "files": len({r["file"] for r in mine}),
                                         "topics": len({r["file"].split("/", 1)[0] for r in mine})}
            if split == "train":
                (corpus_dir / f"train_{half}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mine))
    return counts


def heldout_ce(model_dir: Path, rows: list[dict]) -> dict[str, float]:
    """Token-weighted cross-entropy of the model on the held-out pieces: the union and each half."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    sums = {"union": [0.0, 0], "a": [0.0, 0], "b": [0.0, 0]}
    with torch.no_grad():
        for row in rows:
            ids = tokenizer(row["text"], truncation=True, max_length=MAX_LENGTH, return_tensors="pt")["input_ids"]
            if ids.shape[1] < 2:
                continue
            n = ids.shape[1] - 1
            loss = model(ids, labels=ids).loss.item() * n
            for key in ("union", row["teacher"]):
                sums[key][0] += loss
                sums[key][1] += n
    return {key: total / max(count, 1) for key, (total, count) in sums.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Students from one teacher vs from two (routed, mixed)")
    parser.add_argument("--smoke", action="store_true", help="a few steps, 1 seed (well under a minute)")
    parser.add_argument("--output_dir", default=str(HERE / "results"))
    parser.add_argument("--work_dir", default=None, help="default outputs/multi_teacher_kd")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    plan = PLANS["smoke" if args.smoke else "full"]
    out = Path(args.output_dir).resolve()
    work = Path(args.work_dir or ROOT / "outputs" / ("multi_teacher_smoke" if args.smoke else "multi_teacher_kd"))
    work = work.resolve()
    torch.set_num_threads(1)
    start = time.time()
    corpus_dir = work / "corpus"
    corpus = build_corpus(corpus_dir, max_chars=plan["max_chars"], train_pieces=plan["train_pieces"],
                          heldout_pieces=plan["heldout_pieces"])
    corpus["halves"] = split_by_topic(corpus_dir)
    train_texts = [json.loads(line)["text"] for line in (corpus_dir / "train.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (corpus_dir / "heldout.jsonl").read_text().splitlines()]
    say(f"corpus: {corpus['halves']}")
    tokenizer = build_tokenizer(vocab_size=plan["vocab_size"], corpus=train_texts)
    inits = {"teacher": work / "init" / "teacher", **{s: work / "init" / f"student_seed{s}" for s in plan["seeds"]}}
    for key, path in inits.items():
        size, seed = ("teacher", 0) if key == "teacher" else ("student", key)
        build_tiny_model(tokenizer, size, seed=seed, max_position_embeddings=MAX_LENGTH, **SIZES[size]).save_pretrained(
            path)
        tokenizer.save_pretrained(path)
    dummy = inits[plan["seeds"][0]]  # the teacher the CLI needs for alpha 0 runs: never used, only loaded
    teachers = {half: work / f"teacher_{half}" for half in ("a", "b")}

    def train_teacher(half: str) -> float:
        return cli(inits["teacher"], dummy, teachers[half], data=corpus_dir / f"train_{half}.jsonl",
                   steps=plan["teacher_steps"], batch=plan["teacher_batch"], seed=0, alpha=0.0,
                   divergence="forward_kl", save_every=None, learning_rate=plan["teacher_learning_rate"])

    def student(method: str, seed: int) -> dict:
        run_dir = work / "students" / f"{method}_s{seed}"
        teacher, extra, alpha = dummy, {}, 0.5
        if method == "sft":
            alpha = 0.0
        elif method in ("teacher_a", "teacher_b"):
            teacher = teachers[method[-1]]
        else:
            teacher = None
            extra = {"teachers": [f"a={teachers['a']}", f"b={teachers['b']}"],
                     "teacher_combine": "route" if method == "both_routed" else "mixture"}
        seconds = cli(inits[seed], teacher, run_dir, data=corpus_dir / "train.jsonl", steps=plan["steps"],
                      batch=plan["batch"], seed=seed, alpha=alpha, divergence="forward_kl", save_every=None,
                      extra=extra)
        ce = heldout_ce(run_dir, heldout)
        say(f"{method} seed {seed}: {seconds:.0f} s, held-out CE {ce['union']:.4f} (a {ce['a']:.4f}, b {ce['b']:.4f})")
        return {"method": method, "seed": seed, "seconds": seconds, "heldout_ce": ce}

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # the teachers first, SFT students beside them
        trained = {half: pool.submit(train_teacher, half) for half in teachers}
        sft = [pool.submit(student, "sft", s) for s in plan["seeds"]]
        teacher_seconds = {half: future.result() for half, future in trained.items()}
        say(f"teachers trained: {teacher_seconds}")
        kd = [pool.submit(student, m, s) for s in plan["seeds"] for m in METHODS if m != "sft"]
        runs = [f.result() for f in sft + kd]
    report = {"settings": {**plan, "sizes": SIZES, "corpus": corpus, "alpha": 0.5, "divergence": "forward_kl"},
              "teachers": {h: {"seconds": teacher_seconds[h], "heldout_ce": heldout_ce(teachers[h], heldout)}
                           for h in teachers},
              "runs": runs, "summary": summarize(runs, plan["seeds"]), "wall_seconds": time.time() - start,
              "machine": machine()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "multi_teacher_kd.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "multi_teacher_kd.md").write_text(markdown(report))
    if not args.smoke:
        update_page(report, ROOT / "docs" / "benchmarks.md")
    say(f"wrote {out}/multi_teacher_kd.{{json,md}}\n\n{markdown(report)}")


def summarize(runs: list[dict], seeds: list[int]) -> dict:
    """Per method: held-out CE on the union, per seed and mean; for the two-teacher students, the seeds on which
    they beat both single-teacher students."""
    ce = {m: {r["seed"]: r["heldout_ce"]["union"] for r in runs if r["method"] == m} for m in METHODS}
    out = {}
    for method in METHODS:
        values = [ce[method][s] for s in seeds if s in ce[method]]
        entry = {"per_seed": values, "mean": sum(values) / max(len(values), 1)}
        if method.startswith("both"):
            entry["seeds_beating_both"] = sum(ce[method][s] < min(ce["teacher_a"][s], ce["teacher_b"][s])
                                              for s in seeds)
        out[method] = entry
    return out


def markdown(report: dict) -> str:
    s, summary = report["settings"], report["summary"]
    rows = ["| student | held-out CE, union (mean) | per seed | beats both single-teacher students |",
            "|---|---|---|---|"]
    for method in METHODS:
        entry = summary[method]
        beats = f"{entry['seeds_beating_both']}/{len(s['seeds'])} seeds" if "seeds_beating_both" in entry else ""
        rows.append(f"| {method} | {entry['mean']:.4f} | {', '.join(f'{v:.4f}' for v in entry['per_seed'])} | "
                    f"{beats} |")
    teachers = ", ".join(f"teacher {h}: held-out CE {t['heldout_ce']['union']:.4f} (a {t['heldout_ce']['a']:.4f}, "
                         f"b {t['heldout_ce']['b']:.4f})" for h, t in report["teachers"].items())
    halves = s["corpus"]["halves"]
    return "\n".join([
        f"Students ({s['steps']} steps x {s['batch']} pieces, alpha {s['alpha']}, {s['divergence']}) on the stdlib "
        f"corpus split by topic: half a {halves['train_a']['pieces']} train pieces ({halves['train_a']['topics']} "
        f"topics), half b {halves['train_b']['pieces']} ({halves['train_b']['topics']}); {teachers}. Wall "
        f"{report['wall_seconds'] / 60:.1f} min.", "", *rows, ""])


def update_page(report: dict, page: Path) -> None:
    text = page.read_text()
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    page.write_text(f"{head}{README_START}\n{markdown(report)}{README_END}{tail}")


if __name__ == "__main__":
    main()
