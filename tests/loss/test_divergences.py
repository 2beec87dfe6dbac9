"""trl_distill.loss.divergences: the six formulas against float64 references, TRL's GKD oracle, gradcheck."""

from __future__ import annotations

import os

import pytest
import torch

from trl_distill.loss.divergences import LOSS_TYPES, divergence, per_token_divergence

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl is imported lazily in the oracle test

BETA, ALPHA, TEMP = 0.3, 0.25, 2.0


# ----------------------------------------------------------------------------------------------------------
# From-scratch float64 references (plain probabilities, no log-space tricks)
# ----------------------------------------------------------------------------------------------------------
def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * (a.log() - b.log())).sum(-1)


def reference_per_token(s_logits, t_logits, loss_type, beta=BETA, alpha=ALPHA, temperature=TEMP):
    p = torch.softmax(t_logits.double() / temperature, -1)
    q = torch.softmax(s_logits.double() / temperature, -1)
    if loss_type == "forward_kl" or (loss_type == "jsd" and beta == 0):
        return _kl(p, q)
    if loss_type == "reverse_kl" or (loss_type == "jsd" and beta == 1):
        return _kl(q, p)
    if loss_type == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * _kl(p, m) + (1 - beta) * _kl(q, m)
    if loss_type == "skew_forward_kl":
        return _kl(p, alpha * p + (1 - alpha) * q)
    if loss_type == "skew_reverse_kl":
        return _kl(q, (1 - alpha) * p + alpha * q)
    assert loss_type == "tvd"
    return 0.5 * (p - q).abs().sum(-1)


def reference_loss(s_logits, t_logits, loss_type, mask, num_items=None, **kw):
    per_tok = reference_per_token(s_logits, t_logits, loss_type, **kw)[mask]
    return per_tok.sum() / (num_items if num_items is not None else mask.sum())


def _logits(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype), (torch.randn(*shape, generator=g) * 3).to(dtype)


def _mask(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(*shape, generator=g) > 0.35
    m.view(-1)[0] = True
    return m


# ----------------------------------------------------------------------------------------------------------
# divergence: formulas, TRL oracle, gradcheck
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_items", [None, 37])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_divergence_matches_formula(loss_type, num_items):
    s, t = _logits(3, 7, 50)
    mask = _mask(3, 7)
    kw = {
        "beta": BETA,
        "skew_alpha": ALPHA,
        "temperature": TEMP,
        "mask": mask,
        "num_items_in_batch": num_items,
    }
    got = divergence(s, t, loss_type, **kw)
    ref = reference_loss(s, t, loss_type, mask, num_items)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    # float32 inputs: computed in fp32, still close
    got32 = divergence(s.float(), t.float(), loss_type, **kw)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.9])
def test_jsd_betas_match_formula(beta):
    s, t = _logits(2, 5, 20, seed=3)
    mask = _mask(2, 5)
    got = divergence(s, t, "jsd", beta=beta, temperature=TEMP, mask=mask)
    torch.testing.assert_close(got, reference_loss(s, t, "jsd", mask, beta=beta), rtol=0, atol=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 0.6])
def test_skew_alpha_endpoints(alpha):
    s, t = _logits(4, 30, seed=4)
    mask = torch.ones(4, dtype=torch.bool)
    for lt in ("skew_forward_kl", "skew_reverse_kl"):
        got = divergence(s, t, lt, skew_alpha=alpha, temperature=TEMP, mask=mask)
        torch.testing.assert_close(got, reference_loss(s, t, lt, mask, alpha=alpha), rtol=0, atol=1e-6)
    # alpha == 0 reduces to plain forward / reverse KL
    if alpha == 0.0:
        kw = {"skew_alpha": 0.0, "temperature": TEMP}
        torch.testing.assert_close(
            divergence(s, t, "skew_forward_kl", **kw), divergence(s, t, "forward_kl", **kw)
        )
        torch.testing.assert_close(
            divergence(s, t, "skew_reverse_kl", **kw), divergence(s, t, "reverse_kl", **kw)
        )


def test_per_token_shapes():
    s, t = _logits(6, 11)
    for lt in LOSS_TYPES:
        out = per_token_divergence(s.log_softmax(-1), t.log_softmax(-1), lt)
        assert out.shape == (6,)
        assert (out >= -1e-12).all()


@pytest.mark.parametrize("num_items", [None, 23])
@pytest.mark.parametrize(("loss_type", "beta"), [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.5)])
def test_matches_trl_generalized_jsd(loss_type, beta, num_items):
    from trl.experimental.gkd import GKDTrainer

    s, t = _logits(3, 6, 40, dtype=torch.float32, seed=5)
    labels = torch.randint(0, 40, (3, 6), generator=torch.Generator().manual_seed(6))
    labels[0, :2] = -100
    labels[2, 4:] = -100
    trl = GKDTrainer.generalized_jsd_loss(
        s, t, labels=labels, beta=beta, temperature=TEMP, num_items_in_batch=num_items
    )
    got = divergence(
        s, t, loss_type, beta=beta, temperature=TEMP, mask=labels != -100, num_items_in_batch=num_items
    )
    torch.testing.assert_close(got, trl, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_divergence_gradcheck(loss_type):
    s, t = _logits(2, 3, 6, seed=7)
    s.requires_grad_(True)
    t.requires_grad_(True)
    mask = _mask(2, 3)

    def fn(s_, t_):
        return divergence(s_, t_, loss_type, beta=BETA, skew_alpha=ALPHA, temperature=TEMP, mask=mask)

    assert torch.autograd.gradcheck(fn, (s, t))
