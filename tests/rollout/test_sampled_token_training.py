"""The sampled-token objective in the trainer: on the student's own samples, the loss of every step is the formula
on both models' own logits (float64), with a task reward from the rows' own columns and with two routed teachers,
logged as `policy_loss` (no `kd_loss`); a served teacher is asked for the sampled tokens' log-probs only; the
rollout server's log-probs enter as the ratio or, corrected, as truncated importance weights; what cannot combine is
one line."""

import pytest
import torch
import torch.nn.functional as F
from oracles import shared_characters_reward
from side_channels import side_channels
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import EXTRAS, add_extras, extras_of, loss_tokens
from trl_distill.rollout.sampling import STUDENT
from trl_distill.run_plan import resolve
from trl_distill.testing import logged, synthetic_prompt_completion, tiny_run_settings


def dataset(names=None, rows=32):
    data = synthetic_prompt_completion(rows)
    return data if names is None else data.add_column("teacher", [names[i % len(names)] for i in range(rows)])


def trainer_for(pair, tmp_path, data, eval_dataset=None, **overrides) -> DistillationTrainer:
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3,
                                 save_strategy="no", use_cpu=True, kd_temperature_scaling=False)
    settings.update(overrides)
    return DistillationTrainer(pair["student"], args=DistillationConfig(**settings), train_dataset=data,
                               eval_dataset=eval_dataset,
                               processing_class=AutoTokenizer.from_pretrained(pair["tokenizer"]))


SAMPLED = dict(lmbda=1.0, max_new_tokens=6, alpha=1.0, temperature=1.0, on_policy_objective="sampled_token",
               sampled_token_kl_coef=0.5)


def token_log_probs(model, batch):
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    target, mask = loss_tokens(batch)
    logp = F.log_softmax(model(**inputs).logits[:, :-1].double(), -1)
    return logp.gather(2, target.clamp(min=0)[..., None]).squeeze(2)[mask], mask


def expected_loss(trainer, batch, teachers, rewards=None):
    """-mean over sampled tokens of kl_coef (log p_teacher − log p_student) + w (R − mean R) (HF generate: ratio 1)."""
    args = trainer.args
    student, mask = token_log_probs(trainer.model, batch)
    route = extras_of(batch).route
    route = route if route is not None else torch.zeros(mask.shape[0], dtype=torch.long)
    per_row = route[:, None].expand_as(mask)[mask]
    teacher = torch.stack([token_log_probs(t, batch)[0] for t in teachers]).gather(0, per_row[None]).squeeze(0)
    advantage = args.sampled_token_kl_coef * (teacher - student)
    if rewards is not None:
        sequence = torch.arange(mask.shape[0])[:, None].expand_as(mask)[mask]
        advantage = advantage + args.task_reward_weight * (rewards - rewards.mean())[sequence]
    return -advantage.mean()


def test_each_step_is_the_formula_with_a_task_reward_and_two_routed_teachers(tiny_pair, second_teacher, tmp_path,
                                                                             caplog):
    trainer = trainer_for(tiny_pair, tmp_path, dataset(["a", "b", "b"]), max_steps=3,
                          teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"],
                          task_reward_funcs=["oracles:shared_characters_reward"], task_reward_weight=2.0, **SAMPLED)
    checks, compute_loss = [], trainer.compute_loss

    def checked(model, inputs, return_outputs=False, num_items_in_batch=None):
        rewards, route = extras_of(inputs).task_rewards, extras_of(inputs).route.tolist()
        assert side_channels(inputs) == [EXTRAS]  # the route and the rewards, in the one key
        teachers = [member.module for member in trainer.teacher.members.values()]
        with torch.no_grad():
            want = expected_loss(trainer, inputs, teachers, rewards)
        loss, outputs = compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        checks.append((outputs["policy_loss"].item(), want.item(), rewards, route))
        return (loss, outputs) if return_outputs else loss

    trainer.compute_loss = checked
    trainer.train()
    history = trainer.state.log_history
    assert len(checks) == 3
    for kd, want, *_ in checks:
        assert kd == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert any(len(set(r.tolist())) > 1 for _, _, r, _ in checks)  # rewards that differ: the task term is live
    assert sorted({i for *_, route in checks for i in route}) == [0, 1]
    assert logged(history, "clip_ratio") == {1: 0.0, 2: 0.0, 3: 0.0}  # HF generate: the ratio is 1
    assert all(0 <= v <= 1 for v in logged(history, "task_reward").values())
    # the surrogate logs as TRL GRPO's policy_loss, never as a divergence's kd_loss; loss is what is optimised
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 3 and not [key for h in history for key in h if key.startswith("kd_loss")], history
    assert [h["policy_loss"] for h in steps] == pytest.approx([kd for kd, *_ in checks], rel=1e-6)
    assert [h["loss"] for h in steps] == pytest.approx([h["policy_loss"] for h in steps], rel=1e-4, abs=1e-6)
    for h in steps:  # (alpha 1)
        assert h["policy_loss/a"] + h["policy_loss/b"] == pytest.approx(h["policy_loss"], rel=1e-6)
    warned = [r.getMessage() for r in caplog.records if r.name == "trl_distill.rollout.learning_rate"]
    assert warned == [  # tiny_run_settings' 2e-3, built once: one line
        "On-policy distillation (lmbda=1.0, sampled_token objective) at learning_rate=2e-3, above the 5e-5 "
        "docs/on_policy.md recommends for full fine-tuning (LoRA 1e-4, full fine-tuning 5e-5): faster runs have "
        "ended below their warm start or collapsed; lower --learning_rate."]
    assert shared_characters_reward([None], ["ab"], completion=["b c"]) == [0.5]


def test_a_served_teacher_is_asked_for_the_sampled_tokens_only(served, tmp_path):
    pair = {"student": served["student"], "tokenizer": served["teacher"]}
    trainer = trainer_for(pair, tmp_path, dataset(), teacher_server=served["url"], max_length=64, **SAMPLED)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    sampled, _ = trainer.sampler.sample(STUDENT, batch)
    assert side_channels(batch) == side_channels(sampled) == [EXTRAS]  # the served signal, in the one key
    signal = trainer.teacher.pop_batch(dict(sampled))
    target, mask = loss_tokens(sampled)
    assert signal.ids.shape == (int(mask.sum()), 1)  # one id per sampled token: the token itself
    assert torch.equal(signal.ids[:, 0], target[mask])
    with torch.no_grad():
        hf, _ = token_log_probs(served["model"], sampled)
        torch.testing.assert_close(signal.log_probs[:, 0].double(), hf, atol=2e-4, rtol=0)  # vLLM's = HF's
        trainer.model.train()
        trainer.sampler.on_policy, trainer.current_gradient_accumulation_steps = True, 1
        _, out = trainer.compute_loss(trainer.model, sampled, return_outputs=True)
        want = expected_loss(trainer, sampled, [served["model"]])
    assert out["policy_loss"].item() == pytest.approx(want.item(), rel=1e-3)


@pytest.mark.parametrize("overrides, message", [
    (dict(lmbda=0.5), "set lmbda=1 and seq_kd=False"),
    (dict(temperature=2.0), "set temperature=1"),
    (dict(teachers=["a=./a", "b=./b"], teacher_combine="sum"), "route several teachers"),
    (dict(epsilon=1.5), "epsilon must be in [0, 1)"),
    (dict(sampled_token_discount=1.5), "sampled_token_discount must be in [0, 1]"),
    (dict(on_policy_objective="divergence", task_reward_funcs=["last_number"]), "set on_policy_objective="),
])
def test_what_cannot_combine_is_one_line(tmp_path, overrides, message):
    with pytest.raises(ValueError) as error:
        resolve(DistillationConfig(output_dir=str(tmp_path), **{**SAMPLED, **overrides}))
    assert message in str(error.value) and "\n" not in str(error.value)


def across_share(teacher, batch, mask) -> torch.Tensor:
    """Per sampled token (float64, NaN where no group covers it): the teacher of another tokenizer's log-prob of its
    aligned group's text (its own teacher tokens summed, from its own logits) over the group's student tokens.
    Asserts each group's tokens stand for the same text on both sides."""
    teacher_ids, teacher_mask, groups, _, lengths = extras_of(batch).cross_tokenizer
    teacher_logp = F.log_softmax(teacher.module(input_ids=teacher_ids, attention_mask=teacher_mask).logits.double(), -1)
    share = torch.full(mask.shape, float("nan"), dtype=torch.float64)
    for (row, s_pos, t_pos), (n_s, n_t) in zip(groups.tolist(), lengths.tolist(), strict=True):
        s_ids, t_ids = batch["input_ids"][row, s_pos + 1:s_pos + 1 + n_s], teacher_ids[row, t_pos + 1:t_pos + 1 + n_t]
        assert (teacher.student_tokenizer.decode(s_ids, skip_special_tokens=True).strip()
                == teacher.teacher_tokenizer.decode(t_ids, skip_special_tokens=True).strip())
        text = sum(teacher_logp[row, t_pos + k, int(t_ids[k])] for k in range(n_t))
        share[row, s_pos:s_pos + n_s] = text / n_s
    return share[mask]


def expected_across(trainer, batch) -> torch.Tensor:
    """The loss across tokenizers: a token no group covers has no teacher reward."""
    student, mask = token_log_probs(trainer.model, batch)
    share = across_share(trainer.teacher, batch, mask)
    assert int(torch.isfinite(share).sum()) >= 5  # sampled tokens in aligned groups (an untrained student's random
    # bytes that decode to no text, U+FFFD, lie in none)
    gap = torch.where(torch.isnan(share), 0.0, share - student)
    return -(trainer.args.sampled_token_kl_coef * gap).mean()


def test_a_teacher_of_another_tokenizer_routed_beside_one_of_the_students(tiny_pair, other_teacher, tmp_path):
    """Routed on the student's samples: each row's tokens take their own teacher's log-prob, the student's-tokenizer
    teacher's per token and the other's per aligned group, every step."""
    trainer = trainer_for(tiny_pair, tmp_path, dataset(["a", "b"]), max_steps=2,
                          teachers=[f"a={tiny_pair['teacher']}", f"b={other_teacher}"], **SAMPLED)
    checks, compute_loss = [], trainer.compute_loss

    def checked(model, inputs, return_outputs=False, num_items_in_batch=None):
        route = extras_of(inputs).route
        with torch.no_grad():
            student, mask = token_log_probs(trainer.model, inputs)
            own = token_log_probs(trainer.teacher.members["a"].module, inputs)[0]
            across = across_share(trainer.teacher.members["b"], inputs, mask)
            teacher = torch.where(route[:, None].expand_as(mask)[mask] == 0, own, across)
            gap = torch.where(torch.isnan(teacher), 0.0, teacher - student)
            want = -(trainer.args.sampled_token_kl_coef * gap).mean()
        loss, outputs = compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        checks.append((outputs["policy_loss"].item(), want.item(), sorted(set(route.tolist()))))
        return (loss, outputs) if return_outputs else loss

    trainer.compute_loss = checked
    trainer.train()
    assert len(checks) == 2 and [0, 1] in [routes for *_, routes in checks]
    for kd, want, _ in checks:
        assert kd == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("teacher_reads", ["words", "characters"])
def test_a_teacher_of_another_tokenizer_scores_each_aligned_groups_text(tiny_pair, other_teacher, tmp_path,
                                                                        teacher_reads):
    """The dataset's completions scored as the student's samples, both ways round: a teacher of whole words (the
    student's characters share each word's log-prob) and a teacher of characters (a word's summed); then training on
    the student's own samples."""
    if teacher_reads == "words":
        pair, teacher = tiny_pair, other_teacher
    else:
        pair, teacher = {"student": other_teacher, "tokenizer": other_teacher}, tiny_pair["teacher"]
    trainer = trainer_for(pair, tmp_path, dataset(), teacher_model_name_or_path=teacher, max_steps=2,
                          eval_dataset=synthetic_prompt_completion(8, seed=5), **SAMPLED)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.teacher.score_sampled(batch, dict(batch))  # the completions, as if the student had sampled them
    lengths = extras_of(batch).cross_tokenizer.group_lengths
    assert int((lengths[:, 0 if teacher_reads == "words" else 1] > 1).sum()) >= 10, lengths.tolist()
    with torch.no_grad():
        want = expected_across(trainer, batch)
        trainer.model.train()
        trainer.sampler.on_policy, trainer.current_gradient_accumulation_steps = True, 1
        _, out = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    assert out["policy_loss"].item() == pytest.approx(want.item(), rel=1e-5)
    trainer.sampler.on_policy = False
    trainer.train()
    gaps = logged(trainer.state.log_history, "sampled_token_teacher_gap")
    assert list(gaps) == [1, 2] and all(-50 < v < 50 and v != 0 for v in gaps.values()), gaps
    assert trainer.evaluate()["eval_loss"] > 0  # the eval split's completions: scored by the divergence


def test_the_ratio_is_against_the_rollout_servers_log_probs(rollout_server, tiny_pair, tmp_path):
    """Rollouts from the student's vLLM server: ρ = π_student / π_engine per sampled token, from the engine's own
    log-probs (shifted here by ±0.5 nats so the clip binds on some tokens), clipped as GRPO clips it."""
    from trl_distill.runtime.distributed import free_port

    pair = {"student": rollout_server["student"], "tokenizer": tiny_pair["tokenizer"]}
    trainer = DistillationTrainer(pair["student"], tiny_pair["teacher"], args=DistillationConfig(**tiny_run_settings(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1, save_strategy="no",
        use_cpu=True, use_vllm=True, vllm_server_base_url=rollout_server["url"], vllm_group_port=free_port(),
        vllm_server_timeout=60, epsilon=0.1, epsilon_high=0.3, **SAMPLED)), train_dataset=dataset(),
        processing_class=rollout_server["tokenizer"])
    try:
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        sampled, _ = trainer.sampler.sample(STUDENT, batch)
        engine = extras_of(sampled).rollout_logprobs
        assert side_channels(sampled) == [EXTRAS]  # the engine's log-probs, in the one key
        shift = torch.where(torch.arange(len(engine)) % 2 == 0, 0.5, -0.5)
        add_extras(sampled, rollout_logprobs=engine + shift)
        with torch.no_grad():
            student, mask = token_log_probs(trainer.model, sampled)
            teacher, _ = token_log_probs(trainer.teacher.module, sampled)
            trainer.model.train()
            trainer.sampler.on_policy, trainer.current_gradient_accumulation_steps = True, 1
            _, out = trainer.compute_loss(trainer.model, dict(sampled), return_outputs=True)
        assert (engine.double() - student).abs().max() < 1e-4  # the engine scores as the student does
        advantage = trainer.args.sampled_token_kl_coef * (teacher - student)
        ratio = torch.exp(student - (engine + shift).double())
        want = -torch.minimum(ratio * advantage, ratio.clamp(0.9, 1.3) * advantage).mean()
        assert out["policy_loss"].item() == pytest.approx(want.item(), rel=1e-4)
        assert 0 < trainer.sampler.objective["clipped"] < mask.sum()
        # vllm_importance_sampling_correction, as TRL's GRPO: ρ against the trainer's own log-probs (1), each
        # token's surrogate weighted by min(π / π_engine, clip_max) instead (the cap binding on half the tokens)
        trainer.args.vllm_importance_sampling_correction, trainer.args.vllm_importance_sampling_clip_max = True, 1.2
        with torch.no_grad():
            _, out = trainer.compute_loss(trainer.model, dict(sampled), return_outputs=True)
        weights = ratio.clamp(max=1.2)
        assert 0 < int((weights == 1.2).sum()) < mask.sum()
        assert out["policy_loss"].item() == pytest.approx(-(weights * advantage).mean().item(), rel=1e-4)
    finally:
        trainer.sampler.close()


def test_routed_teachers_on_the_servers_rollouts_keep_each_tokens_engine_log_prob(rollout_server, tiny_pair,
                                                                                   second_teacher, tmp_path):
    """Routed, the loss takes its rows teacher by teacher: the engine's log-prob of each token must follow its token
    (each shifted by its own amount here, so a misordered one would change the loss)."""
    from trl_distill.runtime.distributed import free_port

    trainer = DistillationTrainer(rollout_server["student"], args=DistillationConfig(**tiny_run_settings(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1, save_strategy="no",
        use_cpu=True, use_vllm=True, vllm_server_base_url=rollout_server["url"], vllm_group_port=free_port(),
        vllm_server_timeout=60, teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"], epsilon=0.1,
        **SAMPLED)), train_dataset=dataset(["a", "b", "b"]), processing_class=rollout_server["tokenizer"])
    try:
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        sampled, _ = trainer.sampler.sample(STUDENT, batch)
        assert sorted(set(extras_of(sampled).route.tolist())) == [0, 1]
        engine = extras_of(sampled).rollout_logprobs
        assert side_channels(sampled) == [EXTRAS]  # the route and the engine's log-probs, in the one key
        shift = torch.linspace(-0.4, 0.4, len(engine))
        add_extras(sampled, rollout_logprobs=engine + shift)
        teachers = [member.module for member in trainer.teacher.members.values()]
        with torch.no_grad():
            student, mask = token_log_probs(trainer.model, sampled)
            per_row = extras_of(sampled).route[:, None].expand_as(mask)[mask]
            teacher = torch.stack([token_log_probs(t, sampled)[0] for t in teachers]).gather(0, per_row[None])[0]
            trainer.model.train()
            trainer.sampler.on_policy, trainer.current_gradient_accumulation_steps = True, 1
            _, out = trainer.compute_loss(trainer.model, dict(sampled), return_outputs=True)
        advantage = trainer.args.sampled_token_kl_coef * (teacher - student)
        ratio = torch.exp(student - (engine + shift).double())
        want = -torch.minimum(ratio * advantage, ratio.clamp(0.9, 1.1) * advantage).mean()
        assert out["policy_loss"].item() == pytest.approx(want.item(), rel=1e-4)
    finally:
        trainer.sampler.close()


def test_self_distillation_under_the_sampled_token_objective(tiny_pair, tmp_path):
    """The 'self' teacher is the LoRA student's base, and LoRA starts as the identity: on the first step every
    sampled token's teacher reward is 0 (only the task reward moves the adapters), and once they have moved the
    base and the student disagree on the sampled tokens."""
    from peft import LoraConfig

    args = DistillationConfig(**tiny_run_settings(
        output_dir=str(tmp_path / "out"), teacher_model_name_or_path="self", per_device_train_batch_size=4,
        max_steps=3, save_strategy="no", use_cpu=True, learning_rate=5e-2,
        task_reward_funcs=["oracles:shared_characters_reward"], **SAMPLED))
    trainer = DistillationTrainer(tiny_pair["student"], args=args, train_dataset=dataset(),
                                  peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    gap = logged(trainer.state.log_history, "sampled_token_teacher_gap")
    assert gap[1] == 0.0 and gap[3] != 0.0
