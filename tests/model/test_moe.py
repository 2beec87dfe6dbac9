"""Mixture-of-Experts students and teachers (issue 45): on every MoE architecture transformers ships that builds from
a tiny config here, the start-up logits check takes the fused path for both models, and the loss is
``alpha * KD + (1 - alpha) * CE + router_aux_loss_coef * aux`` with KD and CE from each model's own logits and
``aux`` the student's own forward's router load-balancing loss (`output_router_logits=True`), its gradient reaching
the router; training logs it as `aux_loss`. A model whose forward computes no such loss is refused with one line."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from trl_distill import DistillationConfig, DistillationTrainer, divergence
from trl_distill.testing import (
    build_tokenizer,
    launch,
    read_rank_records,
    synthetic_prompt_completion,
    tiny_run_settings,
)

SCRIPTS = Path(__file__).parents[1] / "scripts"

SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             num_experts_per_tok=2)
COEF = 0.02
SAMPLES_ROUTES_IN_TRAINING = {"phimoe"}  # its router samples experts in train mode (sparsemixer): no fixed reference
# model type -> its expert fields (the names differ per architecture), for a tiny model of 4 experts, top-2
MOE = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16, head_dim=8),
    "olmoe": dict(num_experts=4),
    "flex_olmo": dict(num_experts=4),
    "gpt_oss": dict(num_local_experts=4, head_dim=8),
    "granitemoe": dict(num_local_experts=4),
    "granitemoeshared": dict(num_local_experts=4, shared_intermediate_size=16),
    "phimoe": dict(num_local_experts=4),
    "minimax": dict(num_local_experts=4, head_dim=8),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16),
    "jamba": dict(num_experts=4, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
                  attn_layer_offset=1),
    "jetmoe": dict(num_local_experts=4),
    "qwen3_next": dict(num_experts=4, moe_intermediate_size=16, head_dim=8, shared_expert_intermediate_size=16),
}

MLA = dict(num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
# MoE models whose forward computes no router loss (a bias keeps their experts balanced): distilled without one
NO_ROUTER_LOSS = {
    "deepseek_v3": dict(n_routed_experts=4, moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1,
                        **MLA),
    "deepseek_v2": dict(n_routed_experts=4, moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1,
                        **MLA),
    "glm4_moe": dict(n_routed_experts=4, moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1,
                     head_dim=8, num_key_value_heads=2),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, head_dim=8, num_key_value_heads=2),
    "exaone_moe": dict(num_experts=4, moe_intermediate_size=16, head_dim=8, num_key_value_heads=2),
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def build(tokenizer, name: str, seed: int, **overrides):
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    config = AutoConfig.for_model(name, vocab_size=len(tokenizer), **ids,
                                  **{**SMALL, **MOE.get(name, {}), **NO_ROUTER_LOSS.get(name, {}), **overrides})
    for key, value in config.to_dict().items():  # deterministic forwards: train mode == eval mode
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def routers(model) -> dict[str, torch.nn.Parameter]:
    """The router (gate) weights of each MoE layer."""
    return {n: p for n, p in model.named_parameters() if ("gate" in n or "router" in n) and "proj" not in n
            and p.dim() == 2 and p.shape[0] == 4}


@pytest.mark.parametrize("name", list(MOE))
def test_the_loss_adds_the_students_own_router_loss(name, tokenizer, tmp_path):
    teacher, student = build(tokenizer, name, 0), build(tokenizer, name, 1)
    data = synthetic_prompt_completion(6, seed=3)
    args = DistillationConfig(output_dir=str(tmp_path), router_aux_loss_coef=COEF, **tiny_run_settings(
        max_steps=1, per_device_train_batch_size=len(data), divergence="forward_kl", alpha=0.5, temperature=1.0))
    trainer = DistillationTrainer(student, teacher, args=args, train_dataset=data, processing_class=tokenizer)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == COEF
    batch = trainer.prepared_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(len(data))]))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    target = batch["labels"][:, 1:]
    mask = target != -100
    with torch.no_grad():
        own = student(**inputs, output_router_logits=True, use_cache=False)
        s, t = own.logits[:, :-1][mask], teacher(**inputs, use_cache=False).logits[:, :-1][mask]
        kd, ce = divergence(s, t, "forward_kl").item(), F.cross_entropy(s, target[mask]).item()
    aux = own.aux_loss.item()
    assert aux > 0

    trainer.prepare_teacher()
    trainer.model.eval()  # (one micro-batch, its own mean; dropout is 0 either way)
    loss = trainer.compute_loss(trainer.model, dict(batch))
    assert loss.item() == pytest.approx(0.5 * kd + 0.5 * ce + COEF * aux, abs=1e-6)
    assert {p.name: p.exact for p in trainer.logit_paths} == {"student": False, "teacher": False}
    loss.backward()
    with_aux = {n: p.grad.clone() for n, p in routers(student).items()}
    assert with_aux and all(g.abs().sum() > 0 for g in with_aux.values())
    student.zero_grad()
    # the router loss's own gradient
    (COEF * student(**inputs, output_router_logits=True, use_cache=False).aux_loss).backward()
    aux_grad = {n: p.grad.clone() for n, p in routers(student).items()}
    student.zero_grad()
    trainer.compute_loss(trainer.model, dict(batch)).backward()
    trainer.router_aux_loss_coef = 0.0
    student.zero_grad()
    trainer.compute_loss(trainer.model, dict(batch)).backward()
    without = {n: p.grad.clone() for n, p in routers(student).items()}
    for n in with_aux:  # what the aux term adds to the router's gradient is the router loss's own gradient
        torch.testing.assert_close(with_aux[n] - without[n], aux_grad[n], rtol=1e-4, atol=1e-7)

    trainer.router_aux_loss_coef = COEF
    student.zero_grad()
    trainer.model.train()
    trainer.train()
    logged = trainer.state.log_history[0]
    if name in SAMPLES_ROUTES_IN_TRAINING:
        assert logged["aux_loss"] > 0
        return
    assert logged["aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert logged["loss"] == pytest.approx(0.5 * kd + 0.5 * ce + COEF * aux, rel=1e-5)


@pytest.mark.parametrize("name", list(NO_ROUTER_LOSS))
def test_moe_models_without_a_router_loss_distil_on_the_fused_path(name, tokenizer, tmp_path):
    """The logits check takes the fused path for both models and the logged KD and CE equal each model's own logits';
    no router loss is added or logged (the configs declare no coefficient)."""
    teacher, student = build(tokenizer, name, 0), build(tokenizer, name, 1)
    data = synthetic_prompt_completion(6, seed=3)
    args = DistillationConfig(output_dir=str(tmp_path), **tiny_run_settings(
        max_steps=1, per_device_train_batch_size=len(data), divergence="reverse_kl", alpha=0.5, temperature=2.0))
    trainer = DistillationTrainer(student, teacher, args=args, train_dataset=data, processing_class=tokenizer)
    assert not trainer.aux_loss_enabled
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(data))])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    target = batch["labels"][:, 1:]
    mask = target != -100
    with torch.no_grad():
        s, t = student(**inputs).logits[:, :-1][mask], teacher(**inputs).logits[:, :-1][mask]
        kd = divergence(s, t, "reverse_kl", temperature=2.0).item() * 4.0
        ce = F.cross_entropy(s, target[mask]).item()
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["kd_loss"] == pytest.approx(kd, rel=1e-4) and logged["ce_loss"] == pytest.approx(ce, rel=1e-4)
    assert "aux_loss" not in logged
    assert {p.name: p.exact for p in trainer.logit_paths} == {"student": False, "teacher": False}


def test_a_student_whose_forward_computes_no_router_loss_is_refused(tokenizer, tmp_path):
    """DeepSeek-V3 balances its experts with a bias, not a loss: a coefficient for one is refused, naming the fix."""
    student = build(tokenizer, "deepseek_v3", 1)
    args = DistillationConfig(output_dir=str(tmp_path / "out"), router_aux_loss_coef=COEF, **tiny_run_settings())
    with pytest.raises(ValueError, match="computes no router load-balancing loss.*router_aux_loss_coef=0.0"):
        DistillationTrainer(student, build(tokenizer, "mixtral", 0), args=args,
                            train_dataset=synthetic_prompt_completion(6), processing_class=tokenizer)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory, tokenizer) -> Path:
    """A Mixtral teacher (hidden 32) and a Mixtral student (hidden 16), 4 experts, top-2, saved as
    `save_pretrained` writes them (each expert's tensors apart)."""
    directory = tmp_path_factory.mktemp("moe_pair")
    for seed, (size, hidden) in enumerate((("teacher", 32), ("student", 16))):
        build(tokenizer, "mixtral", seed, hidden_size=hidden, intermediate_size=2 * hidden).save_pretrained(
            directory / size)
        tokenizer.save_pretrained(directory / size)
    return directory


@pytest.mark.distributed
def test_a_zero3_moe_teacher_beside_a_zero2_moe_student_with_routing_forced_unequal(moe_pair, tmp_path):
    """2 processes, a row each: the teacher (ZeRO-3, half of it on each rank, read by each rank from the checkpoint's
    per-expert tensors) routes every token of a row to the
    two experts of its parity, so in each of its forwards two experts receive no token on one rank and the other two
    on the other; nothing hangs (bounded launch), KD and CE equal the 1-process run on the same rows, and the logged
    router loss is the ranks' mean of the student's own forward's."""
    launch(SCRIPTS / "moe_worker.py", str(moe_pair), str(tmp_path / "two"), timeout=300)
    launch(SCRIPTS / "moe_worker.py", str(moe_pair), str(tmp_path / "one"), "single", nproc=1, timeout=300)
    two, (one,) = read_rank_records(tmp_path / "two"), read_rank_records(tmp_path / "one", ranks=1)
    stored = (moe_pair / "teacher" / "model.safetensors").stat().st_size
    for rank in two:
        assert rank["teacher_share"] == pytest.approx(0.5, abs=0.02)
        assert rank["bytes_read"] == pytest.approx(stored / 2, rel=0.05)  # its half of the experts' tensors, read
        assert rank["expert_tokens"] and all(sorted(c)[:2] == [0, 0] and sum(c) > 0 for c in rank["expert_tokens"])
        assert all(len(p) == 1 for step in rank["trained"] for p in step["parities"])  # a row: one parity
    idle = [{e for e, c in enumerate(counts) if c == 0} for counts in (two[0]["expert_tokens"][-1],
                                                                       two[1]["expert_tokens"][-1])]
    assert idle[0].isdisjoint(idle[1])  # the last step's forward: rank 0's idle experts are rank 1's busy ones
    assert one["bytes_read"] == 0  # (1 process, no DeepSpeed: transformers' own loader)
    assert len(two[0]["log"]) == len(one["log"]) == 2
    for step, (logged, alone) in enumerate(zip(two[0]["log"], one["log"], strict=True)):
        for key in ("kd_loss", "ce_loss"):
            assert logged[key] == pytest.approx(alone[key], rel=1e-5), (step, key)
        own = [rank["trained"][step]["own_aux"] for rank in two]
        assert logged["aux_loss"] == pytest.approx(sum(own) / 2, rel=1e-5)
        assert alone["aux_loss"] == pytest.approx(one["trained"][step]["own_aux"], rel=1e-5)
        for record in (logged, alone):
            mixed = 0.5 * record["kd_loss"] + 0.5 * record["ce_loss"] + COEF * record["aux_loss"]
            assert record["loss"] == pytest.approx(mixed, rel=1e-4)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_a_checkpoint_of_experts_apart_lays_out_each_fused_parameter(name, tokenizer, tmp_path):
    """`save_pretrained` keeps each expert's tensors apart; `expert_layout` names, for each fused parameter, the
    checkpoint tensors that fill it in order: read so, they equal what transformers' own loader builds."""
    from safetensors import safe_open

    from trl_distill.teacher.expert_layout import expert_layout

    build(tokenizer, name, 0).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as stored:
        checkpoint = {k: tuple(stored.get_slice(k).get_shape()) for k in stored.keys()}  # noqa: SIM118
        assert set(checkpoint) != set(shapes)  # (the experts' tensors are apart)
        layout = expert_layout(model.config.model_type, shapes, checkpoint)
        assert layout is not None and set(layout) == set(shapes)
        for param_name, param in model.named_parameters():
            flat = torch.cat([stored.get_tensor(k).reshape(-1) for k, _ in layout[param_name]])
            assert torch.equal(flat, param.detach().reshape(-1)), param_name
        fused = [n for n in shapes if n.endswith("experts.gate_up_proj")]
        assert fused and len(layout[fused[0]]) == 2 * 4  # 4 experts, gate and up each
        del checkpoint[next(k for k in checkpoint if ".experts.3." in k)]
        assert expert_layout(model.config.model_type, shapes, checkpoint) is None  # a missing expert: not laid out


def test_a_lora_student_with_adapters_on_attention_and_experts(tokenizer, tmp_path):
    """LoRA on the attention projections and on the fused expert tensors (peft's `target_parameters`): the loss is
    the same sum against the adapted student's own logits and router loss, and the experts' adapters get gradients."""
    from peft import LoraConfig

    teacher, student = build(tokenizer, "mixtral", 0), build(tokenizer, "mixtral", 1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    data = synthetic_prompt_completion(6, seed=3)
    args = DistillationConfig(output_dir=str(tmp_path), router_aux_loss_coef=COEF, **tiny_run_settings(
        max_steps=1, per_device_train_batch_size=len(data), divergence="forward_kl", alpha=0.5, temperature=1.0))
    trainer = DistillationTrainer(student, teacher, args=args, train_dataset=data, processing_class=tokenizer,
                                  peft_config=lora)
    torch.manual_seed(5)
    with torch.no_grad():  # adapters that change the student (lora_B starts at zero)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    batch = trainer.prepared_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(len(data))]))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    target = batch["labels"][:, 1:]
    mask = target != -100
    trainer.model.eval()
    with torch.no_grad():
        own = trainer.model(**inputs, output_router_logits=True, use_cache=False)
        base = teacher(**inputs, use_cache=False)
        s, t = own.logits[:, :-1][mask], base.logits[:, :-1][mask]
        kd, ce = divergence(s, t, "forward_kl").item(), F.cross_entropy(s, target[mask]).item()
    trainer.prepare_teacher()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    assert loss.item() == pytest.approx(0.5 * kd + 0.5 * ce + COEF * own.aux_loss.item(), abs=1e-6)
    loss.backward()
    experts = [p.grad for n, p in trainer.model.named_parameters() if "experts" in n and "lora_A" in n]
    assert experts and all(g is not None and g.abs().sum() > 0 for g in experts)


@pytest.mark.parametrize("kind", ["cache", "served", "cross-tokenizer"])
def test_the_router_loss_joins_the_loss_whatever_the_teacher(kind, tokenizer, tmp_path, request):
    """The router loss comes from the student's forward alone: with a teacher cache, a served teacher (a real vLLM
    server) or a teacher of another tokenizer, the loss with it minus the loss without it is `coef * aux` of the
    student's own forward, on the same batch."""
    from oracles import write_teacher_cache

    student = build(tokenizer, "mixtral", 1)
    settings = dict(router_aux_loss_coef=COEF, **tiny_run_settings(max_steps=1, per_device_train_batch_size=4,
                                                                   alpha=0.5, temperature=1.0, max_length=64))
    data = synthetic_prompt_completion(4, seed=3)
    if kind == "cache":
        writer = DistillationTrainer(student, build(tokenizer, "mixtral", 0), train_dataset=data,
                                     processing_class=tokenizer,
                                     args=DistillationConfig(output_dir=str(tmp_path / "writer"), **settings))
        write_teacher_cache(writer, str(tmp_path / "cache"), top_k=8, log_prob_dtype="float32")
        teacher = dict(teacher_cache=str(tmp_path / "cache"))
    elif kind == "served":
        teacher = dict(teacher_server=request.getfixturevalue("served")["url"], teacher_server_top_k=8)
    else:
        teacher = dict(teacher_model_name_or_path=request.getfixturevalue("other_teacher"))
    args = DistillationConfig(output_dir=str(tmp_path / "run"), **teacher, **settings)
    trainer = DistillationTrainer(student, args=args, train_dataset=data, processing_class=tokenizer)
    assert trainer.aux_loss_enabled
    batch = trainer.prepared_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(len(data))]))
    trainer.prepare_teacher()
    trainer.model.eval()
    with torch.no_grad():
        with_aux = trainer.compute_loss(trainer.model, dict(batch)).item()
        trainer.router_aux_loss_coef = 0.0
        without = trainer.compute_loss(trainer.model, dict(batch)).item()
        own = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      output_router_logits=True, use_cache=False).aux_loss.item()
    assert own > 0 and with_aux - without == pytest.approx(COEF * own, abs=1e-6)


def test_on_policy_the_router_loss_is_taken_on_the_students_own_samples(tokenizer, tmp_path):
    """lmbda=1: every batch is the student's own completions (HF generate); the router loss is logged and the loss
    is still ``alpha * KD + (1 - alpha) * CE + coef * aux`` of what the step logged."""
    args = DistillationConfig(output_dir=str(tmp_path), router_aux_loss_coef=COEF, lmbda=1.0, max_new_tokens=6,
                              **tiny_run_settings(max_steps=2, per_device_train_batch_size=2, alpha=0.5))
    trainer = DistillationTrainer(build(tokenizer, "mixtral", 1), build(tokenizer, "mixtral", 0), args=args,
                                  train_dataset=synthetic_prompt_completion(4, seed=3), processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "kd_loss" in h]
    assert len(logs) == 2 and all(h["on_policy_fraction"] == 1.0 and h["aux_loss"] > 0 for h in logs)
    for h in logs:
        assert h["loss"] == pytest.approx(0.5 * h["kd_loss"] + 0.5 * h["ce_loss"] + COEF * h["aux_loss"], rel=1e-5)


def test_the_router_loss_under_sequence_parallelism_is_refused(tokenizer):
    """Each rank would balance its own shard of the positions: one line naming both fixes (a student whose forward
    computes a router loss, or not, is judged first)."""
    from trl_distill.runtime.validation import check_router_aux_loss

    split = 2  # the run's sequence-parallel size (`RunPlan.parallelism`)
    student = build(tokenizer, "mixtral", 1)
    with pytest.raises(ValueError, match="under sequence parallelism is not supported.*router_aux_loss_coef=0.0"):
        check_router_aux_loss(student, True, split)
    check_router_aux_loss(student, False, split)  # the router loss off: nothing to refuse
    check_router_aux_loss(student, True, 1)
