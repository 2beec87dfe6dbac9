"""What the several-teacher tests share: a routed dataset, a trainer, and the KD formula on the models' own logits
(the second teacher is `conftest.second_teacher`)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import extras_of, loss_tokens
from trl_distill.loss.divergences import DIVERGENCES
from trl_distill.testing import logged, synthetic_prompt_completion, tiny_run_settings

KEYS = ("loss", "kd_loss", "ce_loss")


def dataset(names=None, rows=32):
    data = synthetic_prompt_completion(rows)
    return data if names is None else data.add_column("teacher", [names[i % len(names)] for i in range(rows)])


def trainer_for(tiny_pair, tmp_path, data, teacher=None, **overrides) -> DistillationTrainer:
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3,
                                 save_strategy="no", use_cpu=True, kd_temperature_scaling=False)
    settings.update(overrides)
    return DistillationTrainer(tiny_pair["student"], teacher, args=DistillationConfig(**settings), train_dataset=data,
                               processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]))


def trained(trainer) -> list[dict]:
    trainer.train()
    return trainer.state.log_history


def assert_same_losses(got: list[dict], want: list[dict], rel: float = 1e-6) -> None:
    for key in KEYS:
        a, b = logged(got, key), logged(want, key)
        assert sorted(a) == sorted(b) and len(a) == 3, key
        for step in b:
            assert a[step] == pytest.approx(b[step], rel=rel), (key, step)


def full_logits(model, batch):
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    return model(**inputs).logits[:, :-1].double()  # position t predicts target t


def formula(trainer, batch, teachers, divergence="forward_kl"):
    """The KD of `batch` from the models' own logits: per loss token, its teacher's divergence (routed), the one
    against the mixture, or the weighted sum; summed over loss tokens / their count."""
    args, temperature = trainer.args, trainer.args.temperature
    _, mask = loss_tokens(batch)
    s_logp = F.log_softmax(full_logits(trainer.model, batch) / temperature, -1)[mask]
    t_logps = [F.log_softmax(full_logits(t, batch) / temperature, -1)[mask] for t in teachers]
    fn = lambda s, t: DIVERGENCES[divergence](s, t, args.beta, args.skew_alpha)  # noqa: E731
    if args.teacher_combine == "route":
        per_row = extras_of(batch).route[:, None].expand_as(mask)[mask]
        per_token = torch.stack([fn(s_logp, t) for t in t_logps])  # [teachers, n]
        parts = [per_token[i][per_row == i].sum() / mask.sum() for i in range(len(teachers))]
        return sum(parts), parts
    if args.teacher_combine == "mixture":
        mixed = torch.log(sum(w * t.exp() for w, t in zip(trainer.run_plan.teacher_weights, t_logps)))
        return fn(s_logp, mixed).sum() / mask.sum(), None
    parts = [w * fn(s_logp, t).sum() / mask.sum() for w, t in zip(trainer.run_plan.teacher_weights, t_logps)]
    return sum(parts), parts
