"""2 processes on CPU (gloo), an FSDP2 student beside an FSDP2-sharded live teacher
(tests/scripts/fsdp2_modes_worker.py): on-policy with HF generate (the student samples, the teacher samples: seq_kd,
the sampled-token objective) with rank 1 sampling shorter completions than rank 0, a generation-based evaluation, and
on-policy with the real vLLM rollout server, whose synced weights are the student's gathered ones (full, LoRA merged).
"""

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.oracles import first_step_losses
from trl_distill.testing import free_port, launch, read_rank_records

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "scripts" / "fsdp2_modes_worker.py"
HF_MODES = ("student", "teacher", "sampled_token")


def training_logs(rank: dict) -> dict[int, dict]:
    return {h["step"]: h for h in rank["log_history"] if "loss" in h and "eval_loss" not in h}


def check_ranks_agree(ranks: list[dict], keys=("loss", "kd_loss", "ce_loss")) -> dict[int, dict]:
    """Both ranks logged the same finite losses at steps 1..3; rank 0's logs."""
    logs = [training_logs(rank) for rank in ranks]
    assert sorted(logs[0]) == [1, 2, 3] and logs[0] == logs[1]
    for step in logs[0].values():
        assert all(math.isfinite(step[key]) for key in keys if key in step), step
    return logs[0]


@pytest.fixture(scope="module")
def hf_runs(tiny_pair, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp2_modes")
    launch(WORKER, str(Path(tiny_pair["teacher"]).parent), str(out), *HF_MODES, timeout=400)
    return {mode: read_rank_records(out / mode) for mode in HF_MODES}


@pytest.fixture(scope="module")
def initial(tiny_pair) -> tuple:
    return tuple(AutoModelForCausalLM.from_pretrained(tiny_pair[k]).eval() for k in ("student", "teacher"))


@pytest.mark.parametrize("mode, source", [("student", "student"), ("teacher", "teacher")])
def test_student_and_sharded_teacher_sample_with_hf_generate_in_step(hf_runs, initial, mode, source):
    ranks = hf_runs[mode]
    assert all(rank["is_fsdp2"] for rank in ranks)
    for step in ("1", "2", "3"):  # rank 1 stopped after 3 tokens and kept stepping with rank 0 to its 6
        assert [[len(c) for c in r["sampled"][step]["completions"]] for r in ranks] == [[6, 6], [3, 3]]
        assert {r["sampled"][step]["source"] for r in ranks} == {source}
    logs = check_ranks_agree(ranks)
    assert all(h["generated_length"] == 4.5 and h["on_policy_fraction"] == (mode == "student") for h in logs.values())
    # the first step's losses: the formula on the rows each rank sampled, from the initial models' own logits
    expected = first_step_losses(*initial, [r["sampled"]["1"] for r in ranks])
    for key, value in expected.items():
        assert logs[1][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_sampled_token_objective_on_the_fsdp2_students_samples(hf_runs, initial):
    ranks = hf_runs["sampled_token"]
    logs = check_ranks_agree(ranks, ("loss", "policy_loss", "ce_loss", "sampled_token_advantage"))
    assert all(h["on_policy_fraction"] == 1.0 and "kd_loss" not in h for h in logs.values())
    # step 1's teacher gap: mean log p_teacher - log p_student of the tokens both ranks sampled (temperature 1)
    gap, tokens = 0.0, 0
    for rank in ranks:
        row = rank["sampled"]["1"]
        ids, mask, labels = (torch.tensor(row[k]) for k in ("input_ids", "attention_mask", "labels"))
        target = labels[:, 1:]
        keep = target != -100
        with torch.no_grad():
            s, t = (m(input_ids=ids, attention_mask=mask).logits[:, :-1][keep].log_softmax(-1) for m in initial)
        picked = target[keep][:, None]
        gap += float((t.gather(1, picked) - s.gather(1, picked)).sum())
        tokens += int(keep.sum())
    assert tokens == 18 and logs[1]["sampled_token_teacher_gap"] == pytest.approx(gap / tokens, rel=1e-4, abs=1e-6)


def test_generation_eval_samples_on_every_rank_in_step(hf_runs):
    ranks = hf_runs["student"]
    evals = [{h["step"]: {k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k}
              for h in r["log_history"] if "eval_generation_prompts" in h} for r in ranks]  # (timings differ)
    assert sorted(evals[0]) == [2, 3] and evals[0] == evals[1]
    for h in evals[0].values():
        # 6 prompts in batches of 2: rank 0 completes 4 with 6 tokens, rank 1 two with 3 (and repeats one, uncounted)
        assert h["eval_generation_prompts"] == 6 and h["eval_generated_length"] == 5.0
        assert math.isfinite(h["eval_teacher_nll"]) and 0 <= h["eval_pass@1"] <= 1
    for rank in ranks:  # evaluate() before train(): one line, before the unsharded student generated anything
        assert rank["eval_before_refused"].startswith("evaluate() before train() with an FSDP2 student")
        assert "sampled_before_train" not in rank


@pytest.fixture(scope="module")
def vllm_runs(rollout_server, tiny_pair, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp2_vllm")
    server = f"{rollout_server['student']}@{rollout_server['url']}"
    runs = [f"{mode}={server}@{free_port()}" for mode in ("vllm", "vllm_lora")]
    launch(WORKER, str(Path(tiny_pair["teacher"]).parent), str(out), *runs, timeout=400)
    return {mode: read_rank_records(out / mode) for mode in ("vllm", "vllm_lora")}


@pytest.mark.parametrize("mode", ["vllm", "vllm_lora"])
def test_vllm_rollouts_sync_the_gathered_student_weights(vllm_runs, rollout_server, tiny_pair, mode):
    ranks = vllm_runs[mode]
    assert ranks[0]["versions"] == ["0", "1", "2"] and ranks[0]["server_version"] == "2"  # synced before each step
    assert ranks[0]["sampled"]["1"]["input_ids"] != ranks[1]["sampled"]["1"]["input_ids"]  # each rank its own rows
    logs = check_ranks_agree(ranks)
    assert all(h["on_policy_fraction"] == 1.0 for h in logs.values())
    # the server's log-probs of a probe are those of the student's full weights gathered at step 2 (merged for LoRA),
    # the last sync, and not the initial weights'
    server, gathered, first = (torch.tensor(ranks[0][k]) for k in ("server_logprobs", "gathered_logprobs",
                                                                    "initial_logprobs"))
    assert float((server - gathered).abs().max()) < 1e-4 and float((server - first).abs().max()) > 0.05
    if mode == "vllm":  # the first step's losses on the rows each rank had the server sample
        student = AutoModelForCausalLM.from_pretrained(rollout_server["student"]).eval()
        teacher = AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"]).eval()
        expected = first_step_losses(student, teacher, [r["sampled"]["1"] for r in ranks])
        for key, value in expected.items():
            assert logs[1][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
