"""The diagnostics a run logs (`top1_agreement`, `kl_teacher_student`, `teacher_ce`, the entropies, a top-k
teacher's tail mass, the aligned shares across tokenizers) equal the same metrics taken from both models' own
`model(...).logits` on the rows trained on: gradient accumulation 2 with the once-per-step teacher pass, learning
rate 0 (so the student the log measured is the one the reference runs), one log over an epoch of 16 rows measured
on every step (`distill_metrics_every_step`; by default only the logged steps are measured, tested too). On one
process, and on two (ZeRO-2 student, ZeRO-3 teacher: tests/scripts/metrics_worker.py, one launch for every
teacher kind and the 2-process non-finite guard)."""

import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from oracles import reference_diagnostics, write_teacher_cache
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import loss_tokens
from trl_distill.loss.diagnostics import INTERNAL
from trl_distill.runtime.checkpoints import is_complete
from trl_distill.teacher.cross_tokenizer import pop_cross_batch
from trl_distill.teacher.server_client import TeacherServerClient
from trl_distill.testing import (
    launch,
    read_rank_records,
    synthetic_prompt_completion,
    tiny_run_settings,
    with_answers,
)

ROWS = 16  # one epoch: 4 optimizer steps of 2 x 2 rows on 1 process, 2 steps of 2 ranks x 2 x 2 on 2
WORKER = Path(__file__).parents[1] / "scripts" / "metrics_worker.py"


def config(tmp_path, name, **overrides) -> DistillationConfig:
    settings = dict(output_dir=str(tmp_path / name), max_steps=4, logging_steps=4, learning_rate=0.0,
                    per_device_train_batch_size=2, gradient_accumulation_steps=2, save_strategy="no", use_cpu=True,
                    loss_chunk_size=7, distill_metrics_every_step=True)  # the log: the mean over the epoch
    return DistillationConfig(**tiny_run_settings(**{**settings, **overrides}))


def make(student: str, tmp_path, name: str, tok=None, **overrides) -> DistillationTrainer:
    data = synthetic_prompt_completion(ROWS)
    evaluation = None if "teacher_cache" in overrides else data  # a cache holds the train split only
    return DistillationTrainer(student, args=config(tmp_path, name, **overrides), train_dataset=data,
                               eval_dataset=evaluation, processing_class=tok)


def logged_once(log: list[dict]) -> dict[str, float]:
    logs = [h for h in log if "loss" in h and "train_runtime" not in h]
    assert len(logs) == 1
    return logs[0]


def assert_equal(logs: dict, want: dict, prefix: str = "") -> None:
    for name, value in want.items():
        assert logs[prefix + name] == pytest.approx(value, abs=1e-5), name


@torch.no_grad()
def reference(trainer, teacher_of) -> dict[str, float]:
    """Token means over every train row: ``teacher_of(batch, mask)`` gives the teacher side at the loss tokens
    (logits ``[n, V]``, or a server's ``(ids, log-probs)``) and the oracle's keyword arguments."""
    student = trainer.model.eval()
    per_token = defaultdict(list)
    for example in trainer.train_dataset:
        batch = trainer.data_collator([example])
        target, mask = loss_tokens(batch)
        logits = student(input_ids=batch["input_ids"]).logits[:, :-1][mask]
        teacher, kwargs = teacher_of(batch, mask)
        for name, values in reference_diagnostics(logits, teacher, target[mask], **kwargs).items():
            per_token[name].append(values)
    student.train()
    return {name: torch.cat(values).mean().item() for name, values in per_token.items() if name not in INTERNAL}


def live_reference(trainer, teacher_dir: str, **kwargs) -> dict[str, float]:
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    return reference(trainer, lambda batch, mask: (teacher(input_ids=batch["input_ids"]).logits[:, :-1][mask],
                                                   kwargs))


def served_reference(trainer, url: str) -> dict[str, float]:
    client = TeacherServerClient(url, "teacher")

    def teacher_of(batch, mask):
        signal = client.top_k(batch["input_ids"][0].tolist(), 5)  # position t: the top-k after the first t + 1
        return (signal.ids[mask[0]], signal.log_probs[mask[0]]), {}

    return reference(trainer, teacher_of)


@torch.no_grad()
def cross_reference(trainer, teacher_dir: str) -> dict[str, float]:
    """The aligned groups' metrics: student logits at each group's position, teacher logits at its own, the KL on
    the shared vocabulary, agreement through the shared-token pairs, the teacher's CE on its own next token."""
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    vocabulary = trainer.teacher.loss.vocabulary
    pairs = dict(zip(vocabulary.student.tolist(), vocabulary.teacher.tolist(), strict=True))
    student = trainer.model.eval()
    sums, groups_total, tokens_total = defaultdict(float), 0, 0
    for example in trainer.train_dataset:
        batch = trainer.data_collator([example])
        teacher_ids, teacher_mask, groups, *_ = pop_cross_batch(batch)
        _, mask = loss_tokens(batch)
        rows, s_pos, t_pos = groups.unbind(1)
        keep = mask[rows, s_pos]
        s_pos, t_pos = s_pos[keep], t_pos[keep]
        s = torch.log_softmax(student(input_ids=batch["input_ids"]).logits[0, s_pos].double(), -1)
        t = torch.log_softmax(teacher(input_ids=teacher_ids, attention_mask=teacher_mask).logits[0, t_pos].double(),
                              -1)
        shared_s = torch.log_softmax(s[:, vocabulary.student], -1)
        shared_t = torch.log_softmax(t[:, vocabulary.teacher], -1)
        sums["top1_agreement"] += sum(pairs.get(a, -1) == b for a, b in zip(s.argmax(-1).tolist(),
                                                                            t.argmax(-1).tolist(), strict=True))
        sums["kl_teacher_student"] += (shared_t.exp() * (shared_t - shared_s)).sum().item()
        sums["teacher_ce"] -= t.gather(1, teacher_ids[0, t_pos + 1][:, None]).sum().item()
        sums["student_entropy"] -= (s.exp() * s).sum().item()
        sums["teacher_entropy"] -= (t.exp() * t).sum().item()
        groups_total, tokens_total = groups_total + int(keep.sum()), tokens_total + int(mask.sum())
    student.train()
    want = {name: total / groups_total for name, total in sums.items()}
    return {**want, "aligned_token_share": groups_total / tokens_total, "aligned_row_share": 1.0}


@pytest.fixture(scope="module")
def top_k_cache(tiny_pair, tmp_path_factory) -> Path:
    """A k = 8 cache at temperature 1 in float32 (exact log-probs), written by the Python API on one process."""
    tmp = tmp_path_factory.mktemp("metrics_cache")
    online = make(tiny_pair["student"], tmp, "online", AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]),
                  teacher_model_name_or_path=tiny_pair["teacher"], temperature=1.0)
    write_teacher_cache(online, str(tmp / "cache"), top_k=8, log_prob_dtype="float32")
    return tmp / "cache"


# ---- One process ----

def test_a_live_teacher_at_temperature_two_logs_the_models_own_metrics_in_training_and_evaluation(tiny_pair, tmp_path):
    trainer = make(tiny_pair["student"], tmp_path, "live", teacher_model_name_or_path=tiny_pair["teacher"])
    trainer.train()
    want = live_reference(trainer, tiny_pair["teacher"])
    assert set(want) == {"top1_agreement", "kl_teacher_student", "teacher_ce", "student_entropy", "teacher_entropy"}
    assert 0 < want["kl_teacher_student"] and 0 < want["teacher_ce"]
    assert_equal(logged_once(trainer.state.log_history), want)
    assert_equal(trainer.evaluate(), want, prefix="eval_")


def test_a_top_k_cache_logs_the_bucketed_metrics_and_its_tail_mass(tiny_pair, top_k_cache, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    trainer = make(tiny_pair["student"], tmp_path, "cached", tok, teacher_cache=str(top_k_cache), temperature=1.0)
    trainer.train()
    want = live_reference(trainer, tiny_pair["teacher"], top_k=8)
    assert 0.05 < want["teacher_tail_mass"] < 1
    logs = logged_once(trainer.state.log_history)
    assert_equal(logs, want)
    assert logs["student_tail_clamped"] == 0


def test_a_served_teacher_logs_the_metrics_of_the_top_k_it_served(served, tmp_path):
    trainer = make(served["student"], tmp_path, "served", served["tokenizer"], teacher_server=served["url"],
                   teacher_server_top_k=5, temperature=1.0, max_length=64)
    trainer.train()
    want = served_reference(trainer, served["url"])
    logs = logged_once(trainer.state.log_history)
    assert_equal(logs, want)
    assert 0 < logs["teacher_tail_mass"] < 1


def test_across_tokenizers_the_metrics_are_those_of_the_aligned_groups(tiny_pair, other_teacher, tmp_path):
    trainer = make(tiny_pair["student"], tmp_path, "across", teacher_model_name_or_path=other_teacher)
    trainer.train()
    want = cross_reference(trainer, other_teacher)
    assert 0.1 < want["aligned_token_share"] < 1
    assert_equal(logged_once(trainer.state.log_history), want)


def test_by_default_only_the_logged_steps_are_measured_each_on_all_its_micro_batches(tiny_pair, tmp_path):
    trainer = make(tiny_pair["student"], tmp_path, "logged", teacher_model_name_or_path=tiny_pair["teacher"],
                   distill_metrics_every_step=False, logging_steps=2, learning_rate=2e-3)
    measured, steps = {}, []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        if model.training:
            steps.append((trainer.state.global_step + 1, trainer.metrics.measured()))
            measured.setdefault(trainer.state.global_step + 1, []).append(
                {k: inputs[k].detach().clone() for k in ("input_ids", "labels")})
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    snapshots = {}

    class Snapshot(TrainerCallback):  # the student each logged step measured (it trains here)
        def on_step_begin(self, args, state, control, **kwargs):
            snapshots[state.global_step + 1] = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    trainer.add_callback(Snapshot())
    trainer.train()
    assert steps == [(1, True), (1, True), (2, True), (2, True), (3, False), (3, False), (4, True), (4, True)]
    teacher = AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"]).eval()
    student = AutoModelForCausalLM.from_pretrained(tiny_pair["student"]).eval()
    for step in (2, 4):
        student.load_state_dict(snapshots[step])
        per_token = defaultdict(list)
        with torch.no_grad():
            for batch in measured[step]:
                target, mask = loss_tokens(batch)
                s = student(input_ids=batch["input_ids"]).logits[:, :-1][mask]
                t = teacher(input_ids=batch["input_ids"]).logits[:, :-1][mask]
                for name, values in reference_diagnostics(s, t, target[mask]).items():
                    per_token[name].append(values)
        logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}[step]
        for name in ("top1_agreement", "kl_teacher_student", "teacher_ce", "student_entropy", "teacher_entropy"):
            assert logs[name] == pytest.approx(torch.cat(per_token[name]).mean().item(), abs=1e-5), (step, name)


def test_one_tokenizer_forced_across_logs_what_the_same_tokenizer_run_logs(tiny_pair, tmp_path):
    logs = {}
    for name, extra in (("same", {}), ("across", {"cross_tokenizer": True})):
        trainer = make(tiny_pair["student"], tmp_path, name, teacher_model_name_or_path=tiny_pair["teacher"], **extra)
        trainer.train()
        logs[name] = logged_once(trainer.state.log_history)
    for key in ("top1_agreement", "teacher_ce", "student_entropy", "teacher_entropy", "kl_teacher_student"):
        assert logs["across"][key] == pytest.approx(logs["same"][key], abs=1e-5), key
    assert logs["across"]["aligned_token_share"] == 1.0


# ---- Two processes: ZeRO-2 student, ZeRO-3 teacher, one launch ----

@pytest.fixture(scope="module")
def metrics_runs(tiny_pair, top_k_cache, served, other_teacher, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("metrics_runs")
    pair = str(Path(tiny_pair["teacher"]).parent)
    launch(WORKER, pair, str(out), "live", f"cache={top_k_cache}", f"served={served['url']}|{served['teacher']}",
           f"cross={other_teacher}", "nan", "generate", timeout=900)
    return out


def two_process_logs(out: Path, run: str) -> list[dict]:
    ranks = read_rank_records(out / run)
    assert ranks[0]["log"] == ranks[1]["log"]  # every rank logs the all-rank means
    return ranks


def test_on_two_processes_every_teacher_kind_logs_the_models_own_metrics(metrics_runs, tiny_pair, top_k_cache,
                                                                         served, other_teacher, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    live = two_process_logs(metrics_runs, "live")
    trainer = make(tiny_pair["student"], tmp_path, "live", teacher_model_name_or_path=tiny_pair["teacher"])
    want = live_reference(trainer, tiny_pair["teacher"])
    assert_equal(logged_once(live[0]["log"]), want)
    assert_equal(live[0]["eval"], want, prefix="eval_")
    cache = two_process_logs(metrics_runs, "cache")
    trainer = make(tiny_pair["student"], tmp_path, "cached", tok, teacher_cache=str(top_k_cache), temperature=1.0)
    assert_equal(logged_once(cache[0]["log"]), live_reference(trainer, tiny_pair["teacher"], top_k=8))
    remote = two_process_logs(metrics_runs, "served")
    trainer = make(served["student"], tmp_path, "served", served["tokenizer"], teacher_server=served["url"],
                   teacher_server_top_k=5, temperature=1.0, max_length=64)
    assert_equal(logged_once(remote[0]["log"]), served_reference(trainer, served["url"]))
    across = two_process_logs(metrics_runs, "cross")
    trainer = make(tiny_pair["student"], tmp_path, "across", teacher_model_name_or_path=other_teacher)
    assert_equal(logged_once(across[0]["log"]), cross_reference(trainer, other_teacher))


def test_on_two_processes_a_nan_on_one_rank_stops_both_before_the_step(metrics_runs):
    ranks = read_rank_records(metrics_runs / "nan")
    for record in ranks:
        assert record["global_step"] == 2 and [h["step"] for h in record["log"]] == [1, 2]
        assert record["stopped"].endswith("; not finite on 1 of 2 ranks) at step 3; nothing of this step was applied. "
                                          "Lower the learning rate (or add warmup / max_grad_norm), check the data, "
                                          "and resume from the last complete checkpoint; stop_on_nonfinite_loss=False "
                                          "trains on.")
    assert "(nan on rank 1;" in ranks[1]["stopped"] and "on rank 0;" in ranks[0]["stopped"]
    out = metrics_runs / "nan"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"] and is_complete(out / "checkpoint-2")


def test_on_two_processes_the_generation_eval_equals_one_process(metrics_runs, tiny_pair, tmp_path):
    """The student's samples of the eval prompts judged on 2 ranks (batches 0 and 2 on rank 0, batch 1 and a filler
    round on rank 1) and on 1: the same pass@k and verifier means; the ZeRO-3 teacher's NLL of them within 1e-5."""
    sys.path.insert(0, str(WORKER.parent))
    from metrics_worker import GENERATION

    ranks = read_rank_records(metrics_runs / "generate")
    timings = ("_runtime", "_per_second")
    assert {k: v for k, v in ranks[0]["eval"].items() if not k.endswith(timings)} == \
        {k: v for k, v in ranks[1]["eval"].items() if not k.endswith(timings)}  # the all-rank numbers on every rank
    two = ranks[0]["eval"]
    one = DistillationTrainer(
        tiny_pair["student"], args=config(tmp_path, "generate", teacher_model_name_or_path=tiny_pair["teacher"],
                                          **GENERATION),
        train_dataset=synthetic_prompt_completion(ROWS),
        eval_dataset=with_answers(synthetic_prompt_completion(10, seed=5)),
        processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])).evaluate()
    assert 0 < one["eval_pass@1"] < one["eval_pass@2"] and one["eval_generation_prompts"] == 10
    for name in ("eval_pass@1", "eval_pass@2", "eval_rewards/even_length_reward/mean",
                 "eval_rewards/exact_match/mean", "eval_generated_length", "eval_eos_rate", "eval_generation_prompts"):
        assert two[name] == one[name], name
    assert two["eval_teacher_nll"] == pytest.approx(one["eval_teacher_nll"], abs=1e-5)
