"""The GPU run's loss rows: one forward + backward of the KD loss from hidden states and lm_head weights, ours
(`trl_distill.loss.fused.chunked_divergence`), the naive full-logits loss (`trl_distill.loss.divergences.divergence`)
and Liger's `LigerFusedLinearJSD` at ``jsd_beta=0`` (its forward KL) and 1 (reverse KL), called through
`trl_distill.compat.liger_fused_linear_jsd` (pinned to liger-kernel 0.8.5's signature). Each method at each size is a
row: any exception in it (a kernel's signature, an out-of-memory, a shape limit) fails that row with its traceback's
last lines, and the others still run."""

from __future__ import annotations

import signal
import statistics
import time
import traceback

MIB = 1 << 20
TAIL_LINES = 40
KINDS = ("forward_kl", "reverse_kl")
# Our loss at other chunk sizes than its default (2^25 fp32 logits a chunk: 262 rows at V = 128k), forward KL only:
# what the first GPU run measures to choose one (issue 55: <= 1.1x the naive loss's time at <= 0.15x its memory)
CHUNK_ROWS = (1024, 4096)
METHODS = (*(f"{name}_{kind}" for name in ("ours", "naive", "liger") for kind in KINDS),
           *(f"ourschunk{rows}_forward_kl" for rows in CHUNK_ROWS))


def loss_methods(selected: list[str]) -> tuple[dict, dict, str | None]:
    """``(methods, failed, liger_skipped)``: name -> function of (hs, ws, ht, wt) -> scalar loss for the `selected`
    methods that can run here, name -> the error of those that fail to build, and why Liger is skipped (no GPU)."""
    import torch

    from trl_distill import compat
    from trl_distill.loss.divergences import divergence
    from trl_distill.loss.fused import chunked_divergence

    def ours(kind, chunk_size=None):
        return lambda hs, ws, ht, wt: chunked_divergence(hs, ws, ht, wt, None, kind, temperature=1.0,
                                                         chunk_size=chunk_size)

    def naive(kind):
        return lambda hs, ws, ht, wt: divergence(hs @ ws.T, ht @ wt.T, kind, temperature=1.0)

    def liger(kind):
        return compat.liger_fused_linear_jsd(jsd_beta={"forward_kl": 0.0, "reverse_kl": 1.0}[kind])

    makers = {"ours": ours, "naive": naive, "liger": liger}
    liger_skipped = None
    if not torch.cuda.is_available():
        liger_skipped = "Liger's kernels are Triton: they need a GPU"
    methods, failed = {}, {}
    for name in selected:
        maker, kind = name.split("_", 1)
        if maker == "liger" and liger_skipped:
            continue
        try:
            if maker.startswith("ourschunk"):
                methods[name] = ours(kind, int(maker[len("ourschunk"):]))
                continue
            methods[name] = makers[maker](kind)
        except Exception:  # noqa: BLE001 - liger-kernel missing or of another signature: that row fails, not the run
            failed[name] = failure()
    return methods, failed, liger_skipped


def bench_loss(cfg: dict, selected: list[str], report) -> dict:
    """Every `selected` method at every size of `cfg`; `report(row, result)` is called as each row ends."""
    import torch

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda" if cuda else "cpu"), getattr(torch, cfg["dtype"])
    wanted = list(dict.fromkeys(selected + [f"naive_{name.split('_', 1)[1]}" for name in selected]))  # references
    methods, failed, liger_skipped = loss_methods(wanted)
    results = []
    for n in cfg["tokens"]:
        g = torch.Generator(device=device).manual_seed(0)
        v, h_s, h_t = cfg["vocab_size"], cfg["student_hidden"], cfg["teacher_hidden"]
        ws = (torch.randn(v, h_s, generator=g, device=device) * h_s**-0.5).to(dtype).requires_grad_()
        wt = (torch.randn(v, h_t, generator=g, device=device) * h_t**-0.5).to(dtype)
        hs0 = torch.randn(n, h_s, generator=g, device=device).to(dtype)
        ht = torch.randn(n, h_t, generator=g, device=device).to(dtype)
        for name in wanted:
            if name in failed:
                result = {"method": name, "tokens": n, **failed[name]}
            elif name in methods:
                result = {"method": name, "tokens": n, **_time_one(methods[name], hs0, ws, ht, wt, cfg, cuda)}
            else:
                continue  # Liger without a GPU
            results.append(result)
            report(f"{name}@{n}", result)
        del ws, wt, hs0, ht
    for row in results:  # each loss value against the naive loss of the same divergence and shape
        exact = next((r for r in results if r["tokens"] == row["tokens"]
                      and r["method"] == "naive_" + row["method"].split("_", 1)[1]), {})  # fmt: skip
        if "loss" in row and "loss" in exact:
            row["loss_vs_naive"] = abs(row["loss"] - exact["loss"]) / max(abs(exact["loss"]), 1e-12)
    return {"config": cfg, "results": results, "liger_skipped": liger_skipped}


def _past_timeout(signum, frame):
    raise TimeoutError("the loss row ran past its timeout (the loss config's timeout_s)")


def _time_one(fn, hs0, ws, ht, wt, cfg: dict, cuda: bool) -> dict:
    """One method at one size, stopped by SIGALRM after ``cfg["timeout_s"]`` (between Python calls: a hung kernel
    cannot be interrupted, a slow loop can)."""
    import torch

    times, loss, started = [], None, time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _past_timeout)
    signal.setitimer(signal.ITIMER_REAL, cfg["timeout_s"])
    try:
        for i in range(cfg["warmup"] + cfg["repeats"]):
            hs = hs0.clone().requires_grad_()
            ws.grad = None
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            value = fn(hs, ws, ht, wt)
            value.backward()
            if cuda:
                torch.cuda.synchronize()
            if i >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
            loss = float(value.detach())
        extra = (torch.cuda.max_memory_allocated() - base) / MIB if cuda else None
    except Exception:  # noqa: BLE001 - any failure of a method is its row's, with its traceback
        return {**failure(), "wall_s": time.perf_counter() - started}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if cuda:
            torch.cuda.empty_cache()
    return {"ms": statistics.median(times) * 1e3, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3,
            "extra_peak_gpu_mib": extra, "loss": loss, "wall_s": time.perf_counter() - started}  # fmt: skip


def failure() -> dict:
    """The exception being handled as a failed row: ``error`` its last line, ``tail`` its traceback's last lines."""
    lines = traceback.format_exc().rstrip().splitlines()
    return {"error": lines[-1], "tail": "\n".join(lines[-TAIL_LINES:])}
