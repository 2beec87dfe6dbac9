"""The quickstart: teach a small teacher a bundled corpus, distil it into a smaller student, show before/after.

    make quickstart          # or: python examples/quickstart.py [--output_dir DIR] [--nproc 2]

1. Trains a BPE tokenizer on the bundled corpus (`examples/data/python_reference`: the Python Language
   Reference topics that ship with CPython, split into train and held-out by topic), then builds a teacher
   (~1.4M parameters) and a smaller student (~0.3M) from configs.
2. Gives the teacher real knowledge: trains it on the corpus with `trl.SFTTrainer` (one process).
3. Distils it into the student with the `trl-distill` CLI on 2 processes, the headline setup: ZeRO-2 student
   and ZeRO-3 teacher (DeepSpeed on CPU works out of the box), via
   `accelerate launch --config_file configs/accelerate/zero2_student_zero3_teacher.yaml -m trl_distill
   --config configs/recipes/quickstart.yaml ...`.
4. Prints, on the held-out topics: KL(teacher‖student), top-1 agreement with the teacher and the student's
   cross-entropy, before and after (and the teacher's own cross-entropy for reference), and writes the run's
   report (`trl-distill report`): ``distilled/report.png`` (its curves) and ``distilled/report.md``.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

from trl_distill import divergence
from trl_distill.report import write_report
from trl_distill.runtime.distributed import free_port
from trl_distill.testing import build_tiny_model, build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "examples", "data", "python_reference")
SIZES = {  # Llama configs; both read sequences of up to 128 tokens
    "teacher": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4),
    "student": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2),
}
MAX_LENGTH = 128


@torch.no_grad()
def compare(student, teacher, tokenizer, texts: list[str]) -> dict[str, float]:
    """Per-token held-out KL(teacher‖student), top-1 agreement, student and teacher cross-entropy."""
    sums = dict.fromkeys(("kl_to_teacher", "top1_agreement", "student_ce", "teacher_ce"), 0.0)
    tokens = 0
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")["input_ids"]
        s, t, target = student(ids).logits[0, :-1], teacher(ids).logits[0, :-1], ids[0, 1:]
        n = target.numel()
        sums["kl_to_teacher"] += divergence(s, t, "forward_kl").item() * n
        sums["top1_agreement"] += (s.argmax(-1) == t.argmax(-1)).sum().item()
        sums["student_ce"] += torch.nn.functional.cross_entropy(s, target, reduction="sum").item()
        sums["teacher_ce"] += torch.nn.functional.cross_entropy(t, target, reduction="sum").item()
        tokens += n
    return {key: value / tokens for key, value in sums.items()}


def teach_teacher(out: str, steps: int, train) -> tuple:
    """Steps 1-2: a tokenizer trained on the corpus' train split, a teacher and a student built from configs, the
    teacher trained with `trl.SFTTrainer`; both saved (with the tokenizer) to ``out/teacher`` and ``out/student``."""
    print(f"[1/4] training a tokenizer on {len(train)} pieces of the Python reference; building models")
    tokenizer = build_tokenizer(vocab_size=2048, corpus=train["text"])
    teacher = build_tiny_model(tokenizer, "teacher", seed=0, max_position_embeddings=MAX_LENGTH, **SIZES["teacher"])
    student = build_tiny_model(tokenizer, "student", seed=1, max_position_embeddings=MAX_LENGTH, **SIZES["student"])

    print(f"[2/4] teaching the teacher the corpus ({steps} steps, trl.SFTTrainer, 1 process)")
    sft = SFTConfig(
        output_dir=os.path.join(out, "teacher_sft"), max_steps=steps, per_device_train_batch_size=16,
        max_length=MAX_LENGTH, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=20, logging_steps=100,
        save_strategy="no", bf16=False, activation_checkpointing=False, report_to="none", seed=0,
        use_cpu=not torch.cuda.is_available(),  # on the GPU where there is one; fp32 as the recipe (same numbers)
    )
    SFTTrainer(teacher, args=sft, train_dataset=train.select_columns("text"), processing_class=tokenizer).train()
    for name, model in (("teacher", teacher), ("student", student)):
        model.save_pretrained(os.path.join(out, name))
        tokenizer.save_pretrained(os.path.join(out, name))
    return tokenizer, teacher, student


def main():
    parser = argparse.ArgumentParser(description="trl_distill quickstart")
    parser.add_argument("--output_dir", default="outputs/quickstart")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--teacher_steps", type=int, default=300)
    parser.add_argument("--distill_steps", type=int, default=None, help="default: the recipe's max_steps")
    parser.add_argument("--logging_steps", type=int, default=None, help="default: the recipe's logging_steps")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    start = time.time()
    out = os.path.abspath(args.output_dir)
    paths = {name: os.path.join(out, name) for name in ("teacher", "student", "distilled")}
    corpus = load_dataset("json", data_files={s: os.path.join(CORPUS, f"{s}.jsonl") for s in ("train", "heldout")})
    heldout = corpus["heldout"]["text"]

    tokenizer, teacher, student = teach_teacher(out, args.teacher_steps, corpus["train"])
    teacher.eval()
    before = compare(student.eval(), teacher, tokenizer, heldout)

    print(f"      teacher trained; {time.time() - start:.0f} s so far")
    print(f"[3/4] distilling with the trl-distill CLI on {args.nproc} processes: ZeRO-2 student + ZeRO-3 teacher")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", "configs/accelerate/zero2_student_zero3_teacher.yaml",
        f"--num_processes={args.nproc}", f"--main_process_port={free_port()}",
        "-m", "trl_distill", "--config", "configs/recipes/quickstart.yaml",
        "--model_name_or_path", paths["student"], "--teacher_model_name_or_path", paths["teacher"],
        "--dataset_name", os.path.join(CORPUS, "train.jsonl"), "--output_dir", paths["distilled"],
    ]
    if args.distill_steps is not None:
        cmd += ["--max_steps", str(args.distill_steps)]
    if args.logging_steps is not None:
        cmd += ["--logging_steps", str(args.logging_steps)]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})

    print(f"      distilled; {time.time() - start:.0f} s so far")
    print("[4/4] held-out comparison (held-out topics, every token)")
    distilled = AutoModelForCausalLM.from_pretrained(paths["distilled"]).eval()
    after = compare(distilled, teacher, tokenizer, heldout)
    print(f"\n{'metric':<18}{'before':>10}{'after':>10}")
    for key in ("kl_to_teacher", "top1_agreement", "student_ce"):
        print(f"{key:<18}{before[key]:>10.4f}{after[key]:>10.4f}")
    print(f"{'(teacher_ce)':<18}{before['teacher_ce']:>10.4f}{after['teacher_ce']:>10.4f}")
    print(f"\nstudent held-out perplexity {math.exp(before['student_ce']):.1f} -> {math.exp(after['student_ce']):.1f} "
          f"(teacher {math.exp(after['teacher_ce']):.1f}); distilled student saved to {paths['distilled']}")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"before": before, "after": after, "seconds": time.time() - start}, f, indent=2)
    picture, text = write_report(paths["distilled"])  # what `trl-distill report OUT` writes
    print(f"the run's curves: {picture} (summary: {text})")
    print(f"quickstart finished in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
