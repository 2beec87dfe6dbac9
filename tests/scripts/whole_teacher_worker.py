"""One process, a ZeRO-2 student: the teacher held whole (the default) and, in the same process, kept ZeRO-3 as
asked (`teacher_deepspeed`). Writes what each run's teacher is and its logged losses to <out>/whole_teacher.json.

    python whole_teacher_worker.py <pair dir> <out dir>
"""

import json
import logging
import sys
from pathlib import Path

from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import logged, synthetic_prompt_completion, tiny_run_settings

ROOT = Path(__file__).resolve().parents[2]


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> None:
    pair, out = Path(sys.argv[1]), Path(sys.argv[2])
    records = {}
    for mode in ("whole", "zero3"):
        lines = Lines()
        logging.getLogger("trl_distill").addHandler(lines)
        asked = {} if mode == "whole" else {"teacher_deepspeed": {"zero_optimization": {"stage": 3}}}
        args = DistillationConfig(**tiny_run_settings(
            output_dir=str(out / mode), max_steps=4, per_device_train_batch_size=4, save_strategy="no",
            deepspeed=str(ROOT / "configs/deepspeed/zero2_student.json")), **asked)
        trainer = DistillationTrainer(str(pair / "student"), str(pair / "teacher"), args=args,
                                      train_dataset=synthetic_prompt_completion(32),
                                      processing_class=AutoTokenizer.from_pretrained(str(pair / "tokenizer")))
        trainer.train()
        teacher = trainer.teacher
        records[mode] = {"engine": type(teacher.engine).__name__, "module": type(teacher.module).__name__,
                         "partitioned": any(hasattr(p, "ds_tensor") for p in teacher.module.parameters()),
                         "dtype": str(teacher.module.dtype), "losses": logged(trainer.state.log_history),
                         "said": [line for line in lines.lines if "held whole" in line]}
        logging.getLogger("trl_distill").removeHandler(lines)
    (out / "whole_teacher.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
