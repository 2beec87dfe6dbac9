"""trl_distill.loss.fused: the chunked fused loss equals the unchunked one (values, gradients), memory, edge cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_divergences import ALPHA, BETA, TEMP, _logits, _mask  # the shared references (tests/ is on sys.path)
from torch.utils._python_dispatch import TorchDispatchMode

from trl_distill.loss.chunk_pass import forward_kl_closed_form
from trl_distill.loss.divergences import LOSS_TYPES, divergence, per_token_divergence
from trl_distill.loss.fused import DistillationLossOutput, chunked_distillation_loss, chunked_divergence
from trl_distill.loss.workspace import Workspace

# ----------------------------------------------------------------------------------------------------------
# Chunked fused path
# ----------------------------------------------------------------------------------------------------------
B, T, H_S, H_T, V_S, V_T, VOCAB = 2, 5, 6, 8, 12, 14, 11  # padded vocab: V_T > V_S > VOCAB


def _setup(dtype=torch.float32, seed=0, weight_grad=True):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return {
        "hs": r(B, T, H_S).requires_grad_(True),
        "ws": r(V_S, H_S, scale=0.8).requires_grad_(weight_grad),
        "bs": r(V_S, scale=0.5).requires_grad_(weight_grad),
        "ht": r(B, T, H_T),
        "wt": r(V_T, H_T, scale=0.8),
        "bt": r(V_T, scale=0.5),
        "mask": _mask(B, T),
        "labels": torch.randint(0, V_S, (B, T), generator=g),
    }


def _finalise(logits, scale, softcap):
    logits = logits * scale
    return softcap * torch.tanh(logits / softcap)


CAPS = {
    "student_logit_scale": 1.3,
    "teacher_logit_scale": 0.7,
    "student_softcap": 5.0,
    "teacher_softcap": 6.0,
}


def _unchunked(d, loss_type, num_items=None, **kw):
    s_logits = _finalise(d["hs"] @ d["ws"].T + d["bs"], CAPS["student_logit_scale"], CAPS["student_softcap"])
    with torch.no_grad():
        t_logits = _finalise(
            d["ht"] @ d["wt"].T + d["bt"], CAPS["teacher_logit_scale"], CAPS["teacher_softcap"]
        )
    kd = divergence(
        s_logits[..., :VOCAB],
        t_logits[..., :VOCAB],
        loss_type,
        mask=d["mask"],
        num_items_in_batch=num_items,
        **kw,
    )
    ce_sum = F.cross_entropy(s_logits[d["mask"]], d["labels"][d["mask"]], reduction="sum")
    ce = ce_sum / (num_items if num_items is not None else d["mask"].sum())
    return kd, ce


def _chunked(d, loss_type, **kw) -> DistillationLossOutput:
    return chunked_distillation_loss(
        d["hs"], d["ws"], d["ht"], d["wt"], d["mask"], loss_type, labels=d["labels"],
        student_lm_head_bias=d["bs"], teacher_lm_head_bias=d["bt"], vocab_size=VOCAB, **CAPS, **kw,
    )  # fmt: skip


def _grads(loss, d):
    return torch.autograd.grad(loss, [d["hs"], d["ws"], d["bs"]])


@pytest.mark.parametrize("chunk_size", [1, 3, 1000, None])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_chunked_matches_unchunked(loss_type, chunk_size):
    d = _setup()
    kw = {"beta": BETA, "skew_alpha": ALPHA, "temperature": TEMP}
    for num_items in (None, 17):
        for a, b in ((1.0, 0.0), (0.0, 1.0), (0.7, 0.3)):  # kd-only, ce-only and a mix all back-propagate
            out = _chunked(d, loss_type, chunk_size=chunk_size, num_items_in_batch=num_items, **kw)
            kd_ref, ce_ref = _unchunked(d, loss_type, num_items, **kw)
            torch.testing.assert_close(out.kd, kd_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.ce, ce_ref, rtol=1e-5, atol=1e-5)
            loss = out.kd if b == 0 else out.ce if a == 0 else a * out.kd + b * out.ce
            for x, y in zip(_grads(loss, d), _grads(a * kd_ref + b * ce_ref, d), strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_ce_matches_torch_cross_entropy_full_vocab():
    d = _setup(seed=3)
    hs, ws, mask, labels = d["hs"], d["ws"], d["mask"], d["labels"]
    labels[0, 0] = V_S - 1  # a label beyond vocab_size: CE uses the full student vocabulary
    out = chunked_distillation_loss(
        hs, ws, d["ht"], d["wt"], mask, labels=labels, chunk_size=2, vocab_size=VOCAB
    )
    ref = F.cross_entropy((hs @ ws.T)[mask], labels[mask])
    torch.testing.assert_close(out.ce, ref, rtol=1e-5, atol=1e-6)


def test_chunked_2d_no_mask_and_divergence_wrapper():
    d = _setup(seed=4)
    hs, ht = d["hs"].detach().reshape(-1, H_S).requires_grad_(True), d["ht"].reshape(-1, H_T)
    kd = chunked_divergence(hs, d["ws"], ht, d["wt"], None, "tvd", chunk_size=4, temperature=TEMP)
    ref = divergence(hs @ d["ws"].T, (ht @ d["wt"].T[:, :V_S]), "tvd", temperature=TEMP)
    torch.testing.assert_close(kd, ref, rtol=1e-5, atol=1e-6)
    out = chunked_distillation_loss(hs, d["ws"], ht, d["wt"], loss_type="tvd", chunk_size=4, temperature=TEMP)
    assert out.ce is None
    torch.testing.assert_close(out.kd, kd)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_chunked_gradcheck(loss_type):
    d = _setup(dtype=torch.float64, seed=5)
    kw = {"beta": BETA, "skew_alpha": ALPHA, "temperature": TEMP, "chunk_size": 3, "num_items_in_batch": 9}

    def fn(hs, ws, bs):
        out = chunked_distillation_loss(
            hs, ws, d["ht"], d["wt"], d["mask"], loss_type, labels=d["labels"], student_lm_head_bias=bs,
            teacher_lm_head_bias=d["bt"], vocab_size=VOCAB, **CAPS, **kw,
        )  # fmt: skip
        return out.kd, out.ce

    assert torch.autograd.gradcheck(fn, (d["hs"], d["ws"], d["bs"]))
    # frozen weight: only the hidden states are differentiable
    ws = d["ws"].detach()
    assert torch.autograd.gradcheck(lambda hs: fn(hs, ws, None)[0], (d["hs"],))


@pytest.mark.parametrize("temperature", [1.0, TEMP])
def testforward_kl_closed_form_gradient_equals_autograd(temperature):
    s, t = _logits(6, 40)  # float64
    s.requires_grad_(True)
    t_logp = F.log_softmax(t / temperature, -1)
    ref = per_token_divergence(F.log_softmax(s / temperature, -1), t_logp, "forward_kl").sum()
    (g_ref,) = torch.autograd.grad(ref, s)
    kd, g, none = forward_kl_closed_form(s.detach(), t_logp.clone(), temperature)
    torch.testing.assert_close(kd, ref.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-6)
    assert none is None
    # With labels (and reused buffers): the same, and log q at the labels (the CE's terms at T = 1)
    labels = torch.tensor([0, 5, 39, 7, 7, 1])
    kd2, g2, log_q = forward_kl_closed_form(s.detach(), t_logp.clone(), temperature, None, Workspace(), labels)
    torch.testing.assert_close((kd2, g2), (kd, g), rtol=0, atol=0)
    expected = F.log_softmax(s.detach() / temperature, -1)[torch.arange(6), labels]
    torch.testing.assert_close(log_q, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, TEMP])
def test_chunked_forward_kl_plain_head_equals_autograd(temperature):
    """The closed-form path without bias/scale/softcap/CE/vocab padding: grads equal autograd's in float64."""
    d = _setup(dtype=torch.float64, seed=7)
    hs, ws, ht, wt, mask = d["hs"], d["ws"], d["ht"], d["wt"][:V_S], d["mask"]
    ref = divergence(hs @ ws.T, ht @ wt.T, "forward_kl", temperature=temperature, mask=mask)
    ref_grads = torch.autograd.grad(ref, [hs, ws])
    for chunk_size in (1, 4, None):
        kd = chunked_divergence(hs, ws, ht, wt, mask, "forward_kl", temperature=temperature, chunk_size=chunk_size)
        torch.testing.assert_close(kd, ref, rtol=0, atol=1e-6)
        for x, y in zip(torch.autograd.grad(kd, [hs, ws]), ref_grads, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


class _ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor produced by an aten op."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.shapes.add(tuple(o.shape))
        return out


@pytest.mark.parametrize("weight_grad", [False, True])
def test_frozen_student_weight_allocates_no_weight_buffer(weight_grad):
    d = _setup(weight_grad=weight_grad)
    saved: list[tuple[int, ...]] = []

    def pack(x):
        saved.append(tuple(x.shape))
        return x

    with _ShapeRecorder() as rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = _chunked(d, "jsd", chunk_size=3)
        (0.5 * out.kd + 0.5 * out.ce).backward()
    assert d["hs"].grad is not None and torch.isfinite(d["hs"].grad).all()
    if weight_grad:  # control: the detector does see the [V, H] buffer when one is needed
        assert (V_S, H_S) in rec.shapes and (V_S, H_S) in saved
        assert d["ws"].grad is not None and d["bs"].grad is not None
    else:
        assert d["ws"].grad is None and d["bs"].grad is None
        assert (V_S, H_S) not in rec.shapes and (V_S,) not in rec.shapes  # no weight/bias grad buffers
        assert (V_S, H_S) not in saved


def test_no_grad_mode_skips_gradient_work():
    d = _setup()
    ref = _chunked(d, "skew_forward_kl", chunk_size=3)
    with torch.no_grad(), _ShapeRecorder() as rec:
        out = _chunked(d, "skew_forward_kl", chunk_size=3)
    assert not out.kd.requires_grad and not out.ce.requires_grad
    assert (V_S, H_S) not in rec.shapes  # no weight-grad buffer although ws.requires_grad
    torch.testing.assert_close(out.kd, ref.kd.detach())
    torch.testing.assert_close(out.ce, ref.ce.detach())


def test_teacher_never_gets_grads():
    d = _setup()
    for k in ("ht", "wt", "bt"):
        d[k].requires_grad_(True)
    out = _chunked(d, "forward_kl", chunk_size=4)
    (out.kd + out.ce).backward()
    assert d["ht"].grad is None and d["wt"].grad is None and d["bt"].grad is None
    assert d["hs"].grad is not None


def test_bf16_close_to_fp32():
    d32 = _setup(seed=6)
    d16 = {
        k: (v.detach().bfloat16().requires_grad_(v.requires_grad) if v.is_floating_point() else v)
        for k, v in d32.items()
    }
    for loss_type in LOSS_TYPES:
        out16 = _chunked(d16, loss_type, chunk_size=3, temperature=TEMP)
        out32 = _chunked(d32, loss_type, chunk_size=3, temperature=TEMP)
        assert out16.kd.dtype == torch.float32 and torch.isfinite(out16.kd) and torch.isfinite(out16.ce)
        # Measured (seed 6, all six divergences): |kd16 - kd32| <= 4.8e-4 (kd 0.18..0.88), |ce16 - ce32| = 1.2e-3
        # (ce 4.23), max |grad16 - grad32| = 2.5e-3 (skew_forward_kl's ws; gradients up to 0.41). Tolerances ~2.5x.
        torch.testing.assert_close(out16.kd, out32.kd, rtol=0, atol=1.2e-3)
        torch.testing.assert_close(out16.ce, out32.ce, rtol=0, atol=3e-3)
        g16, g32 = _grads(out16.kd + out16.ce, d16), _grads(out32.kd + out32.ce, d32)
        for x, y in zip(g16, g32, strict=True):
            assert x.dtype == torch.bfloat16 and torch.isfinite(x).all()
            torch.testing.assert_close(x.float(), y, rtol=0, atol=6e-3)
    # plain divergence on bf16 logits computes in fp32
    s, t = _logits(4, 9, dtype=torch.bfloat16)
    assert divergence(s, t, "jsd").dtype == torch.float32


@pytest.mark.parametrize("num_items", [None, 0, 5, torch.tensor(5)])
def test_fully_masked(num_items):
    s, t = _logits(2, 3, 7)
    s.requires_grad_(True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for lt in LOSS_TYPES:
        loss = divergence(s, t, lt, mask=mask, num_items_in_batch=num_items)
        assert loss.item() == 0.0 and loss.requires_grad
        (g,) = torch.autograd.grad(loss, s)
        assert not g.isnan().any() and (g == 0).all()

    d = _setup()
    d["mask"] = torch.zeros(B, T, dtype=torch.bool)
    for lt in LOSS_TYPES:
        out = _chunked(d, lt, chunk_size=3, num_items_in_batch=num_items)
        assert out.kd.item() == 0.0 and out.ce.item() == 0.0 and out.kd.requires_grad
        for g in _grads(out.kd + out.ce, d):
            assert not g.isnan().any() and (g == 0).all()


def test_num_items_tensor_equals_int():
    s, t = _logits(2, 4, 9)
    mask = _mask(2, 4)
    a = divergence(s, t, "jsd", mask=mask, num_items_in_batch=torch.tensor(7))
    torch.testing.assert_close(a, divergence(s, t, "jsd", mask=mask, num_items_in_batch=7))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "kl"}, "valid choices are forward_kl, reverse_kl, jsd"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"temperature": -1.0}, "temperature must be > 0"),
        ({"beta": 1.5}, r"beta must be in \[0, 1\]"),
        ({"beta": -0.1}, r"beta must be in \[0, 1\]"),
        ({"skew_alpha": 2.0}, r"skew_alpha must be in \[0, 1\]"),
    ],
)
def test_bad_inputs(kwargs, match):
    s, t = _logits(2, 5)
    args = {"loss_type": "jsd", **kwargs}
    with pytest.raises(ValueError, match=match):
        divergence(s, t, args.pop("loss_type"), **args)
    d = _setup()
    with pytest.raises(ValueError, match=match):
        chunked_distillation_loss(d["hs"], d["ws"], d["ht"], d["wt"], **{"loss_type": "jsd", **kwargs})


def test_vocab_size_too_large():
    d = _setup()
    with pytest.raises(ValueError, match=rf"vocab_size={V_T}.*student vocab {V_S}.*teacher vocab {V_T}"):
        chunked_divergence(d["hs"], d["ws"], d["ht"], d["wt"], vocab_size=V_T)


@pytest.mark.parametrize("loss_type", ["forward_kl", "jsd"])
def test_a_term_without_gradient_is_logged_but_adds_no_gradient(loss_type):
    """alpha = 1 (ce_grad=False) or 0 (kd_grad=False): the term's value is unchanged, its gradient is left out."""
    d = _setup()
    both = _chunked(d, loss_type, chunk_size=3)
    kd_only, ce_only = _chunked(d, loss_type, chunk_size=3, ce_grad=False), _chunked(d, loss_type, chunk_size=3,
                                                                                      kd_grad=False)
    for out in (kd_only, ce_only):
        torch.testing.assert_close(out.kd, both.kd, rtol=0, atol=0)
        torch.testing.assert_close(out.ce, both.ce, rtol=0, atol=0)
    for weights, out in (((1.0, 0.0), kd_only), ((0.0, 1.0), ce_only)):
        expected = torch.autograd.grad(weights[0] * both.kd + weights[1] * both.ce, [d["hs"], d["ws"], d["bs"]],
                                       retain_graph=True)
        got = _grads(weights[0] * out.kd + weights[1] * out.ce, d)
        for x, y in zip(got, expected):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_ce_without_gradient_allocates_fewer_weight_sized_tensors():
    d = _setup()

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.n += sum(isinstance(o, torch.Tensor) and tuple(o.shape) == tuple(d["ws"].shape)
                          for o in (out if isinstance(out, (tuple, list)) else (out,)))
            return out

    with Count() as both:
        _chunked(d, "jsd", chunk_size=3)
    with Count() as kd_only:
        _chunked(d, "jsd", chunk_size=3, ce_grad=False)
    assert kd_only.n < both.n  # no CE weight-gradient buffer (nor its per-chunk updates)
