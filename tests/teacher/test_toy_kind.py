"""A new kind of teacher added through the registry alone (`trl_distill.teacher.kinds.register_kind`), in this one
file: a teacher whose signal is the uniform distribution over the vocabulary, selected as a user selects a kind
(``--teacher_model_name_or_path toy:uniform``, or ``--teachers toy=toy:uniform``). Its KD is then the forward KL from
the uniform distribution, ``-log V - mean_v log s_v`` per loss token, computed here from the student's own logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import loss_tokens
from trl_distill.run_plan import resolve
from trl_distill.teacher.base import TeacherSource
from trl_distill.teacher.kinds import TEACHER_KINDS, SourceForm, TeacherKind, register_kind
from trl_distill.teacher.rows import DenseRows
from trl_distill.teacher.specs import parse_teacher
from trl_distill.testing import logged, synthetic_prompt_completion, tiny_run_settings

ROWS = 8


class UniformTeacher(TeacherSource):
    """The core only: every loss token's teacher logits are zeros over the run's vocabulary (uniform)."""

    name = "toy:uniform"

    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> DenseRows:
        logits = torch.zeros(*mask.shape, self.context.vocab_size, device=mask.device)
        return DenseRows(logits, None)  # no lm_head: the states are the teacher's own logits


@pytest.fixture
def toy_kind():
    """The kind registered for the test, and gone again after it (the support matrix lists every registered kind)."""
    kind = register_kind(TeacherKind("toy", UniformTeacher, lambda spec, context: UniformTeacher(),
                                     form=SourceForm(prefixes=("toy:",))))
    yield kind
    del TEACHER_KINDS["toy"]


def uniform_kd(model, batch: dict, vocab: int) -> float:
    """Forward KL(uniform || student) per loss token, averaged over the batch's loss tokens (float64)."""
    _, mask = loss_tokens(batch)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    log_s = F.log_softmax(logits[:, : mask.shape[1], :vocab], -1)[mask]  # position t predicts token t + 1
    return (-math.log(vocab) - log_s.mean(-1)).mean().item()


@pytest.mark.parametrize("selected", [{"teacher_model_name_or_path": "toy:uniform"},
                                      {"teachers": ["toy=toy:uniform"]}], ids=["single", "teachers"])
def test_a_kind_registered_in_one_file_trains_on_its_signal(toy_kind, tiny_pair, tmp_path, selected):
    args = DistillationConfig(**tiny_run_settings(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=ROWS, alpha=1.0, temperature=1.0,
        divergence="forward_kl", kd_temperature_scaling=False, save_strategy="no", use_cpu=True, **selected))
    assert [spec.kind for spec in resolve(args).teachers] == (["toy"] if "teachers" in selected else [])
    trainer = DistillationTrainer(tiny_pair["student"], args=args, train_dataset=synthetic_prompt_completion(ROWS),
                                  processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]))
    leaf = trainer.teacher.members["toy"] if "teachers" in selected else trainer.teacher
    assert type(leaf) is UniformTeacher
    # the whole dataset is each step's one batch: the step's mean over its loss tokens does not depend on the order
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    want = uniform_kd(trainer.model, batch, trainer.vocab_size)
    with torch.no_grad():  # (as evaluation computes it: kept out of the training logs)
        trainer.model.eval()
        _, out = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    assert out["kd_loss"].item() == pytest.approx(want, abs=2e-6)  # (float32 log-softmax, ~5.6 per token)
    assert 0 < want < math.log(trainer.vocab_size)  # a KL from uniform, below that of a one-hot student

    trainer.train()
    kd = logged(trainer.state.log_history, "kd_loss")
    assert sorted(kd) == [1, 2, 3]
    assert kd[1] == pytest.approx(want, abs=2e-6)  # the logged step: the formula on the untrained student
    assert kd[3] < kd[2] < kd[1]  # the student moves towards the uniform teacher (alpha 1: the KD alone)
    assert uniform_kd(trainer.model, batch, trainer.vocab_size) < kd[3]


def test_registering_the_kind_is_all_that_parsing_needs(toy_kind):
    spec = parse_teacher("toy=toy:uniform")
    assert (spec.kind, spec.model, spec.entry()) == ("toy", "toy:uniform", "toy=toy:uniform")
    assert parse_teacher({"name": "t", "model": "toy:ones"}).kind == "toy"
    assert parse_teacher("m=./toy-model").kind == "model"  # the prefix, not a word in the path
