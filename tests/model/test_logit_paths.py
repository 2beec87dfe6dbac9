"""Exact logits for any causal LM: each model's fused path is checked against its own `forward(...).logits` on the
first batch, a model whose head the fused path does not rebuild takes the exact path, and the logged `kd_loss` /
`ce_loss` equal values computed from `model(...).logits` either way."""

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    DoryConfig,
    HyperCLOVAXConfig,
    Llama4TextConfig,
    LlamaConfig,
    ModernBertDecoderConfig,
    RecurrentGemmaConfig,
)

from trl_distill import DistillationConfig, DistillationTrainer, divergence
from trl_distill.model.precision import cpu_supports_bf16
from trl_distill.testing import build_tokenizer, synthetic_prompt_completion, tiny_run_settings

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

# (config class, kwargs, which path the fused-path check must choose, what makes its logits special)
ARCHITECTURES = {
    "llama_untied": (LlamaConfig, dict(SMALL, tie_word_embeddings=False), "fused", "plain linear head"),
    "llama_tied": (LlamaConfig, dict(SMALL, tie_word_embeddings=True), "fused", "head tied to the embeddings"),
    "llama4_text": (Llama4TextConfig, dict(SMALL, intermediate_size_mlp=64, head_dim=8, num_local_experts=2,
                                           num_experts_per_tok=1, attention_chunk_size=8, router_aux_loss_coef=0.0),
                    "fused", "backbone at .model, not at base_model"),
    "hyperclovax": (HyperCLOVAXConfig, dict(SMALL, logits_scaling=4.0), "exact",
                    "logits_scaling multiplies (Granite's divides)"),
    "recurrent_gemma": (RecurrentGemmaConfig, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                   num_attention_heads=4, num_key_value_heads=1, lru_width=32,
                                                   attention_window_size=16, logits_soft_cap=0.5,
                                                   block_types=["recurrent", "recurrent", "attention"]),
                        "exact", "softcap named logits_soft_cap"),
    "dory": (DoryConfig, dict(SMALL, num_hidden_layers=3, n_input_layers=1, n_output_layers=1, n_recurrent_loops=2,
                              head_dim=8, sliding_window=8), "exact", "learned per-token scale in the head module"),
    "modernbert_decoder": (ModernBertDecoderConfig, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4, local_attention=8), "exact",
                           "prediction head (dense, activation, norm) before the decoder"),
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def build(tokenizer, name: str, seed: int):
    config_cls, kwargs, _, _ = ARCHITECTURES[name]
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    config = config_cls(vocab_size=len(tokenizer), **ids, **kwargs)
    for key, value in config.to_dict().items():  # deterministic forwards: train mode == eval mode
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if name == "dory":  # the head's learned scale starts at 1: make it matter
        model.lm_head.logit_scale.data.uniform_(0.0, 4.0 * config.initializer_range)
    return model.eval()


@torch.no_grad()
def reference(student, teacher, batch, loss_type: str, temperature: float) -> tuple[float, float]:
    """KD (times T²) and CE over the batch's completion tokens, from each model's own logits."""
    target = batch["labels"][:, 1:]
    mask = target != -100
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    s = student(**inputs).logits[:, :-1][mask]
    t = teacher(**inputs).logits[:, :-1][mask]
    kd = divergence(s, t, loss_type, temperature=temperature).item() * temperature**2
    return kd, F.cross_entropy(s, target[mask]).item()


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_logged_losses_equal_the_models_own_logits(name, tokenizer, tmp_path, caplog):
    expected_path = ARCHITECTURES[name][2]
    teacher, student = build(tokenizer, name, 0), build(tokenizer, name, 1)
    data = synthetic_prompt_completion(6, seed=3)
    loss_type = "reverse_kl" if expected_path == "exact" else "forward_kl"  # autograd and closed-form gradients
    args = DistillationConfig(output_dir=str(tmp_path), **tiny_run_settings(
        max_steps=1, per_device_train_batch_size=len(data), divergence=loss_type, alpha=0.5, temperature=2.0))
    trainer = DistillationTrainer(student, teacher, args=args, train_dataset=data, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(data))])  # step 1 sees every row
    kd, ce = reference(student, teacher, batch, loss_type, 2.0)
    with caplog.at_level(logging.INFO, logger="trl_distill"):
        trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["kd_loss"] == pytest.approx(kd, rel=1e-4) and logged["ce_loss"] == pytest.approx(ce, rel=1e-4)
    paths = {p.name: p for p in trainer.logit_paths}
    assert {n: "exact" if p.exact else "fused" for n, p in paths.items()} == {"student": expected_path,
                                                                              "teacher": expected_path}
    said = caplog.text  # rank 0's start-up lines, through the `trl_distill` logger
    assert said.count(f"logits: {expected_path}") == 2, said
    if expected_path == "fused":
        assert paths["teacher"].max_error <= paths["teacher"].tolerance


def test_a_fused_teacher_beside_an_exact_student(tokenizer, tmp_path):
    """The two sides take their paths independently; jsd exercises the autograd gradient of both heads' terms."""
    teacher, student = build(tokenizer, "llama_untied", 0), build(tokenizer, "dory", 1)
    data = synthetic_prompt_completion(5, seed=4)
    args = DistillationConfig(output_dir=str(tmp_path), **tiny_run_settings(
        max_steps=2, per_device_train_batch_size=len(data), divergence="jsd", alpha=0.3, temperature=1.0))
    trainer = DistillationTrainer(student, teacher, args=args, train_dataset=data, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(data))])
    kd, ce = reference(student, teacher, batch, "jsd", 1.0)
    before = student.lm_head.logit_scale.detach().clone()
    trainer.train()
    assert [p.exact for p in trainer.logit_paths] == [True, False]
    assert trainer.state.log_history[0]["kd_loss"] == pytest.approx(kd, rel=1e-4)
    assert trainer.state.log_history[0]["ce_loss"] == pytest.approx(ce, rel=1e-4)
    assert not torch.equal(student.lm_head.logit_scale, before)  # the exact path trains the head's own scale


@pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16")
def test_bf16_autocast_keeps_a_softcapped_model_on_the_fused_path(tokenizer, tmp_path):
    """Under mixed precision the model's own softcap runs on bf16 logits: the check allows bf16 rounding, so a model
    the fused path rebuilds (Gemma-2: final_logit_softcapping) keeps it."""
    from transformers import Gemma2Config

    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        config = Gemma2Config(vocab_size=len(tokenizer), head_dim=8, final_logit_softcapping=2.0,
                              attention_dropout=0.0, **ids, **SMALL)
        models.append(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    data = synthetic_prompt_completion(4, seed=6)
    args = DistillationConfig(output_dir=str(tmp_path), **tiny_run_settings(
        max_steps=1, per_device_train_batch_size=len(data), bf16=True))
    trainer = DistillationTrainer(models[1], models[0], args=args, train_dataset=data, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(data))])
    kd, ce = reference(models[1], models[0], batch, "forward_kl", args.temperature)
    trainer.train()
    assert [p.exact for p in trainer.logit_paths] == [False, False]
    assert trainer.state.log_history[0]["ce_loss"] == pytest.approx(ce, rel=2e-2)
    assert trainer.state.log_history[0]["kd_loss"] == pytest.approx(kd, rel=5e-2, abs=1e-3)
