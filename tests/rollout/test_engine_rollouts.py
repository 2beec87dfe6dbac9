"""On-policy completions from a real vLLM server of the student (`use_vllm`): weights synced through vLLM's
weight-transfer API over gloo, losses on the sampled rows against GKD's formula, resume, faults."""

import pytest
import torch

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.rollout.engine_client import RolloutServerError, RolloutServerReplyError
from trl_distill.rollout.sampling import STUDENT
from trl_distill.run_plan import resolve
from trl_distill.testing import VLLM_VENV, free_port, logged, synthetic_prompt_completion, tiny_run_settings

PROBE = "def probe(x):\n    return x + 1\n"


def make_trainer(rollout_server, tiny_pair, tmp_path, eval_dataset=None, **overrides):
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3,
                                 save_strategy="no", use_cpu=True, max_new_tokens=8, lmbda=1.0, use_vllm=True,
                                 vllm_server_base_url=rollout_server["url"], vllm_group_port=free_port(),
                                 vllm_server_timeout=60)
    settings.update(overrides)
    return DistillationTrainer(rollout_server["student"], tiny_pair["teacher"], args=DistillationConfig(**settings),
                               train_dataset=synthetic_prompt_completion(32), eval_dataset=eval_dataset,
                               processing_class=rollout_server["tokenizer"])


def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The model's own log-prob of each token of `ids` after its prefix, from `model(...).logits` (fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


class SyncProbe:
    """After every weight sync: the server's log-probs of a probe against the trainer's student's, and the
    server's weight version; every sampled completion, per step."""

    def __init__(self, trainer):
        engine, self.gaps, self.versions, self.sampled = trainer.sampler.engine, [], [], []
        ids = trainer.processing_class(PROBE)["input_ids"]
        push, sample = engine._push, engine.sample

        def pushing(step):
            push(step)
            model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
            served = torch.tensor(engine.client.prompt_logprobs(ids))
            self.gaps.append(float((served - token_logprobs(model, ids)).abs().max()))
            self.versions.append((step, engine.client.weight_version()))

        def sampling(prompts, eos_ids, settings=None):
            completions, logprobs = sample(prompts, eos_ids, settings)
            self.sampled.append((trainer.state.global_step, [c.tolist() for c in completions]))
            return completions, logprobs

        engine._push, engine.sample = pushing, sampling


def test_weights_are_synced_every_step_and_the_server_then_computes_the_students_log_probs(
        rollout_server, tiny_pair, tmp_path):
    trainer = make_trainer(rollout_server, tiny_pair, tmp_path)
    probe = SyncProbe(trainer)
    trainer.train()
    assert probe.versions == [(0, "0"), (1, "1"), (2, "2")]  # before the first rollout, then every step
    assert max(probe.gaps) < 1e-4, probe.gaps
    logs = [h for h in trainer.state.log_history if "rollout_tokens" in h]
    assert len(logs) == 3 and all(h["on_policy_fraction"] == 1.0 for h in logs)
    assert [h["rollout_tokens"] for h in logs] == [sum(map(len, rows)) for _, rows in probe.sampled]
    assert all(0 < h["rollout_generate_share"] < 1 and 0 < h["rollout_sync_share"] < 1 for h in logs)
    assert all(0 <= h["rollout_eos_rate"] <= 1 and h["rollout_engine_logprob"] < 0 for h in logs)
    assert all(h["rollout_logprob_abs_diff"] < 1e-4 and abs(h["rollout_kl_engine_trainer"]) < 1e-4 for h in logs)


def test_the_loss_on_engine_rollouts_is_gkds_and_the_engine_scores_them_as_the_student_does(
        rollout_server, tiny_pair, tmp_path):
    from trl.experimental.gkd import GKDTrainer

    trainer = make_trainer(rollout_server, tiny_pair, tmp_path, divergence="jsd", beta=0.3, alpha=1.0,
                           kd_temperature_scaling=False)
    batch = next(iter(trainer.get_train_dataloader()))
    batch, completions = trainer.sampler.sample(STUDENT, trainer._prepare_inputs(batch))
    assert [c.tolist() for c in completions] == [  # only sampled tokens carry loss
        row[row != -100].tolist() for row in batch["labels"]]
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.compute_loss(trainer.model, batch)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        student = trainer.model(**inputs).logits[:, :-1]
        teacher = trainer.teacher.module(**inputs).logits[:, :-1]
        theirs = GKDTrainer.generalized_jsd_loss(student, teacher, batch["labels"][:, 1:], beta=0.3, temperature=2.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # the engine's log-probs of the sampled tokens are the trainer's student's (the mismatch is float noise)
    _, _, rows, tokens, _, engine_sum, abs_gap, _, scored = trainer.sampler.engine.take_stats()
    trainer_sum = 0.0
    for ids, mask, completion in zip(batch["input_ids"], batch["attention_mask"], completions):
        trainer_sum += float(token_logprobs(trainer.model, ids[mask.bool()].tolist())[-len(completion):].sum())
    assert rows == 4 and tokens == sum(len(c) for c in completions)
    assert engine_sum / tokens == pytest.approx(trainer_sum / tokens, abs=1e-4)
    assert scored == tokens and abs_gap / scored < 1e-4  # the loss measured the same gap, token by token


def test_a_resumed_run_samples_what_the_uninterrupted_one_did(rollout_server, tiny_pair, tmp_path):
    full = make_trainer(rollout_server, tiny_pair, tmp_path / "full", max_steps=4, save_strategy="steps",
                        save_steps=2)
    full_probe = SyncProbe(full)
    full.train()
    resumed = make_trainer(rollout_server, tiny_pair, tmp_path / "resumed", max_steps=4, save_strategy="steps",
                           save_steps=2)
    resumed_probe = SyncProbe(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-2"))
    assert [s for s, _ in resumed_probe.sampled] == [2, 3]
    assert resumed_probe.sampled == full_probe.sampled[2:]
    assert len({tuple(map(tuple, rows)) for _, rows in full_probe.sampled}) == 4  # each step samples anew
    for key in ("loss", "kd_loss", "ce_loss"):
        expected = {s: v for s, v in logged(full.state.log_history, key).items() if s > 2}
        got = {s: v for s, v in logged(resumed.state.log_history, key).items() if s > 2}  # (1, 2: the checkpoint's)
        assert got.keys() == expected.keys() == {3, 4}
        for step in got:
            assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6)


def test_a_server_that_is_down_is_one_line(tiny_pair, tmp_path, rollout_server):
    trainer = make_trainer({**rollout_server, "url": f"http://127.0.0.1:{free_port()}"}, tiny_pair, tmp_path)
    trainer.sampler.engine.client.http.backoff = 0.05
    with pytest.raises(RolloutServerError, match=r"did not answer /v1/models after 4 attempts.*trl-distill "
                                                 r"vllm-serve.*Stopped at step 1"):
        trainer.train()


def test_a_plain_vllm_server_without_weight_routes_is_refused(served, rollout_server, tiny_pair, tmp_path):
    trainer = make_trainer({**rollout_server, "url": served["url"]}, tiny_pair, tmp_path)
    with pytest.raises(RolloutServerReplyError, match="has no weight-transfer routes.*trl-distill vllm-serve"):
        trainer.train()


def test_colocate_is_one_line_naming_server_mode():
    with pytest.raises(ValueError, match="vllm_mode='colocate'.*not importable.*Use vllm_mode='server'"):
        resolve(DistillationConfig(output_dir="unused", use_vllm=True, vllm_mode="colocate", lmbda=1.0,
                                   report_to="none"))
    with pytest.raises(ValueError, match="lmbda=0 samples none"):
        resolve(DistillationConfig(output_dir="unused", use_vllm=True, report_to="none"))


def test_a_student_of_another_tokenizer_than_the_servers_is_refused(rollout_server, tiny_pair, tmp_path,
                                                                   other_teacher):
    from transformers import AutoTokenizer

    trainer = make_trainer(rollout_server, tiny_pair, tmp_path)
    trainer.processing_class = AutoTokenizer.from_pretrained(other_teacher)
    with pytest.raises(RolloutServerReplyError, match="tokenizes .* the student's tokenizer gives"):
        trainer.train()


def test_a_served_teacher_scores_the_rollouts(served, rollout_server, tmp_path):
    """The student's rollouts from one vLLM server, the teacher's top-k on them from another: the loss equals the
    sparse KD computed from the student's own logits and the teacher server's answer for the same rows."""
    from tests.oracles import sparse_distillation_loss
    from trl_distill.teacher.served import loss_rows

    trainer = make_trainer(rollout_server, {"teacher": None}, tmp_path, teacher_server=served["url"], alpha=1.0,
                           temperature=1.0, divergence="forward_kl", max_steps=2, max_length=64)
    trainer.train()  # trains on the student's rollouts, each scored by the server
    assert [h["on_policy_fraction"] for h in trainer.state.log_history if "kd_loss" in h] == [1.0, 1.0]
    batch = next(iter(trainer.get_train_dataloader()))
    batch, completions = trainer.sampler.sample(STUDENT, trainer._prepare_inputs(batch))
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.compute_loss(trainer.model, dict(batch))
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    rows, positions = loss_rows(batch)
    signal = trainer.teacher.fetch(rows, positions)
    mask = batch["labels"][:, 1:] != -100
    assert int(mask.sum()) == sum(len(c) for c in completions) == signal.ids.shape[0]
    student = logits[:, :-1][mask]
    expected = sparse_distillation_loss(student, torch.eye(student.shape[1]), signal, loss_type="forward_kl").kd
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_self_distillation_of_a_lora_student_rolls_out_its_merged_weights(rollout_server, tmp_path):
    """teacher 'self' (the base, adapters off) scores rollouts of the LoRA student, whose merged weights (base +
    a non-zero adapter delta) the server holds after every sync."""
    from peft import LoraConfig

    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                                 save_strategy="no", use_cpu=True, max_new_tokens=8, lmbda=1.0, use_vllm=True,
                                 vllm_server_base_url=rollout_server["url"], vllm_group_port=free_port(),
                                 vllm_server_timeout=60, learning_rate=1e-2)
    trainer = DistillationTrainer(rollout_server["student"], "self", args=DistillationConfig(**settings),
                                  train_dataset=synthetic_prompt_completion(32),
                                  processing_class=rollout_server["tokenizer"],
                                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))
    probe = SyncProbe(trainer)
    trainer.train()
    assert probe.versions == [(0, "0"), (1, "1")] and max(probe.gaps) < 1e-4, probe.gaps
    assert all(h["kd_loss"] > 0 for h in trainer.state.log_history if "kd_loss" in h)  # the adapter moved it
    # on a batch the server samples: the KD is the forward KL at T from the base's (adapters off) and the
    # student's own logits
    batch = next(iter(trainer.get_train_dataloader()))
    batch, _ = trainer.sampler.sample(STUDENT, trainer._prepare_inputs(batch))
    trainer.model.eval()
    with torch.no_grad():
        _, parts = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        student = trainer.model(**inputs).logits[:, :-1].double()
        with trainer.model.disable_adapter():
            teacher = trainer.model(**inputs).logits[:, :-1].double()
    keep = batch["labels"][:, 1:] != -100
    p_log, q_log = (teacher[keep] / 2.0).log_softmax(-1), (student[keep] / 2.0).log_softmax(-1)
    want = (p_log.exp() * (p_log - q_log)).sum(-1).mean() * 4.0  # T = 2, times T²
    torch.testing.assert_close(parts["kd_loss"].double(), want, rtol=1e-5, atol=1e-7)


def test_a_teacher_of_another_tokenizer_scores_the_servers_rollouts(rollout_server, other_teacher, tmp_path):
    from tests.cross_tokenizer.test_sampled import assert_sampled_kd_is_the_models_own

    trainer = make_trainer(rollout_server, {"teacher": other_teacher}, tmp_path, max_steps=2, alpha=1.0)
    counted, release = [], trainer.teacher.release
    trainer.teacher.release = lambda: (counted.append(dict(trainer.teacher.sampled_rows)), release())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "kd_loss" in h]
    assert len(logs) == 2 and all(h["kd_loss"] > 0 and h["on_policy_fraction"] == 1.0 for h in logs)
    assert counted[0]["rows"] == 8 and counted[0]["unaligned"] == 0  # 2 steps x 4 sampled rows, all aligned
    assert_sampled_kd_is_the_models_own(trainer, other_teacher)  # on a batch the server samples


def test_seq_kd_samples_from_the_served_teachers_own_server(served, tmp_path):
    """seq_kd against a served teacher: its server samples each row (seeded, so asking again gives the same), and
    then scores those rows; nothing syncs (it is not the student)."""
    from trl_distill.rollout.engine_rollouts import row_seed
    from trl_distill.rollout.on_policy import prompts_of
    from trl_distill.rollout.sampling import TEACHER

    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                                 save_strategy="no", use_cpu=True, max_new_tokens=8, seq_kd=True, max_length=64,
                                 teacher_server=served["url"], alpha=1.0, temperature=1.0)
    trainer = DistillationTrainer(served["student"], args=DistillationConfig(**settings),
                                  train_dataset=synthetic_prompt_completion(32), processing_class=served["tokenizer"])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "kd_loss" in h]
    assert len(logs) == 2 and all(h["kd_loss"] > 0 and h["generated_length"] > 0 for h in logs)
    assert trainer.sampler.teacher_engine.sync is None  # never synced anything
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    new, completions = trainer.sampler.sample(TEACHER, dict(batch))
    step, micro = trainer.state.global_step, trainer.sampler.teacher_engine.micro[1] - 1
    again = trainer.sampler.teacher_engine.client.sample(
        [p.tolist() for p in prompts_of(batch)], [row_seed(trainer.args.seed + 7919, step, 0, micro, r)
                                                  for r in range(4)],
        max_tokens=8, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=[served["tokenizer"].eos_token_id])
    assert [c.tolist() for c in completions] == [r.token_ids for r in again]
    assert new["labels"].ne(-100).sum() == sum(len(c) for c in completions)


@pytest.fixture
def expendable_server(tmp_path_factory):
    """A rollout server of its own for the wrong-model test below (the session's shared one must live on): a failed
    load leaves it unable to load weights (vLLM 0.32's layerwise reload keeps the failed shapes: a later sync of the
    right model fails too, so no test may share it)."""
    from trl_distill.testing import build_tiny_model, build_tokenizer, vllm_server

    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.skip(f"no vLLM venv at {VLLM_VENV}: run `make vllm-env` to run the rollout-server tests")
    tokenizer, directory = build_tokenizer(), tmp_path_factory.mktemp("expendable") / "student"
    build_tiny_model(tokenizer, "student", seed=1, hidden_size=64, num_attention_heads=2).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with vllm_server(directory, name="student", rollout=True) as url:
        yield {"url": url, "student": str(directory), "tokenizer": tokenizer}


@pytest.mark.distributed  # starts a vLLM server of its own
def test_a_server_of_another_model_is_one_line_at_the_first_sync(expendable_server, tiny_pair, tmp_path):
    """The tiny pair's student (32 wide) against a server of a 64-wide one with the same tokenizer: the error comes
    at the first sync, well inside the timeout."""
    import time

    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                                 save_strategy="no", use_cpu=True, max_new_tokens=8, lmbda=1.0, use_vllm=True,
                                 vllm_server_base_url=expendable_server["url"], vllm_group_port=free_port(),
                                 vllm_server_timeout=120)
    trainer = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=DistillationConfig(**settings),
                                  train_dataset=synthetic_prompt_completion(32),
                                  processing_class=expendable_server["tokenizer"])
    started = time.monotonic()
    with pytest.raises(RolloutServerError, match=r"could not load the student's weights: it must serve the "
                                                 r"student's own architecture.*Stopped at step 1"):
        trainer.train()
    assert time.monotonic() - started < 60  # well inside vllm_server_timeout


@pytest.fixture
def documented_server(tmp_path_factory):
    """docs/on_policy.md's `trl-distill vllm-serve` command as written (its port, vLLM's defaults, none of the tests'
    environment), for a student of its own: on this CPU machine it must pick a KV cache that fits (vLLM's 0.92 of the
    node did not start). The fault test below kills it (vLLM's default dtype is bf16 here: no test of numbers)."""
    import os
    import shlex
    import sys
    from pathlib import Path

    from trl_distill.testing import build_tiny_model, build_tokenizer, serving

    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.skip(f"no vLLM venv at {VLLM_VENV}: run `make vllm-env` to run the rollout-server tests")
    tokenizer, directory = build_tokenizer(), tmp_path_factory.mktemp("documented") / "student"
    build_tiny_model(tokenizer, "student", seed=1, hidden_size=64, num_attention_heads=2).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    line = next(line for line in (Path(__file__).parents[2] / "docs" / "on_policy.md").read_text().splitlines()
                if line.startswith("trl-distill vllm-serve "))
    argv = [str(directory) if word == "STUDENT" else word for word in shlex.split(line) if word != "&"]
    argv[0] = str(Path(sys.executable).parent / argv[0])  # this venv's console script, as on a user's PATH
    env = {key: value for key, value in os.environ.items() if not key.startswith("VLLM_")}
    log = directory.parent / "server.log"
    with serving(argv, env, f"http://127.0.0.1:{argv[argv.index('--port') + 1]}", log) as url:
        yield {"url": url, "student": str(directory), "tokenizer": tokenizer, "log": log}


@pytest.mark.distributed  # kills the server of its own
def test_the_documented_server_starts_and_dying_during_a_weight_sync_is_named(documented_server, tiny_pair, tmp_path):
    """The docs' command started, saying which KV cache it took (what vLLM then reserved). Killed inside the sync
    before step 4 of 6 (after /pause answered: the weights are on their way), checkpoints every 2 steps: the line says
    the server stopped answering, whichever request or collective noticed first, not that it could not load the
    weights."""
    from trl_distill.rollout.engine_server import cpu_kv_cache_gib
    from trl_distill.runtime.checkpoints import is_complete
    from trl_distill.testing import SERVER_PIDS, kill_tree

    started = documented_server["log"].read_text()
    gib = cpu_kv_cache_gib()
    assert (f"vLLM on CPU: a KV cache of {gib} GiB (VLLM_CPU_KVCACHE_SPACE={gib}, an eighth of this machine's memory: "
            "the training ranks beside it need the rest). Set VLLM_CPU_KVCACHE_SPACE (GiB) to choose.") in started
    assert f"Explicitly set ({gib}.0/" in started  # vLLM's own line: what it reserved
    url = documented_server["url"]
    trainer = make_trainer(documented_server, tiny_pair, tmp_path, max_steps=6, save_strategy="steps", save_steps=2,
                           vllm_server_timeout=60)
    trainer.sampler.engine.client.http.backoff = 0.1
    client = trainer.sampler.engine.client
    update_weights = client.update_weights

    def dying_update(update):
        if trainer.state.global_step == 3:
            kill_tree(SERVER_PIDS[url])
        return update_weights(update)

    client.update_weights = dying_update
    with pytest.raises(RolloutServerError, match=r"The rollout server .* stopped answering during the weight sync "
                                                 r"of step 3 .*Stopped at step 4: resume from the last complete "
                                                 r"checkpoint") as caught:
        trainer.train()
    assert "could not load the student's weights" not in str(caught.value)
    checkpoints = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint-"))
    assert checkpoints == ["checkpoint-2"] and is_complete(str(tmp_path / "out" / "checkpoint-2"))


def test_the_command_line_distils_on_policy_from_the_rollout_server(rollout_server, tiny_pair, tmp_path):
    """`trl-distill --lmbda 1 --use_vllm --vllm_server_base_url URL ...`, as docs/on_policy.md writes it."""
    import ast
    import subprocess
    import sys

    data = tmp_path / "pc.jsonl"
    synthetic_prompt_completion(16).to_json(str(data))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "trl_distill", "--model_name_or_path", rollout_server["student"],
           "--teacher_model_name_or_path", tiny_pair["teacher"], "--dataset_name", str(data), "--output_dir",
           str(out), "--lmbda", "1", "--use_vllm", "--vllm_server_base_url", rollout_server["url"],
           "--vllm_group_port", str(free_port()), "--divergence", "reverse_kl", "--max_steps", "2",
           "--max_new_tokens", "6", "--per_device_train_batch_size", "4", "--logging_steps", "1", "--use_cpu", "true",
           "--bf16", "false", "--report_to", "none", "--save_strategy", "no"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [ast.literal_eval(line) for line in done.stdout.splitlines() if line.startswith("{'loss'")]
    assert len(logs) == 2 and all(log["on_policy_fraction"] == "1" and int(log["rollout_tokens"]) > 0 for log in logs)


def test_vllm_serve_without_vllm_is_one_line(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "trl_distill", "vllm-serve", "--model", str(tmp_path), "--python",
                           str(tmp_path / "no-python")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"trl-distill vllm-serve: error: {tmp_path / 'no-python'} cannot run the rollout server: it needs vLLM and "
        "trl_distill's vLLM plugin. Build them with `make vllm-env` (or `pip install vllm ./vllm_plugin` in a Python "
        "of your choice and pass --python or TRL_DISTILL_VLLM_PYTHON)."]


def test_the_generation_eval_samples_from_the_synced_server_as_hf_generate_does(rollout_server, tiny_pair, tmp_path):
    """`use_vllm`: evaluate() syncs the server to the student first and samples there; greedy, it judges the same
    completions as the student's own HF `generate` (the engine's log-probs are the trainer's within 1e-4), and counts
    nothing into the training's rollout statistics."""
    from trl_distill.testing import with_answers

    trainer = make_trainer(rollout_server, tiny_pair, tmp_path, with_answers(synthetic_prompt_completion(8, seed=3)),
                           eval_reward_funcs=["trl_distill.testing:even_length_reward"], eval_max_new_tokens=8)
    served = trainer.evaluate()
    engine = trainer.sampler.engine
    assert engine.synced_step == 0 and engine.take_stats()[2:] == [0.0] * 7  # synced, nothing counted
    trainer.sampler.engine = None  # the same evaluation from HF generate
    local = trainer.evaluate()
    trainer.sampler.engine = engine
    for name in ("eval_pass@1", "eval_generated_length", "eval_eos_rate", "eval_generation_prompts"):
        assert served[name] == local[name], name
    assert served["eval_teacher_nll"] == pytest.approx(local["eval_teacher_nll"], abs=1e-5)
