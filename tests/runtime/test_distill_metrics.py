"""The diagnostics a run logs (`top1_agreement`, `kl_teacher_student`, `teacher_ce`, the entropies, a top-k
teacher's tail mass, the aligned shares across tokenizers) equal the same metrics taken from both models' own
`model(...).logits` on the rows trained on: one process, gradient accumulation 2 with the once-per-step teacher
pass, learning rate 0 (so the student the log measured is the one the reference runs), one log over the epoch."""

from collections import defaultdict

import pytest
import torch
from oracles import reference_diagnostics, write_teacher_cache
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import loss_tokens
from trl_distill.loss.diagnostics import INTERNAL
from trl_distill.teacher.cross_tokenizer import pop_cross_batch
from trl_distill.teacher.server_client import TeacherServerClient
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings

ROWS = 16  # 4 optimizer steps of 2 x 2 rows: one epoch, every row once


def config(tmp_path, name, **overrides) -> DistillationConfig:
    settings = dict(output_dir=str(tmp_path / name), max_steps=4, logging_steps=4, learning_rate=0.0,
                    per_device_train_batch_size=2, gradient_accumulation_steps=2, save_strategy="no", use_cpu=True,
                    loss_chunk_size=7)
    return DistillationConfig(**tiny_run_settings(**{**settings, **overrides}))


def logged_once(trainer) -> dict[str, float]:
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(logs) == 1
    return logs[0]


@torch.no_grad()
def reference(trainer, teacher_of) -> dict[str, float]:
    """Token means over every train row: ``teacher_of(batch, target, mask)`` gives the teacher side at the loss
    tokens (logits ``[n, V]``, or a server's ``(ids, log-probs)``) and the oracle's keyword arguments."""
    student = trainer.model.eval()
    per_token = defaultdict(list)
    for example in trainer.train_dataset:
        batch = trainer.data_collator([example])
        target, mask = loss_tokens(batch)
        logits = student(input_ids=batch["input_ids"]).logits[:, :-1][mask]
        teacher, kwargs = teacher_of(batch, target, mask)
        for name, values in reference_diagnostics(logits, teacher, target[mask], **kwargs).items():
            per_token[name].append(values)
    student.train()
    return {name: torch.cat(values).mean().item() for name, values in per_token.items() if name not in INTERNAL}


def assert_equal(logs: dict, want: dict, prefix: str = "") -> None:
    for name, value in want.items():
        assert logs[prefix + name] == pytest.approx(value, abs=1e-5), name


def test_a_live_teacher_at_temperature_two_logs_the_models_own_metrics_in_training_and_evaluation(tiny_pair, tmp_path):
    data = synthetic_prompt_completion(ROWS)
    trainer = DistillationTrainer(tiny_pair["student"], args=config(
        tmp_path, "live", teacher_model_name_or_path=tiny_pair["teacher"]), train_dataset=data, eval_dataset=data)
    trainer.train()
    teacher = AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"]).eval()
    want = reference(trainer, lambda batch, target, mask: (teacher(input_ids=batch["input_ids"]).logits[:, :-1][mask],
                                                            {}))
    assert set(want) == {"top1_agreement", "kl_teacher_student", "teacher_ce", "student_entropy", "teacher_entropy"}
    assert 0 < want["kl_teacher_student"] and 0 < want["teacher_ce"]
    assert_equal(logged_once(trainer), want)
    assert_equal(trainer.evaluate(), want, prefix="eval_")


def test_a_top_k_cache_logs_the_bucketed_metrics_and_its_tail_mass(tiny_pair, tmp_path):
    data = synthetic_prompt_completion(ROWS)
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    online = DistillationTrainer(tiny_pair["student"], args=config(
        tmp_path, "online", teacher_model_name_or_path=tiny_pair["teacher"], temperature=1.0), train_dataset=data,
        processing_class=tok)
    write_teacher_cache(online, str(tmp_path / "cache"), top_k=8, log_prob_dtype="float32")
    trainer = DistillationTrainer(tiny_pair["student"], args=config(
        tmp_path, "cached", teacher_cache=str(tmp_path / "cache"), temperature=1.0), train_dataset=data,
        processing_class=tok)
    trainer.train()
    teacher = AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"]).eval()
    want = reference(trainer, lambda batch, target, mask: (teacher(input_ids=batch["input_ids"]).logits[:, :-1][mask],
                                                            {"top_k": 8}))
    assert 0.05 < want["teacher_tail_mass"] < 1
    logs = logged_once(trainer)
    assert_equal(logs, want)
    assert logs["student_tail_clamped"] == 0


@pytest.mark.distributed
def test_a_served_teacher_logs_the_metrics_of_the_top_k_it_served(served, tmp_path):
    data = synthetic_prompt_completion(ROWS)
    trainer = DistillationTrainer(served["student"], args=config(
        tmp_path, "served", teacher_server=served["url"], teacher_server_top_k=5, temperature=1.0,
        max_length=64),
        train_dataset=data, processing_class=served["tokenizer"])
    trainer.train()
    client = TeacherServerClient(served["url"], "teacher")

    def teacher_of(batch, target, mask):
        signal = client.top_k(batch["input_ids"][0].tolist(), 5)  # position t: the top-k after the first t + 1
        return (signal.ids[mask[0]], signal.log_probs[mask[0]]), {}

    want = reference(trainer, teacher_of)
    logs = logged_once(trainer)
    assert_equal(logs, want)
    assert set(want) <= set(logs) and 0 < logs["teacher_tail_mass"] < 1


def test_across_tokenizers_the_metrics_are_those_of_the_aligned_groups(tiny_pair, other_teacher, tmp_path):
    data = synthetic_prompt_completion(ROWS)
    trainer = DistillationTrainer(tiny_pair["student"], args=config(
        tmp_path, "across", teacher_model_name_or_path=other_teacher), train_dataset=data)
    trainer.train()
    teacher = AutoModelForCausalLM.from_pretrained(other_teacher).eval()
    vocabulary = trainer.teacher.loss.vocabulary
    student = trainer.model.eval()
    sums, groups_total, tokens_total = defaultdict(float), 0, 0
    with torch.no_grad():
        for example in trainer.train_dataset:
            batch = trainer.data_collator([example])
            teacher_ids, teacher_mask, groups, _ = pop_cross_batch(batch)
            target, mask = loss_tokens(batch)
            rows, s_pos, t_pos = groups.unbind(1)
            keep = mask[rows, s_pos]
            s_pos, t_pos = s_pos[keep], t_pos[keep]
            s = torch.log_softmax(student(input_ids=batch["input_ids"]).logits[0, s_pos].double(), -1)
            t = torch.log_softmax(teacher(input_ids=teacher_ids, attention_mask=teacher_mask).logits[0, t_pos]
                                  .double(), -1)
            shared_s = torch.log_softmax(s[:, vocabulary.student], -1)
            shared_t = torch.log_softmax(t[:, vocabulary.teacher], -1)
            pairs = dict(zip(vocabulary.student.tolist(), vocabulary.teacher.tolist(), strict=True))
            sums["top1_agreement"] += sum(pairs.get(a, -1) == b for a, b in zip(s.argmax(-1).tolist(),
                                                                                t.argmax(-1).tolist()))
            sums["kl_teacher_student"] += (shared_t.exp() * (shared_t - shared_s)).sum().item()
            sums["teacher_ce"] -= t.gather(1, teacher_ids[0, t_pos + 1][:, None]).sum().item()
            sums["student_entropy"] -= (s.exp() * s).sum().item()
            sums["teacher_entropy"] -= (t.exp() * t).sum().item()
            groups_total, tokens_total = groups_total + int(keep.sum()), tokens_total + int(mask.sum())
    logs = logged_once(trainer)
    for name, total in sums.items():
        assert logs[name] == pytest.approx(total / groups_total, abs=1e-5), name
    assert logs["aligned_token_share"] == pytest.approx(groups_total / tokens_total)
    assert 0.1 < logs["aligned_token_share"] < 1 and logs["aligned_row_share"] == 1.0


def test_one_tokenizer_forced_across_logs_what_the_same_tokenizer_run_logs(tiny_pair, tmp_path):
    data, logs = synthetic_prompt_completion(ROWS), {}
    for name, extra in (("same", {}), ("across", {"cross_tokenizer": True})):
        trainer = DistillationTrainer(tiny_pair["student"], args=config(
            tmp_path, name, teacher_model_name_or_path=tiny_pair["teacher"], **extra), train_dataset=data)
        trainer.train()
        logs[name] = logged_once(trainer)
    for key in ("top1_agreement", "teacher_ce", "student_entropy", "teacher_entropy", "kl_teacher_student"):
        assert logs["across"][key] == pytest.approx(logs["same"][key], abs=1e-5), key
    assert logs["across"]["aligned_token_share"] == 1.0
