"""`make bench-long`: the longest row each setup trains, and its memory and time, with sequence parallelism 2 and
without, on 2 processes (ZeRO-2 student + ZeRO-3 teacher, fp32, this CPU).

Lengths double from 2k; a setup fits a length when its run succeeds with every rank's peak RSS within the budget
(`--budget_gib` per rank, default 4: a stand-in for a GPU's memory; filling this machine's RAM would take hours of
CPU attention). The models are tiny in width but wide in the MLP (intermediate 8192), so activations, not weights,
fill the memory, as they do at long context. Writes benchmarks/results/long_context.json and the table in
docs/benchmarks.md.

    python benchmarks/long_context.py [--budget_gib 4] [--max_tokens 65536]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import ROOT, machine, replace_readme_block  # noqa: E402

from trl_distill.testing import build_tiny_model, build_tokenizer, launch, read_rank_records  # noqa: E402

MARKERS = ("<!-- bench:long:start -->", "<!-- bench:long:end -->")
SHAPES = {"teacher": dict(hidden_size=64, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=2),
          "student": dict(hidden_size=64, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=2)}


def save_models(directory: Path, max_tokens: int) -> None:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(directory / "tokenizer")
    for seed, (size, shape) in enumerate(SHAPES.items()):
        model = build_tiny_model(tokenizer, size, seed=seed, max_position_embeddings=max_tokens, **shape)
        model.save_pretrained(directory / size)
        tokenizer.save_pretrained(directory / size)


def one_run(models: Path, out: Path, mode: str, tokens: int, budget: int) -> dict:
    try:
        launch(Path(__file__).parent / "long_context_worker.py", str(models), str(out), mode, str(tokens),
               timeout=900)
    except Exception as error:  # noqa: BLE001 - an out-of-memory kill or a timeout: it did not fit
        return {"tokens": tokens, "fits": False, "error": str(error).splitlines()[0][:200]}
    ranks = read_rank_records(out)
    peak = max(r["peak_rss"] for r in ranks)
    setup = max(r["setup_peak_rss"] for r in ranks)
    step = statistics.median(r["step_seconds"][-1] for r in ranks)
    return {"tokens": tokens, "fits": peak <= budget, "peak_rss": peak, "setup_peak_rss": setup,
            "training_increase": peak - setup, "step_seconds": step, "losses": ranks[0]["losses"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget_gib", type=float, default=4.0)
    parser.add_argument("--max_tokens", type=int, default=65536)
    options = parser.parse_args()
    budget = int(options.budget_gib * 2**30)
    runs: dict[str, list[dict]] = {"dp": [], "sp": []}
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "models"
        save_models(models, options.max_tokens)
        for mode in runs:
            tokens = 2048
            while tokens <= options.max_tokens:
                run = one_run(models, Path(tmp) / f"{mode}{tokens}", mode, tokens, budget)
                runs[mode].append(run)
                print(json.dumps({"mode": mode, **run}), flush=True)
                if not run["fits"]:
                    break
                tokens *= 2
    longest = {mode: max([r["tokens"] for r in rs if r["fits"]], default=0) for mode, rs in runs.items()}
    both = [(d, s) for d in runs["dp"] for s in runs["sp"] if d["tokens"] == s["tokens"] and "peak_rss" in d
            and "peak_rss" in s]
    result = {"machine": machine(budget_gib=options.budget_gib), "shapes": SHAPES, "runs": runs, "longest": longest,
              "longest_ratio": longest["sp"] / longest["dp"] if longest["dp"] else None,
              "peak_ratio": {d["tokens"]: s["peak_rss"] / d["peak_rss"] for d, s in both},
              "increase_ratio": {d["tokens"]: s["training_increase"] / d["training_increase"] for d, s in both},
              "step_ratio": {d["tokens"]: s["step_seconds"] / d["step_seconds"] for d, s in both}}
    path = ROOT / "benchmarks" / "results" / "long_context.json"
    path.write_text(json.dumps(result, indent=2))
    replace_readme_block(MARKERS, table(result))
    print(table(result))


def table(result: dict) -> str:
    gib = 2**30
    rows = ["| tokens | no SP: peak RSS / rank | SP 2: peak RSS / rank | ratio | training's increase, ratio "
            "| step time, SP 2 / no SP |", "|---|---|---|---|---|---|"]
    dp = {r["tokens"]: r for r in result["runs"]["dp"]}
    for s in result["runs"]["sp"]:
        d = dp.get(s["tokens"], {})

        def peak(r):
            return "did not run" if not r else f"{r['peak_rss'] / gib:.2f} GiB" + ("" if r["fits"] else " (over)") \
                if "peak_rss" in r else "failed"

        t = s["tokens"]
        ratios = [result[key].get(t) for key in ("peak_ratio", "increase_ratio", "step_ratio")]
        cells = " | ".join("" if r is None else f"{r:.2f}" for r in ratios)
        rows.append(f"| {t} | {peak(d)} | {peak(s)} | {cells} |")
    longest = result["longest"]
    rows.append("")
    rows.append(f"Longest row trained within {result['machine']['budget_gib']:g} GiB per rank: {longest['dp']} tokens "
                f"without SP, {longest['sp']} with SP 2 ({result['longest_ratio'] or 0:.1f}x).")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
