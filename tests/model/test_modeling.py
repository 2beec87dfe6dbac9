"""What the loss reads from a model: last hidden states through the patched forward, the lm_head and its
logit transform (bias, logit scale, final-logit softcapping)."""

import contextlib

import torch
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, LlamaConfig

from trl_distill.model.fused_forward import LMHead, add_fused_distillation_forward, gathered, hidden_size
from trl_distill.testing import build_tiny_model, build_tokenizer


def tiny(config_cls, **kwargs):
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_cls(**{**base, **kwargs}))


def test_fused_forward_returns_what_the_loss_callable_returns():
    model = build_tiny_model(build_tokenizer(), "student").eval()
    add_fused_distillation_forward(model)
    add_fused_distillation_forward(model)  # patching twice is a no-op
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(ids).logits  # unchanged without the keyword
        features = model(ids, labels=ids, fused_distillation=lambda f: f)
        assert torch.allclose(features.states @ features.head.weight.T, logits, atol=1e-6)
        kept = model(ids, fused_distillation=lambda f: f, loss_positions=torch.tensor([1, 3]))
        assert torch.equal(kept.states, features.states[:, [1, 3]])


def test_lm_head_transforms_read_from_the_config():
    llama = LMHead.of(tiny(LlamaConfig))
    assert llama.bias is None and llama.logit_scale is None and llama.softcap is None
    gemma = LMHead.of(tiny(Gemma2Config, final_logit_softcapping=30.0))
    assert gemma.softcap == 30.0
    cohere = LMHead.of(tiny(CohereConfig, logit_scale=0.0625))
    assert cohere.logit_scale == 0.0625


def test_lm_head_transform_reproduces_the_model_logits():
    """Gemma2 softcaps, Cohere scales: our projection + transform equals the model's own logits."""
    for model in (tiny(Gemma2Config, final_logit_softcapping=5.0), tiny(CohereConfig, logit_scale=0.5)):
        model.eval()
        add_fused_distillation_forward(model)
        ids = torch.tensor([[3, 9, 27, 41]])
        head = LMHead.of(model)
        with torch.no_grad():
            logits = model(ids).logits
            z = model(ids, fused_distillation=lambda f: f.states) @ head.weight.T
            if head.logit_scale is not None:
                z = z * head.logit_scale
            if head.softcap is not None:
                z = head.softcap * torch.tanh(z / head.softcap)
        assert torch.allclose(z, logits, atol=1e-5), type(model).__name__


def test_gathered_gathers_only_partitioned_parameters():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    plain = torch.nn.Parameter(torch.randn(4, 3))
    available = torch.nn.Parameter(torch.randn(4, 3))
    available.ds_id, available.ds_status = 1, ZeroParamStatus.AVAILABLE  # a ZeRO-3 parameter already gathered
    assert isinstance(gathered(plain, None, available), contextlib.nullcontext)
    partitioned = torch.nn.Parameter(torch.empty(0))
    partitioned.ds_id, partitioned.ds_status = 2, ZeroParamStatus.NOT_AVAILABLE
    context = gathered(plain, partitioned, partitioned)
    assert type(context).__name__ == "GatheredParameters" and context.params == [partitioned]  # once, alone


def test_hidden_size():
    assert hidden_size(LlamaConfig(hidden_size=48, num_attention_heads=4)) == 48
