"""On two processes, with a ZeRO-3 teacher: the student's rollouts from the real vLLM server for a ZeRO-2, a ZeRO-3
and a LoRA student, scored by a live, a served, a `self` and a cross-tokenizer teacher; after the last sync the
server computes what the saved student computes, and the first step's logged losses are the formula's on the rows
each rank sampled. Every run is one trainer of one launch (tests/scripts/engine_rollout_worker.py)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.oracles import first_step_losses
from trl_distill.testing import free_port, launch, read_rank_records

WORKER = Path(__file__).parents[1] / "scripts" / "engine_rollout_worker.py"
PROBE = "def probe(x):\n    return x + 1\n"


# the order of the runs in the launch: the ZeRO-3 student last (its zero.Init leaves global state behind)
MODES = ("zero2", "lora", "served", "self", "cross", "zero3_student")


@pytest.fixture(scope="module")
def rollout_runs(rollout_server, tiny_pair, served, other_teacher, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rollout_runs")
    teachers = {"served": served["url"], "self": "unused", "cross": other_teacher}
    runs = [f"{mode}={teachers.get(mode, tiny_pair['teacher'])}@{free_port()}" for mode in MODES]
    launch(WORKER, rollout_server["student"], str(out), rollout_server["url"], *runs, timeout=900)
    return out


@pytest.mark.parametrize("mode", ["zero2", "zero3_student", "lora"])
def test_two_processes_roll_out_from_the_server_and_sync_every_student_kind(rollout_runs, rollout_server, tiny_pair,
                                                                            mode):
    ranks = read_rank_records(rollout_runs / mode)
    assert ranks[0]["versions"] == ["0", "1", "2"]  # synced before each step's rollouts
    first = [r["sampled"]["1"] for r in ranks]
    assert first[0]["input_ids"] != first[1]["input_ids"]  # each rank sampled its own rows
    # the first step's losses: the formula on each rank's sampled rows, from the initial models' own logits
    student = AutoModelForCausalLM.from_pretrained(rollout_server["student"]).eval()
    if mode == "lora":  # the adapter starts non-zero (init_lora_weights=False): the worker's seed rebuilds it
        student = None
    teacher = AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"]).eval()
    logs = {h["step"]: h for h in ranks[0]["log_history"] if "kd_loss" in h}
    assert sorted(logs) == [1, 2, 3] and all(h["on_policy_fraction"] == 1.0 for h in logs.values())
    if student is not None:
        expected = first_step_losses(student, teacher, first)
        for key, value in expected.items():
            assert logs[1][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    # right after the run the server held step 2's weights (the last sync): those of checkpoint-2, as saved
    assert ranks[0]["server_gap"] < 1e-4


def test_two_processes_roll_out_and_a_served_teacher_scores_each_ranks_rows(rollout_runs, rollout_server, served):
    """ZeRO-2 student on 2 processes, its rollouts from one vLLM server, the teacher's top-k on them from another:
    the first step's logged losses are the sparse KD and the CE computed from the initial student's own logits and
    the teacher server's answer for the rows each rank sampled."""
    from tests.oracles import sparse_distillation_loss
    from trl_distill.teacher.server_client import TeacherServerClient

    ranks = read_rank_records(rollout_runs / "served")
    assert ranks[0]["versions"] == ["0", "1", "2"]
    student = AutoModelForCausalLM.from_pretrained(rollout_server["student"]).eval()
    client = TeacherServerClient(served["url"], "teacher")
    kd, ce = [], []
    for rank in ranks:
        row = rank["sampled"]["1"]
        ids, mask, labels = (torch.tensor(row[k]) for k in ("input_ids", "attention_mask", "labels"))
        with torch.no_grad():
            logits = student(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        keep = labels[:, 1:] != -100
        rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
        signals = client.top_k_rows(rows, 64)
        positions = [k.nonzero().squeeze(1) for k in keep]
        signal = type(signals[0])(*(torch.cat([t[p] for t, p in zip(column, positions)])
                                    for column in zip(*signals)))
        s = logits[keep]
        kd.append(float(sparse_distillation_loss(s, torch.eye(s.shape[1]), signal, loss_type="forward_kl").kd))
        ce.append(float(torch.nn.functional.cross_entropy(s, labels[:, 1:][keep])))
    logs = {h["step"]: h for h in ranks[0]["log_history"] if "kd_loss" in h}
    expected = {"kd_loss": sum(kd) / 2, "ce_loss": sum(ce) / 2}
    expected["loss"] = 0.5 * expected["kd_loss"] + 0.5 * expected["ce_loss"]
    for key, value in expected.items():
        assert logs[1][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_two_processes_self_distil_a_lora_student_on_its_rollouts(rollout_runs, rollout_server):
    """teacher 'self', adapters starting at zero: on the first step's rollouts the student is its base, so the KD is
    0 and the CE the base's own on the rows each rank sampled."""
    ranks = read_rank_records(rollout_runs / "self")
    assert ranks[0]["versions"] == ["0", "1", "2"]
    base = AutoModelForCausalLM.from_pretrained(rollout_server["student"]).eval()
    expected = first_step_losses(base, base, [r["sampled"]["1"] for r in ranks])
    logs = {h["step"]: h for h in ranks[0]["log_history"] if "kd_loss" in h}
    assert logs[1]["kd_loss"] == pytest.approx(0.0, abs=1e-7) and expected["kd_loss"] == pytest.approx(0, abs=1e-7)
    assert logs[1]["ce_loss"] == pytest.approx(expected["ce_loss"], rel=1e-4)
    assert logs[3]["kd_loss"] > 1e-6  # the adapters have moved the student off its base


def test_two_processes_and_a_zero3_teacher_of_another_tokenizer_score_the_rollouts(rollout_runs, rollout_server,
                                                                                   other_teacher):
    """The first step's KD: the per-group loss on both models' own logits over the groups each rank aligned,
    each rank's sum over its loss tokens, averaged over the ranks."""
    from transformers import AutoTokenizer

    from trl_distill.cross_tokenizer import CrossTokenizerLoss, shared_vocabulary
    from trl_distill.loss.settings import LossSettings

    ranks = read_rank_records(rollout_runs / "cross")
    student = AutoModelForCausalLM.from_pretrained(rollout_server["student"]).eval()
    teacher = AutoModelForCausalLM.from_pretrained(other_teacher).eval()
    s_tok, t_tok = rollout_server["tokenizer"], AutoTokenizer.from_pretrained(other_teacher)
    vocab = len(s_tok)
    loss = CrossTokenizerLoss(shared_vocabulary(s_tok, t_tok, student.config.vocab_size, teacher.config.vocab_size),
                              LossSettings("forward_kl", temperature=2.0, vocab_size=vocab))
    kd = []
    for rank in ranks:
        row = rank["sampled"]["1"]
        groups = torch.tensor(row["groups"])
        assert len(groups) >= 4
        rows, s_pos, t_pos = groups.unbind(1)
        with torch.no_grad():
            s = student(input_ids=torch.tensor(row["input_ids"]),
                        attention_mask=torch.tensor(row["attention_mask"])).logits
            t = teacher(input_ids=torch.tensor(row["teacher_ids"]),
                        attention_mask=torch.tensor(row["teacher_mask"])).logits
        per_group = loss(s[rows, s_pos, :vocab].double(), t[rows, t_pos].double())
        tokens = int((torch.tensor(row["labels"])[:, 1:] != -100).sum())
        kd.append(float(per_group.sum()) / tokens * 4.0)  # T = 2, times T²
    logs = {h["step"]: h for h in ranks[0]["log_history"] if "kd_loss" in h}
    assert logs[1]["kd_loss"] == pytest.approx(sum(kd) / 2, rel=1e-4, abs=1e-6)

