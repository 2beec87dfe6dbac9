"""A stock Hugging Face `Trainer` script turned into distillation. Only the lines marked `# distillation` differ
from the causal-LM fine-tuning script you already have.

    python examples/drop_in_trainer.py --student STUDENT_DIR --teacher TEACHER_DIR --output_dir OUT
    torchrun --nproc_per_node 2 examples/drop_in_trainer.py ... --deepspeed configs/deepspeed/zero2_student.json

The `TrainingArguments` stay as they are (they become a `DistillationConfig` with the default loss: half forward
KL to the teacher, half cross-entropy). With `--deepspeed` the teacher gets its own ZeRO-3 engine, partitioned
across the ranks. The data is the bundled corpus, tokenized the usual way.
"""

import argparse
import os

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

from trl_distill import DistillationTrainer  # distillation (was: from transformers import Trainer)

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "python_reference", "train.jsonl")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)  # distillation
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--deepspeed", default=None)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.student)
    model = AutoModelForCausalLM.from_pretrained(args.student)
    dataset = load_dataset("json", data_files=CORPUS, split="train")
    dataset = dataset.map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=128),
        batched=True, remove_columns=dataset.column_names,
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        max_steps=args.max_steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        deepspeed=args.deepspeed,
    )
    trainer = DistillationTrainer(  # distillation (was: Trainer)
        model=model,
        teacher_model=args.teacher,  # distillation
        args=training_args,
        train_dataset=dataset,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
