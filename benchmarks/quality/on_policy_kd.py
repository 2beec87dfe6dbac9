"""Does on-policy distillation pay? Students judged by what they generate on a task with a checkable answer.

    make experiment-on-policy   # also run by `make experiment`
    python benchmarks/quality/on_policy_kd.py [--smoke] [--output_dir DIR] [--work_dir DIR] [--reuse_teacher]

The task: 2-digit multiplication worked out step by step (`arithmetic_task.py`: about 40 one-character tokens a
completion; held-out prompts never trained on), scored by the `last_number` verifier. Every run is the `trl-distill`
CLI (one process, one thread, two runs at a time), its held-out curve from its own generation eval
(``--eval_reward_funcs last_number``: pass@1 on the first `curve_prompts` test prompts, greedy, every `eval_every`
steps).

1. The teacher (Llama, 2 layers, hidden 128) trained with ``--alpha 0`` to high held-out pass@1.
2. Per seed, a smaller student (hidden 32, one head of 32: vLLM's CPU attention takes it) SFT-warm-started for
   `warm_steps` (``--alpha 0``, no teacher) to partial accuracy.
3. From that warm checkpoint and the same data order, `steps` more steps of each method: SFT-only (``--alpha 0``,
   the teacher loaded only to score samples), off-policy forward KL, on-policy reverse KL (``--lmbda 1``, HF
   `generate`; and from a vLLM rollout server, ``--use_vllm``), mixed λ = 0.5 reverse KL, on-policy JSD.
4. Scored at the end on every test prompt, greedy: pass@1 (per prompt, so two methods are compared on the same
   prompts: the standard error of their difference is the paired one), the teacher's NLL per token of the student's
   completions (from ``teacher(...).logits``), and the teacher-forced CE on the test completions (``eval_ce_loss``).
   The curves give the area under pass@1 and pass@1 at equal wall-clock time (the SFT run's).

Writes `on_policy_kd.{json,md}` to --output_dir (default benchmarks/quality/results) and the table into
docs/benchmarks.md between ``<!-- experiment:on-policy:start -->`` and ``<!-- experiment:on-policy:end -->``.
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
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # benchmarks/

import arithmetic_task  # noqa: E402
from _common import machine, replace_readme_block  # noqa: E402
from kd_vs_sft import cli, say  # noqa: E402
from on_policy_report import curve_of, markdown, summarize  # noqa: E402

MARKERS = {"full": ("<!-- experiment:on-policy:start -->", "<!-- experiment:on-policy:end -->"),
           "objective": ("<!-- experiment:on-policy-objective:start -->",
                         "<!-- experiment:on-policy-objective:end -->"),
           "warmer": ("<!-- experiment:on-policy-warmer:start -->", "<!-- experiment:on-policy-warmer:end -->")}
NEW_TOKENS = 48  # a completion is about 40 tokens and its EOS
SIZES = {
    "teacher": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4),
    "student": dict(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=1),
}
METHODS = {  # name: (alpha, divergence, extra CLI flags; "vllm": the student's rollouts from a vLLM server)
    "sft": (0.0, "forward_kl", {}),
    "off-policy forward KL": (1.0, "forward_kl", {}),
    "on-policy reverse KL": (1.0, "reverse_kl", {"lmbda": 1.0}),
    "on-policy reverse KL, vLLM rollouts": (1.0, "reverse_kl", {"lmbda": 1.0, "vllm": True}),
    "mixed λ=0.5 reverse KL": (1.0, "reverse_kl", {"lmbda": 0.5}),
    "on-policy JSD": (1.0, "jsd", {"lmbda": 1.0}),
    "on-policy forward KL": (1.0, "forward_kl", {"lmbda": 1.0}),
    # the sampled-token objective (issue 44): the policy gradient on the sampled tokens, alone and with the task's
    # verifier as its reward
    "on-policy sampled-token": (1.0, "reverse_kl", {"lmbda": 1.0, "on_policy_objective": "sampled_token"}),
    "on-policy sampled-token + task reward": (1.0, "reverse_kl", {"lmbda": 1.0, "on_policy_objective": "sampled_token",
                                                                  "task_reward_funcs": "last_number"}),
}
MAIN = ["sft", "off-policy forward KL", "on-policy reverse KL", "on-policy reverse KL, vLLM rollouts",
        "mixed λ=0.5 reverse KL", "on-policy JSD"]
PLANS = {
    "full": dict(seeds=[1, 2, 3], train_rows=100000, test_rows=1000, curve_prompts=200, teacher_steps=5000,
                 teacher_batch=32, warm_steps=2000, steps=800, batch=32, eval_every=100, methods=MAIN),
    # the same from students warm-started twice as long (does on-policy pay from a better student?), fewer methods
    "warmer": dict(seeds=[1, 2, 3], train_rows=100000, test_rows=1000, curve_prompts=200, teacher_steps=5000,
                   teacher_batch=32, warm_steps=4000, steps=800, batch=32, eval_every=100,
                   methods=["sft", "off-policy forward KL", "on-policy reverse KL", "on-policy forward KL"]),
    # the on-policy objectives side by side (issue 44): the sampled-token policy gradient, with and without the task
    # reward, against the full-distribution reverse KL and SFT-only
    "objective": dict(seeds=[1, 2, 3], train_rows=100000, test_rows=1000, curve_prompts=200, teacher_steps=5000,
                      teacher_batch=32, warm_steps=2000, steps=800, batch=32, eval_every=100,
                      methods=["sft", "on-policy reverse KL", "on-policy sampled-token",
                               "on-policy sampled-token + task reward"], bases=["sft", "on-policy reverse KL"]),
    "smoke": dict(seeds=[1], train_rows=400, test_rows=12, curve_prompts=6, teacher_steps=8, teacher_batch=8,
                  warm_steps=4, steps=4, batch=4, eval_every=2, methods=["sft", "on-policy reverse KL"]),
}


def prepare(work: Path, plan: dict) -> dict[str, Path]:
    """The task's splits, its one-character tokenizer, the untrained teacher and one untrained student per seed."""
    paths = arithmetic_task.write(work / "data", plan["train_rows"], plan["test_rows"])
    return paths | untrained_models(work, plan["seeds"])


def untrained_models(work: Path, seeds: list[int]) -> dict[str, Path]:
    """The untrained teacher (``teacher_init``) and one untrained student per seed (``student_init_SEED``), each
    saved with the one-character tokenizer under ``work/init``."""
    from trl_distill.testing import build_tiny_model

    paths, tokenizer = {}, arithmetic_task.tokenizer()
    models = {"teacher_init": build_tiny_model(tokenizer, "teacher", seed=0, **SIZES["teacher"])}
    for seed in seeds:
        models[f"student_init_{seed}"] = build_tiny_model(tokenizer, "student", seed=seed, **SIZES["student"])
    for key, model in models.items():
        paths[key] = work / "init" / key
        model.save_pretrained(paths[key])
        tokenizer.save_pretrained(paths[key])
    return paths


@torch.no_grad()
def score(model_dir: Path, teacher_dir: Path, rows: list[dict], batch: int = 100) -> dict:
    """Greedy completions of every test prompt: which pass `last_number`, and the teacher's NLL of them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_distill.evaluation.verifiers import resolve_verifiers

    (verifier,) = resolve_verifiers(["last_number"], "answer", None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    passed, nll, tokens, started = [], 0.0, 0, time.perf_counter()
    for start in range(0, len(rows), batch):
        chunk = rows[start: start + batch]
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in chunk]
        width = max(map(len, prompts))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)[:, width:]
        texts = []
        for prompt, row in zip(prompts, out.tolist(), strict=True):
            row = row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
            full = torch.tensor([prompt + row])
            logits = teacher(full).logits[0, len(prompt) - 1: -1]
            nll += torch.nn.functional.cross_entropy(logits, full[0, len(prompt):], reduction="sum").item()
            tokens += len(row)
        passed += verifier.score([r["prompt"] for r in chunk], texts, {"answer": [r["answer"] for r in chunk]})
    return {"passed": passed, "pass@1": sum(passed) / len(passed), "teacher_nll": nll / max(tokens, 1),
            "score_seconds": time.perf_counter() - started}


def eval_flags(plan: dict) -> dict:
    return {"eval_strategy": "steps", "eval_steps": plan["eval_every"], "dataset_test_split": "test",
            "eval_reward_funcs": "last_number", "eval_generation_prompts": plan["curve_prompts"],
            "eval_max_new_tokens": NEW_TOKENS, "per_device_eval_batch_size": 50, "max_new_tokens": NEW_TOKENS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--plan", choices=["full", "warmer", "objective"], default="full",
                        help="warmer: students warm-started 4000 steps instead of 2000 (4 methods); objective: the "
                        "sampled-token objective, with and without the task reward, against reverse KL and SFT")
    parser.add_argument("--output_dir", default=str(HERE / "results"))
    parser.add_argument("--work_dir", default=None)
    parser.add_argument("--reuse_teacher", action="store_true",
                        help="keep the teacher an earlier run of the same plan trained in --work_dir")
    args = parser.parse_args(argv)
    name = "smoke" if args.smoke else args.plan
    plan = dict(PLANS[name])
    work = Path(args.work_dir or HERE.parents[1] / "outputs" / f"on_policy_kd_{name}")
    work = work.resolve()
    torch.set_num_threads(1)
    from datasets import load_dataset

    begin = time.time()
    paths = prepare(work, plan)
    data = paths["train"].parent
    test = list(load_dataset("json", data_files=str(paths["test"]), split="train"))
    teacher, kept = work / "teacher", work / "teacher.json"
    if args.reuse_teacher and kept.exists():  # the same plan's teacher, trained and scored before: deterministic
        teacher_seconds, teacher_score = json.loads(kept.read_text())
        say(f"reusing the teacher in {teacher}")
    else:
        say(f"training the teacher ({plan['teacher_steps']} steps)")
        teacher_seconds = cli(paths["teacher_init"], None, teacher, data=data, steps=plan["teacher_steps"],
                              batch=plan["teacher_batch"], seed=0, alpha=0.0, divergence="forward_kl",
                              save_every=None)
        teacher_score = score(teacher, teacher, test)
        kept.write_text(json.dumps([teacher_seconds, teacher_score]))
    say(f"teacher: held-out pass@1 {teacher_score['pass@1']:.3f} ({teacher_seconds:.0f} s)")

    def warm(seed: int) -> dict:
        out = work / f"warm{plan['warm_steps']}" / f"s{seed}"
        seconds = cli(paths[f"student_init_{seed}"], None, out, data=data, steps=plan["warm_steps"],
                      batch=plan["batch"], seed=seed, alpha=0.0, divergence="forward_kl", save_every=None)
        result = score(out, teacher, test)
        say(f"warm student seed {seed}: pass@1 {result['pass@1']:.3f} ({seconds:.0f} s)")
        return {"seed": seed, "seconds": seconds, **result}

    with ThreadPoolExecutor(max_workers=2) as pool:
        warmed = list(pool.map(warm, plan["seeds"]))

    def student(seed: int, method: str, url: str | None) -> dict:
        alpha, divergence, extra = METHODS[method]
        flags = {k: v for k, v in extra.items() if k != "vllm"} | eval_flags(plan)
        if extra.get("vllm"):
            from trl_distill.testing import free_port

            flags |= {"use_vllm": True, "vllm_server_base_url": url, "vllm_group_port": free_port()}
        out = work / f"students{plan['warm_steps']}" / f"{method.replace(' ', '_').replace(',', '')}_s{seed}"
        seconds = cli(work / f"warm{plan['warm_steps']}" / f"s{seed}", teacher, out, data=data, steps=plan["steps"],
                      batch=plan["batch"], seed=seed, alpha=alpha, divergence=divergence, save_every=None, extra=flags)
        result = score(out, teacher, test)
        say(f"{method} seed {seed}: pass@1 {result['pass@1']:.3f}, teacher NLL {result['teacher_nll']:.3f} "
            f"({seconds:.0f} s)")
        return {"method": method, "seed": seed, "seconds": seconds, **result, **curve_of(out)}

    local = [(s, m) for m in plan["methods"] if not METHODS[m][2].get("vllm") for s in plan["seeds"]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda job: student(*job, None), local))
    served = [m for m in plan["methods"] if METHODS[m][2].get("vllm")]
    if served:
        from trl_distill.testing import vllm_server

        with vllm_server(work / f"warm{plan['warm_steps']}" / f"s{plan['seeds'][0]}", name="student",
                         rollout=True) as url:
            runs += [student(s, m, url) for m in served for s in plan["seeds"]]
    report = {"plan": plan, "sizes": SIZES, "new_tokens": NEW_TOKENS, "runs": runs, "warm": warmed,
              "teacher": {**teacher_score, "seconds": teacher_seconds}, "seconds": time.time() - begin,
              "machine": machine()}
    report["summary"] = summarize(report)
    for run in report["runs"] + report["warm"]:
        run["passed"] = "".join(str(int(p)) for p in run["passed"])  # kept per prompt, compactly
    report["teacher"]["passed"] = "".join(str(int(p)) for p in report["teacher"]["passed"])
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "on_policy_kd" + ("" if name == "full" else f"_{name}")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / f"{stem}.md").write_text("# On-policy KD vs off-policy and SFT-only, judged by generations\n\n" + table)
    if name in MARKERS:
        replace_readme_block(MARKERS[name], table)
    print(table)


if __name__ == "__main__":
    main()
