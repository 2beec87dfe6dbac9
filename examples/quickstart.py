"""The quickstart: build a tiny teacher and student, teach the teacher, distil it, show before/after.

    make quickstart          # or: python examples/quickstart.py [--output_dir DIR] [--nproc 2]

1. Builds a tokenizer, a teacher (~200k parameters) and a smaller student (~37k) locally, from configs.
2. Teaches the teacher the bundled toy task (reverse a list of words) with `trl.SFTTrainer`, one process.
3. Distils it into the student with `DistillationTrainer` on 2 processes: ZeRO-2 student, ZeRO-3 teacher
   (DeepSpeed on CPU works out of the box), via `examples/distill.py`.
4. Prints student–teacher KL, top-1 agreement and the student's held-out loss, before and after.
"""

import argparse
import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from trl_distill import divergence
from trl_distill.distributed import free_port
from trl_distill.testing import build_tiny_model, build_tokenizer, synthetic_prompt_completion

HERE = os.path.dirname(os.path.abspath(__file__))


@torch.no_grad()
def compare(student, teacher, tokenizer, dataset) -> dict[str, float]:
    """Held-out student–teacher KL(p‖q), top-1 agreement and student CE on completion tokens."""
    kl = agree = ce = n = 0.0
    for row in dataset:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        full = tokenizer(row["prompt"] + row["completion"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([full + [tokenizer.eos_token_id]])
        mask = torch.zeros(ids.shape[1] - 1, dtype=torch.bool)
        mask[len(prompt) - 1 :] = True
        s, t = student(ids).logits[0, :-1], teacher(ids).logits[0, :-1]
        tokens = mask.sum().item()
        kl += divergence(s, t, "forward_kl", mask=mask).item() * tokens
        agree += (s.argmax(-1) == t.argmax(-1))[mask].sum().item()
        ce += torch.nn.functional.cross_entropy(s[mask], ids[0, 1:][mask], reduction="sum").item()
        n += tokens
    return {"kl_to_teacher": kl / n, "top1_agreement": agree / n, "heldout_ce": ce / n}


def main():
    parser = argparse.ArgumentParser(description="trl_distill quickstart")
    parser.add_argument("--output_dir", default="outputs/quickstart")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--teacher_steps", type=int, default=300)
    parser.add_argument("--distill_steps", type=int, default=150)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out = os.path.abspath(args.output_dir)
    paths = {name: os.path.join(out, name) for name in ("teacher", "student", "distilled")}

    print("[1/4] building a tokenizer, a teacher and a student locally")
    tokenizer = build_tokenizer()
    teacher, student = build_tiny_model(tokenizer, "teacher", seed=0), build_tiny_model(tokenizer, "student", seed=1)
    heldout = synthetic_prompt_completion(64, seed=99)

    print(f"[2/4] teaching the teacher the toy task ({args.teacher_steps} steps, trl.SFTTrainer)")
    sft = SFTConfig(
        output_dir=os.path.join(out, "teacher_sft"), max_steps=args.teacher_steps, per_device_train_batch_size=16,
        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=10, logging_steps=50, save_strategy="no",
        bf16=False, gradient_checkpointing=False, report_to="none", use_cpu=True, disable_tqdm=True,
    )
    SFTTrainer(teacher, args=sft, train_dataset=synthetic_prompt_completion(512, seed=0),
               processing_class=tokenizer).train()
    for name, model in (("teacher", teacher), ("student", student)):
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    teacher.eval()
    before = compare(student.eval(), teacher, tokenizer, heldout)

    print(f"[3/4] distilling on {args.nproc} processes: ZeRO-2 student + ZeRO-3 teacher (DeepSpeed)")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", os.path.join(HERE, "distill.py"),
           "--teacher", paths["teacher"], "--student", paths["student"], "--output_dir", paths["distilled"],
           "--max_steps", str(args.distill_steps)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    print("[4/4] held-out comparison (completion tokens)")
    distilled = AutoModelForCausalLM.from_pretrained(paths["distilled"]).eval()
    after = compare(distilled, teacher, AutoTokenizer.from_pretrained(paths["distilled"]), heldout)
    with open(os.path.join(paths["distilled"], "distill_summary.json")) as f:
        share = json.load(f)["teacher_share_per_rank"]
    print(f"\n{'metric':<18}{'before':>10}{'after':>10}")
    for key in before:
        print(f"{key:<18}{before[key]:>10.4f}{after[key]:>10.4f}")
    print(f"\nteacher parameters held per rank during distillation: {share:.2f} of the teacher")
    print(f"distilled student saved to {paths['distilled']}")


if __name__ == "__main__":
    main()
