"""Does distillation work? Students trained SFT-only vs distilled from a better teacher, on a real corpus.

    make experiment          # 24 CPU-min; 18.5 min wall on 2 cores shared with other jobs (load ~3)
    python benchmarks/quality/kd_vs_sft.py [--smoke | --moe] [--output_dir DIR] [--work_dir DIR]

Everything goes through the project's own trainer, from the `trl-distill` CLI (`python -m trl_distill`, one
process, one thread per run, two runs at a time):

1. The corpus: the Python standard library's own source (`stdlib_corpus.py`), split into train and held-out BY
   FILE (hash of the path); the teacher's budget worth of train pieces and a small held-out sample are kept. A BPE
   tokenizer is trained on the kept train pieces only; the held-out files are never seen before scoring.
2. The teacher is trained on the train pieces with ``--alpha 0``, one pass: pure cross-entropy SFT through
   `DistillationTrainer`. The CLI needs some teacher even then; it gets an untrained student (the cheapest model
   sharing the tokenizer), whose term alpha=0 multiplies by zero.
3. Students of one size, steps, batch, data and seeds: SFT-only (``--alpha 0``, dummy teacher as above) and
   distilled with forward_kl, reverse_kl and jsd at alpha 1.0 (pure KD) and 0.5 (KD + CE), temperature 1.
   Seed s fixes a student's initial weights (the same for every method) and the data order (``--seed s``).
4. Once, the reference: the student size alone (SFT only) with the teacher's steps and batch, at the students'
   learning rate: what it reaches without a teacher at the teacher's budget (the smoke plan adds a KD run there).
5. Checkpoints every few steps are scored on the held-out pieces with the quickstart's `compare`: student
   cross-entropy (perplexity), KL(teacher||student) and top-1 agreement with the teacher.

Writes `kd_vs_sft.json`, `kd_vs_sft.md` (the table for the README) and `kd_vs_sft.png` to --output_dir
(default benchmarks/quality/results); models, checkpoints and CLI logs go to --work_dir. ``--moe``: the students are
Mixture-of-Experts models (Mixtral: 4 experts of half the dense width, 2 per token, their router's load-balancing loss
on, ``--router_aux_loss_coef 0.01``), SFT-only vs forward KL, into `kd_vs_sft_moe.*` (about 10 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # benchmarks/

from _common import machine as common_machine  # noqa: E402
from kd_vs_sft_report import markdown, plot, summarize, update_readme  # noqa: E402
from quickstart import MAX_LENGTH, compare  # noqa: E402
from stdlib_corpus import build as build_corpus  # noqa: E402

from trl_distill.testing import build_tiny_model, build_tokenizer  # noqa: E402

VOCAB_SIZE = 2048
SIZES = {  # Llama configs. Shallow: at these step counts 4 layers learnt slower per step than 2 (docs/benchmarks.md)
    "teacher": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4),
    "student": dict(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2),
}
SFT = {"name": "sft", "divergence": "forward_kl", "alpha": 0.0}  # alpha 0: the divergence is never used
METHODS = [SFT] + [
    {"name": f"{divergence}/a{alpha}", "divergence": divergence, "alpha": alpha}
    for divergence in ("forward_kl", "reverse_kl", "jsd")
    for alpha in (1.0, 0.5)
]
# The teacher reads each of its `train_pieces` once (one epoch: steps x batch pieces); students read a random part of
# them. `long_methods`: also trained once (first seed's student, data seed 0) with the teacher's own recipe; "sft"
# there is the reference: the student size alone with the teacher's budget.
PLANS = {
    "full": dict(seeds=[1, 2, 3], methods=[m["name"] for m in METHODS], vocab_size=VOCAB_SIZE, max_chars=352,
                 teacher_steps=800, teacher_batch=16, teacher_learning_rate=2e-3, train_pieces=800 * 16,
                 heldout_pieces=128, steps=300, batch=8, eval_every=60, long_methods=["sft"]),
    "moe": dict(seeds=[1, 2, 3], methods=["sft", "forward_kl/a1.0", "forward_kl/a0.5"], vocab_size=VOCAB_SIZE,
                max_chars=352, teacher_steps=800, teacher_batch=16, teacher_learning_rate=2e-3, train_pieces=800 * 16,
                heldout_pieces=128, steps=300, batch=8, eval_every=60, long_methods=["sft"], moe=True),
    "smoke": dict(seeds=[1], methods=["sft", "forward_kl/a0.5"], vocab_size=512, max_chars=352,
                  teacher_steps=4, teacher_batch=4, teacher_learning_rate=2e-3, train_pieces=64, heldout_pieces=8,
                  steps=4, batch=4, eval_every=2, long_methods=["sft", "forward_kl/a0.5"]),
}
# The --moe plan's students: Mixtral's MoE MLP in place of Llama's, 4 experts of half the width, 2 routed per token
# (a token's MLP is as wide as the dense student's), the router's load-balancing loss weighted as below
MOE_STUDENT = dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                   intermediate_size=SIZES["student"]["intermediate_size"] // 2, router_aux_loss_coef=0.01)
# Shared by every CLI run (teacher, reference and students)
TRAINING = dict(learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=20, temperature=1.0, max_length=MAX_LENGTH)
_LOCK = threading.Lock()
_START = time.time()


def say(message: str) -> None:
    with _LOCK:
        print(f"[{time.time() - _START:6.0f} s] {message}", flush=True)


# ---- Models and the CLI ----

def prepare(work: Path, plan: dict, train_texts: list[str]) -> dict[str, Path]:
    """Tokenizer (train split only), the untrained teacher and one untrained student per seed, saved under `work`."""
    tokenizer = build_tokenizer(vocab_size=plan["vocab_size"], corpus=train_texts)
    paths = {"teacher_init": work / "init" / "teacher"}
    models = {"teacher_init": build_tiny_model(tokenizer, "teacher", seed=0, max_position_embeddings=MAX_LENGTH,
                                               **SIZES["teacher"])}
    for seed in plan["seeds"]:
        paths[f"student_init_{seed}"] = work / "init" / f"student_seed{seed}"
        models[f"student_init_{seed}"] = (moe_student if plan.get("moe") else build_tiny_model)(
            tokenizer, "student", seed=seed, max_position_embeddings=MAX_LENGTH, **SIZES["student"])
    for key, model in models.items():
        model.save_pretrained(paths[key])
        tokenizer.save_pretrained(paths[key])
    return paths


def moe_student(tokenizer, size: str, seed: int, **dims):
    """The dense student's shape with a Mixtral MoE MLP (`MOE_STUDENT`), seeded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trl_distill.testing import tiny_llama_config

    dense = tiny_llama_config(tokenizer, size, **dims).to_dict()
    shape = {k: dense[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings",
                                   "pad_token_id", "bos_token_id", "eos_token_id")}
    config = AutoConfig.for_model(**{**shape, **MOE_STUDENT})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def n_params(path: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


def cli(student: Path, teacher: Path | None, out: Path, *, data: Path, steps: int, batch: int, seed: int, alpha: float,
        divergence: str, save_every: int | None, learning_rate: float | None = None,
        extra: dict | None = None) -> float:
    """One `python -m trl_distill` run on one thread; returns its wall time. The log lands in `out`.log. `extra`:
    more flags (e.g. ``lmbda``; a list is one flag's values); `teacher` None: `extra` names the teachers."""
    args = dict(TRAINING, learning_rate=learning_rate or TRAINING["learning_rate"], model_name_or_path=student,
                **({} if teacher is None else {"teacher_model_name_or_path": teacher}), output_dir=out,
                dataset_name=data, max_steps=steps,
                per_device_train_batch_size=batch, seed=seed, alpha=alpha, divergence=divergence,
                logging_steps=max(1, steps // 6),
                save_strategy="steps" if save_every else "no", bf16=False, gradient_checkpointing=False,
                report_to="none", disable_tqdm=True, use_cpu=True)
    if save_every:
        args.update(save_steps=save_every, save_only_model=True)
    args.update(extra or {})
    cmd = [sys.executable, "-m", "trl_distill"] + [item for k, v in args.items()  # a list: one flag, its values
                                                   for item in (f"--{k}", *map(str, v if isinstance(v, list) else [v]))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1"}
    log = out.parent / f"{out.name}.log"
    shutil.rmtree(out, ignore_errors=True)  # no stale checkpoints from an earlier run of different length
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log, "w") as f:
        result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}); end of {log}:\n{log.read_text()[-4000:]}")
    return time.time() - start


# ---- Held-out scoring (quickstart.compare) ----

class TeacherLogits:
    """The teacher's held-out logits, computed once: `compare` asks `teacher(ids).logits` for every checkpoint."""

    def __init__(self, teacher, tokenizer, texts: list[str]):
        self.logits = {}
        with torch.no_grad():
            for text in texts:
                ids = tokenizer(text, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")["input_ids"]
                self.logits[tuple(ids[0].tolist())] = teacher(ids).logits

    def __call__(self, ids):
        return SimpleNamespace(logits=self.logits[tuple(ids[0].tolist())])


def score(path: Path, step: int, heldout: SimpleNamespace) -> dict:
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(path).eval()
    m = compare(student, heldout.teacher, heldout.tokenizer, heldout.texts)
    return {"step": step, "ce": m["student_ce"], "ppl": float(torch.tensor(m["student_ce"]).exp()),
            "kl_to_teacher": m["kl_to_teacher"], "top1_agreement": m["top1_agreement"]}


def curve(out: Path, init: Path, heldout: SimpleNamespace) -> list[dict]:
    """Held-out metrics at step 0 (the initial student) and at every checkpoint of the run in `out`."""
    found = ((re.fullmatch(r"checkpoint-(\d+)", p.name), p) for p in out.iterdir())
    checkpoints = sorted((int(m.group(1)), p) for m, p in found if m)
    return [score(init, 0, heldout)] + [score(p, step, heldout) for step, p in checkpoints]


# ---- The experiment ----

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="KD vs SFT-only students on the Python standard library's source")
    parser.add_argument("--smoke", action="store_true", help="a few steps, 1 seed, 2 methods (well under a minute)")
    parser.add_argument("--moe", action="store_true", help="Mixture-of-Experts students (kd_vs_sft_moe.*)")
    parser.add_argument("--output_dir", default=str(HERE / "results"), help="where kd_vs_sft.{json,md,png} go")
    parser.add_argument("--work_dir", default=None, help="models, checkpoints, CLI logs (default outputs/kd_vs_sft)")
    parser.add_argument("--jobs", type=int, default=2, help="CLI runs at a time, one thread each")
    parser.add_argument("--report_only", action="store_true",
                        help="write the md, png and README table again from output_dir/kd_vs_sft.json")
    args = parser.parse_args(argv)
    plan = PLANS["smoke" if args.smoke else "moe" if args.moe else "full"]
    name = "kd_vs_sft_moe" if args.moe else "kd_vs_sft"
    out = Path(args.output_dir).resolve()
    readme = not (args.smoke or args.moe)  # the README's table is the dense students'
    if args.report_only:
        return write_report(json.loads((out / f"{name}.json").read_text()), out, readme=readme, name=name)
    work = Path(args.work_dir or ROOT / "outputs" / ("kd_vs_sft_smoke" if args.smoke else name)).resolve()
    torch.set_num_threads(1)
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    from datasets import load_dataset

    data = work / "corpus"
    corpus_info = build_corpus(data, max_chars=plan["max_chars"], train_pieces=plan["train_pieces"],
                               heldout_pieces=plan["heldout_pieces"])
    corpus = load_dataset("json", data_files={s: str(data / f"{s}.jsonl") for s in ("train", "heldout")})
    say(f"corpus: Python {corpus_info['python']} stdlib, {corpus_info['train_files']} train files "
        f"({len(corpus['train'])} pieces kept), {corpus_info['heldout_files']} held-out files "
        f"({len(corpus['heldout'])} pieces kept); tokenizer on the train pieces only; models -> {work}")
    train_texts, texts = list(corpus["train"]["text"]), list(corpus["heldout"]["text"])
    paths = prepare(work, plan, train_texts)
    runs, long_runs, info = experiment(plan, work, paths, texts, args.jobs)
    corpus_info["train_tokens"] = tokens(paths["teacher_init"], train_texts)
    corpus_info["heldout_tokens"] = tokens(paths["teacher_init"], texts)
    report = {"settings": settings(plan, paths, corpus_info), **info, "runs": runs,
              "summary": summarize(runs, plan["methods"]),
              "teacher_budget": {"runs": long_runs, "summary": summarize(long_runs, plan["long_methods"])},
              "wall_seconds": time.time() - _START, "machine": machine()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    write_report(report, out, readme=readme, name=name)


def write_report(report: dict, out: Path, readme: bool, name: str = "kd_vs_sft") -> None:
    """`name`.md and `name`.png in `out` and, for the full experiment, the README's table."""
    (out / f"{name}.md").write_text(markdown(report))
    plot(report, out / f"{name}.png")
    if readme:
        update_readme(report, ROOT / "docs" / "benchmarks.md")
    say(f"wrote {out}/{name}.{{json,md,png}}{' and the README table' if readme else ''}\n\n{markdown(report)}")


def experiment(plan: dict, work: Path, paths: dict, texts: list[str], jobs: int) -> tuple[list, list, dict]:
    """All CLI runs, two at a time: the teacher and the runs that need no trained teacher (SFT only) first, the
    longest first; then the KD runs. Returns the students' runs, the runs at the teacher's budget, teacher info."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher_dir, first, data = work / "teacher", plan["seeds"][0], work / "corpus" / "train.jsonl"
    dummy = paths[f"student_init_{first}"]  # the teacher of alpha=0 runs: never used, only loaded
    short = dict(steps=plan["steps"], batch=plan["batch"], save_every=plan["eval_every"])
    long = dict(steps=plan["teacher_steps"], batch=plan["teacher_batch"], save_every=max(1, plan["teacher_steps"] // 3))
    heldout_ready: Future = Future()

    def teacher_job() -> float:
        try:
            seconds = cli(paths["teacher_init"], dummy, teacher_dir, data=data, steps=long["steps"],
                          batch=long["batch"], seed=0, alpha=0.0, divergence="forward_kl", save_every=None,
                          learning_rate=plan["teacher_learning_rate"])
            tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
            model = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
            heldout_ready.set_result(SimpleNamespace(teacher=TeacherLogits(model, tokenizer, texts),
                                                     tokenizer=tokenizer, texts=texts))
        except BaseException as error:  # the KD runs wait on the teacher: let them fail too, not hang
            heldout_ready.set_exception(error)
            raise
        say(f"teacher trained in {seconds:.0f} s")
        return seconds

    def student_job(method: dict, init_seed: int, seed: int, budget: dict, group: str) -> dict:
        init, run_dir = paths[f"student_init_{init_seed}"], work / group / f"{method['name'].replace('/', '_')}_s{seed}"
        teacher = dummy
        if method["alpha"] > 0:
            heldout_ready.result()  # wait for the trained teacher
            teacher = teacher_dir
        extra = {"router_aux_loss_coef": MOE_STUDENT["router_aux_loss_coef"]} if plan.get("moe") else None
        seconds = cli(init, teacher, run_dir, data=data, seed=seed, alpha=method["alpha"],
                      divergence=method["divergence"], extra=extra, **budget)
        say(f"{group} {method['name']} seed {seed}: trained in {seconds:.0f} s")
        return {"method": method["name"], "divergence": method["divergence"], "alpha": method["alpha"], "seed": seed,
                "init_seed": init_seed, "seconds": seconds, "dir": run_dir, "init": init}

    def scored(group: str, future: Future) -> dict:
        run = future.result()
        run["curve"] = curve(run.pop("dir"), run.pop("init"), heldout_ready.result())
        say(f"{group} {run['method']} seed {run['seed']}: held-out CE {run['curve'][-1]['ce']:.4f}")
        return run

    # (method, initial student's seed, data seed, budget, group); the teacher-budget runs: one student, data seed 0
    todo = [(m, first, 0, long, "teacher_budget") for m in METHODS if m["name"] in plan["long_methods"]]
    todo += [(m, s, s, short, "students") for m in METHODS if m["name"] in plan["methods"] for s in plan["seeds"]]
    todo.sort(key=lambda job: (job[0]["alpha"] > 0, job[3] is short))  # stable: SFT first, long runs first
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        teacher_f = pool.submit(teacher_job)
        trained = [(job[4], pool.submit(student_job, *job)) for job in todo]
        scored_runs = [(group, pool.submit(scored, group, f)) for group, f in trained]
        runs = {group: [f.result() for g, f in scored_runs if g == group] for group in ("students", "teacher_budget")}
        heldout = heldout_ready.result()
        reference = next(r for r in runs["teacher_budget"] if r["alpha"] == 0)
        info = {"teacher": {"seconds": teacher_f.result(), "params": n_params(teacher_dir),
                            "heldout": score(teacher_dir, plan["teacher_steps"], heldout)},
                "reference_student": {"seconds": reference["seconds"], "heldout": reference["curve"][-1]}}
    return runs["students"], runs["teacher_budget"], info


def tokens(model_dir: Path, texts: list[str]) -> int:
    """Tokens the models read from `texts` (each truncated to MAX_LENGTH, as the CLI and the scoring do)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return sum(len(ids) for ids in tokenizer(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"])


def settings(plan: dict, paths: dict, corpus: dict) -> dict:
    return {**plan, "methods": [m for m in METHODS if m["name"] in plan["methods"]], "training": TRAINING,
            "sizes": {**SIZES, "student": {**SIZES["student"], **(MOE_STUDENT if plan.get("moe") else {})}},
            "student_params": n_params(paths[f"student_init_{plan['seeds'][0]}"]), "corpus": corpus}


def machine() -> dict:
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    # CPU seconds of this process and every CLI run; the load average shows whether others shared the CPUs
    return common_machine(cpu_seconds=sum(u.ru_utime + u.ru_stime for u in usage))


if __name__ == "__main__":
    main()
