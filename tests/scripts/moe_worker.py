"""A Mixture-of-Experts teacher under ZeRO-3 beside a Mixture-of-Experts student under ZeRO-2 (its router loss on),
2 processes of one row each; or ``single``: the same two rows per step in 1 process without DeepSpeed. The teacher's
routing is forced by token id (even ids to experts 0 and 1, odd ids to 2 and 3) and each row holds ids of one parity,
so in every teacher forward two of its experts receive no token at all (and on the other rank, the other two).
Learning rate 0: every step sees the same weights. The teacher's checkpoint keeps each expert's tensors apart (as
`save_pretrained` writes Mixtral): each rank reads its partition's bytes of them. Records into ``<out>/rank<k>.json``
the logged losses, the tokens each teacher expert received in each forward, the teacher's share held, the checkpoint
bytes this rank read, and, for each row trained on, its parity and the router loss of the student's own forward.

    moe_worker.py PAIR OUT [single]
"""

import os
import sys

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import tiny_run_settings, write_rank_record

STUDENT_ZERO2 = {"zero_optimization": {"stage": 2, "overlap_comm": False}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
ROWS = 2
LENGTH = 24


def rows(vocab: int) -> Dataset:
    """Language-modeling rows of token ids: row r holds ids of parity r % 2 (rank r % 2's rows, in 2 processes)."""
    generator = torch.Generator().manual_seed(0)
    ids = [(torch.randint(2, vocab // 2, (LENGTH,), generator=generator) * 2 + r % 2).clamp(max=vocab - 1).tolist()
           for r in range(ROWS)]
    return Dataset.from_dict({"input_ids": ids})


class ForcedRouting:
    """Routes each token of the teacher by its id's parity, and counts the tokens each expert receives."""

    def __init__(self, teacher):
        self.ids, self.counts = None, []  # per teacher forward: the tokens each expert received
        teacher.register_forward_pre_hook(self.take_ids, with_kwargs=True)
        for module in teacher.modules():
            if type(module).__name__ == "MixtralTopKRouter":
                module.register_forward_hook(self.route)

    def take_ids(self, module, args, kwargs):
        self.ids = kwargs["input_ids"].reshape(-1)

    def route(self, module, args, output):
        logits, _, _ = output
        odd = (self.ids.to(logits.device) % 2).unsqueeze(1)
        indices = torch.cat([odd * 2, odd * 2 + 1], dim=1)  # even: experts 0, 1; odd: experts 2, 3
        scores = torch.softmax(logits.float().gather(1, indices), dim=-1).to(logits.dtype)
        self.counts.append(torch.bincount(indices.reshape(-1).cpu(), minlength=4).tolist())
        return logits, scores, indices


class RecordingTrainer(DistillationTrainer):
    """Records, per training micro-batch, its rows' id parities and the router loss of the student's own forward."""

    trained: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training:
            with torch.no_grad():
                own = self.student(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                                   output_router_logits=True, use_cache=False).aux_loss.item()
            self.trained.append({"parities": [sorted({i % 2 for i in row}) for row in inputs["input_ids"].tolist()],
                                 "own_aux": own})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def count_bytes_read() -> list:
    """Wrap the partitioned loader's reads: the bytes this rank reads of the teacher's checkpoint."""
    import trl_distill.teacher.zero3_loading as loading

    read, counted = loading._read_into, []

    def counting(*args, **kwargs):
        counted.append(read(*args, **kwargs))
        return counted[-1]

    loading._read_into = counting
    return counted


def main():
    pair, out = sys.argv[1:3]
    bytes_read = count_bytes_read()
    single = len(sys.argv) > 3 and sys.argv[3] == "single"
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "student"))
    settings = dict(output_dir=out, per_device_train_batch_size=ROWS if single else 1, max_steps=2,
                    learning_rate=0.0, save_strategy="no", alpha=0.5, router_aux_loss_coef=0.02, max_length=None,
                    teacher_model_name_or_path=os.path.join(pair, "teacher"), use_cpu=single,
                    **({} if single else {"deepspeed": STUDENT_ZERO2}))
    args = DistillationConfig(**tiny_run_settings(**settings))
    trainer = RecordingTrainer(os.path.join(pair, "student"), args=args, train_dataset=rows(len(tok)),
                               processing_class=tok)
    trainer.trained = []
    trainer.prepare_teacher()
    routing = ForcedRouting(trainer.teacher.module)
    trainer.train()
    params = list(trainer.teacher.module.parameters())
    share = 1.0 if single else sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)
    write_rank_record(out, trainer.args.process_index, {
        "rank": trainer.args.process_index, "teacher_share": share, "expert_tokens": routing.counts,
        "log": [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h],
        "trained": trainer.trained, "bytes_read": sum(bytes_read),
    })


if __name__ == "__main__":
    main()
