"""Peak extra memory and time of one forward+backward of the KD loss: chunked vs naive full-vocabulary logits.

    python benchmarks/loss_memory.py [--quick] [--out DIR]

Loss: ``forward_kl``, temperature 1, fp32, student and teacher with the same hidden size H (one shared ``V x H``
lm_head shape, separate random weights). Student hidden ``[N, H]`` and student lm_head weight require grad, the
teacher's do not (as in TRL's GKD).

* **naive**: ``s_logits = hs @ Ws.T`` and ``t_logits = ht @ Wt.T`` (full ``[N, V]`` logits, kept alive during the
  backward as a trainer holding the model outputs does), then :func:`trl_distill.loss.divergences.divergence`.
* **chunked**: :func:`trl_distill.loss.fused.chunked_divergence` with its default chunk size.

Every measurement runs in a fresh subprocess doing exactly one forward+backward (after a tiny warm-up on small
shapes, so library initialisation is not counted). Memory = peak RSS high-water mark (``getrusage`` ``ru_maxrss``)
after the step minus the same right after building the inputs (the high-water mark is reset to the current RSS
there through ``/proc/self/clear_refs`` when the kernel allows it). It includes the gradients (``Ws.grad`` is
``V x H`` fp32 in both methods). Time = wall time of that step. Naive and chunked subprocesses alternate
(order swapped every round); a time ratio is computed per (naive, chunked) pair of a round.

Naive cases whose estimated extra peak exceeds ``--max-est-gib`` (estimate: linear in N from the smaller measured
N, else 8 fp32 ``[N, V]`` tensors) are not run; they are extrapolated linearly in N from naive runs at smaller N
and marked as extrapolated everywhere. Each subprocess also caps its own address space (``RLIMIT_AS``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import machine  # benchmarks/_common.py and memory_probe.py (the script's folder)
from memory_probe import reset_peak_rss

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
GIB = 1 << 30
THREADS = 2
LOSS_TYPE = "forward_kl"


# ----------------------------------------------------------------------------------------------------------------
# Worker: one (method, V, N, H, mask) forward+backward in this (fresh) process
# ----------------------------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from trl_distill.loss.divergences import divergence
    from trl_distill.loss.fused import chunked_divergence

    def step(method: str, hs, ws, ht, wt, mask) -> float:
        if method == "naive":
            s_logits = hs @ ws.T
            t_logits = ht @ wt.T
            loss = divergence(s_logits, t_logits, LOSS_TYPE, temperature=1.0, mask=mask)
        else:
            loss = chunked_divergence(hs, ws, ht, wt, mask, LOSS_TYPE, temperature=1.0)
        loss.backward()
        return loss.item()

    def inputs(n: int, v: int, h: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        # In-place scaling: no transient copies, so the high-water mark right after this is the live size.
        hs = torch.randn(n, h, generator=g).requires_grad_()
        ws = torch.randn(v, h, generator=g).mul_(h**-0.5).requires_grad_()
        ht = torch.randn(n, h, generator=g)
        wt = torch.randn(v, h, generator=g).mul_(h**-0.5)
        # full: mask=None (= all True, without boolean-indexing copies of the naive logits); half: sequences of
        # 512 tokens, a 256-token prompt (no loss) then a 256-token completion.
        mask = torch.arange(n) % 512 >= 256 if spec["mask"] == "half" else None
        return hs, ws, ht, wt, mask

    step(spec["method"], *inputs(64, 512, 32))  # warm-up: thread pool, kernels
    n, v, h = spec["N"], spec["V"], spec["H"]
    tensors = inputs(n, v, h)
    resource.setrlimit(resource.RLIMIT_AS, (_status_kib("VmSize") * 1024 + spec["as_limit_gib"] * GIB, -1))
    reset_ok = reset_peak_rss()
    rss_before = _status_kib("VmRSS")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    loss = step(spec["method"], *tensors)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "loss": loss,
        "seconds": seconds,
        "extra_peak_mib": (peak - base) / 1024,
        "baseline_maxrss_mib": base / 1024,
        "baseline_rss_mib": rss_before / 1024,
        "peak_maxrss_mib": peak / 1024,
        "hwm_reset": reset_ok,
    }


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------
def run_worker(spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        err = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {proc.returncode}: {err}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _line(points: list[tuple[int, float]], x: int) -> float:
    """Least-squares line through ``points`` evaluated at ``x``."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((a - mx) * (b - my) for a, b in points) / sum((a - mx) ** 2 for a in xs)
    return my + slope * (x - mx)


def _summary(samples: list[dict]) -> dict:
    ok = [s for s in samples if "error" not in s]
    if not ok:
        return {"samples": samples}
    ms = [s["seconds"] * 1e3 for s in ok]
    mem = [s["extra_peak_mib"] for s in ok]
    return {
        "samples": samples,
        "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
        "peak_mib_median": statistics.median(mem), "peak_mib_min": min(mem), "peak_mib_max": max(mem),
        "loss": ok[0]["loss"],
    }  # fmt: skip


def plan(quick: bool) -> dict:
    """``repeats``: rounds for the small-N full-mask rows (the time goal); ``repeats_other``: rounds for the rest
    (50%-mask rows, large N, extrapolation runs), 1 by default to fit the runtime budget on 2 cores."""
    if quick:
        return {"V": [4096, 16384], "N": [256, 1024], "H": [256], "half_N": 256, "extrap_N": [256, 512],
                "repeats": 3, "repeats_other": 1, "max_est_gib": 0.4}  # fmt: skip
    return {"V": [32768, 131072], "N": [1024, 8192], "H": [1024, 2048], "half_N": 1024,
            "extrap_N": [1024, 2048, 4096], "repeats": 3, "repeats_other": 1, "max_est_gib": 16.0}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke configuration (< 1 minute)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="output directory")
    ap.add_argument("--max-est-gib", type=float, help="skip naive runs estimated above this (default 16)")
    ap.add_argument("--repeats", type=int, help="rounds for the small-N full-mask rows (default 3)")
    ap.add_argument("--repeats-other", type=int, help="rounds for all other rows and extrapolation runs (default 1)")
    ap.add_argument("--as-limit-gib", type=int, default=18, help="address-space cap per worker above its inputs")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    t_start = time.perf_counter()
    cfg = plan(args.quick)
    for key in ("max_est_gib", "repeats", "repeats_other"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    max_est = cfg["max_est_gib"] * GIB
    cases = [(v, n, h, "full") for v in cfg["V"] for n in cfg["N"] for h in cfg["H"]]
    cases += [(v, cfg["half_N"], h, "half") for v in cfg["V"] for h in cfg["H"]]
    naive_mib: dict[tuple, dict[int, float]] = {}  # (V, H, mask) -> {N: measured naive extra peak}
    results = []

    def estimate(v: int, n: int, h: int, mask: str) -> float:
        known = naive_mib.get((v, h, mask), {})
        smaller = [m for m in known if m < n]
        if smaller:
            m = max(smaller)
            return known[m] * n / m * MIB
        return 8 * n * v * 4 + v * h * 4

    def measure(v: int, n: int, h: int, mask: str, methods: list[str], repeats: int) -> dict[str, dict]:
        samples: dict[str, list[dict]] = {m: [] for m in methods}
        for r in range(repeats):
            for method in methods if r % 2 == 0 else methods[::-1]:
                spec = {"method": method, "V": v, "N": n, "H": h, "mask": mask, "threads": THREADS,
                        "as_limit_gib": args.as_limit_gib}  # fmt: skip
                samples[method].append(run_worker(spec))
        out = {m: _summary(s) for m, s in samples.items()}
        if "naive" in out and "peak_mib_median" in out["naive"]:
            naive_mib.setdefault((v, h, mask), {})[n] = out["naive"]["peak_mib_median"]
        return out

    for v, n, h, mask in sorted(cases, key=lambda c: (c[1] * c[0] * c[2], c[3])):
        repeats = cfg["repeats"] if (n, mask) == (min(cfg["N"]), "full") else cfg["repeats_other"]
        est = estimate(v, n, h, mask)
        row: dict = {"V": v, "N": n, "H": h, "mask": mask, "naive_estimate_gib": est / GIB}
        if est <= max_est:
            row.update(measure(v, n, h, mask, ["naive", "chunked"], repeats))
            row["naive_extrapolated"] = False
        else:
            row.update(measure(v, n, h, mask, ["chunked"], repeats))
            points = []
            for m in cfg["extrap_N"]:
                if m >= n:
                    continue
                if m not in naive_mib.get((v, h, mask), {}):
                    if estimate(v, m, h, mask) > max_est:
                        row.setdefault("naive_skipped_N_estimate_gib", {})[m] = estimate(v, m, h, mask) / GIB
                        continue
                    extra = measure(v, m, h, mask, ["naive"], cfg["repeats_other"])["naive"]
                    row.setdefault("naive_extrapolation_runs", {})[m] = extra
                if m in naive_mib.get((v, h, mask), {}):
                    points.append(m)
            row["naive_extrapolated"] = True
            row["naive_extrapolated_from_N"] = points
            ms_pts = []
            for m in points:
                src = row.get("naive_extrapolation_runs", {}).get(m) or _find(results, v, m, h, mask)["naive"]
                ms_pts.append((m, src["ms_median"]))
            row["naive"] = {
                "peak_mib_median": _line([(m, naive_mib[(v, h, mask)][m]) for m in points], n) if len(points) > 1
                else None,
                "ms_median": _line(ms_pts, n) if len(ms_pts) > 1 else None,
                "extrapolated": True,
            }  # fmt: skip
        _ratios(row)
        row["rounds"] = repeats
        results.append(row)
        print(_fmt_row(row), flush=True)


    report = {
        "benchmark": "loss_memory",
        "loss_type": LOSS_TYPE, "temperature": 1.0, "dtype": "float32",
        "hidden": "student and teacher use the same hidden size H (separate random weights)",
        "mask": "full = every token carries loss; half = 512-token sequences, first 256 tokens are prompt (masked out)",
        "memory_metric": "ru_maxrss after fwd+bwd minus ru_maxrss after building inputs, fresh process per sample",
        "time_metric": "wall time of one fwd+bwd per fresh process, naive/chunked processes interleaved",
        "quick": args.quick, "plan": cfg,
        "machine": machine(threads=THREADS),
        "results": results,
        "total_runtime_s": time.perf_counter() - t_start,
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_memory.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "loss_memory.md").write_text(markdown(report))
    plot(report, out / "loss_memory.png")
    print(f"wrote {out}/loss_memory.{{json,md,png}} in {report['total_runtime_s']:.0f} s")


def _find(results: list[dict], v: int, n: int, h: int, mask: str) -> dict:
    return next(r for r in results if (r["V"], r["N"], r["H"], r["mask"]) == (v, n, h, mask))


def _ratios(row: dict) -> None:
    naive, chunked = row["naive"], row["chunked"]
    if naive.get("peak_mib_median") and chunked.get("peak_mib_median"):
        row["memory_ratio"] = chunked["peak_mib_median"] / naive["peak_mib_median"]
    if naive.get("extrapolated"):
        if naive.get("ms_median") and chunked.get("ms_median"):
            row["time_ratio"] = chunked["ms_median"] / naive["ms_median"]
        return
    pairs = [
        c["seconds"] / s["seconds"]
        for s, c in zip(naive.get("samples", []), chunked.get("samples", []))
        if "error" not in s and "error" not in c
    ]
    if pairs:
        row["time_ratio"] = statistics.median(pairs)
        row["time_ratio_min"], row["time_ratio_max"] = min(pairs), max(pairs)


def _k(x: int) -> str:
    return f"{x // 1024}k" if x % 1024 == 0 else str(x)


def _num(x: float | None, fmt: str, star: bool = False) -> str:
    return "n/a" if x is None else format(x, fmt) + ("*" if star else "")


def _fmt_row(r: dict) -> str:
    n, c, star = r["naive"], r["chunked"], r["naive_extrapolated"]
    return (
        f"| {_k(r['V'])} | {_k(r['N'])} | {_k(r['H'])} | {r['mask']} "
        f"| {_num(n.get('peak_mib_median'), '.0f', star)} | {_num(c.get('peak_mib_median'), '.0f')} "
        f"| {_num(r.get('memory_ratio'), '.3f', star)} "
        f"| {_num(n.get('ms_median'), '.0f', star)} | {_num(c.get('ms_median'), '.0f')} "
        f"| {_num(r.get('time_ratio'), '.2f', star)} "
        + (f"({r['time_ratio_min']:.2f}-{r['time_ratio_max']:.2f}) " if "time_ratio_min" in r else "")
        + f"| {r['rounds']} |"
    )


def markdown(rep: dict) -> str:
    m = rep["machine"]
    lines = [
        "# Distillation loss: peak memory and time, chunked vs naive",
        "",
        f"One forward+backward of `{rep['loss_type']}` (temperature 1, fp32); {rep['hidden']}. "
        "Naive = full `[N, V]` student and teacher logits + `divergence`; chunked = `chunked_divergence` "
        "(default chunk size). Peak = extra peak RSS over the inputs (includes the `V x H` weight gradient), "
        "median of fresh-process runs; time = median wall time; time ratio = median of per-round chunked/naive "
        "ratios (min-max). `*` = naive extrapolated linearly in N from smaller measured N (not measured).",
        "",
        f"Machine: {m['cpu']}, {m['cpus']} CPUs, {m['threads']} torch threads, torch {m['torch']}, "
        f"{m['date']}. Total runtime {rep['total_runtime_s']:.0f} s{' (--quick)' if rep['quick'] else ''}.",
        "",
    ]
    header = (
        "| V | N | H | mask | naive peak MiB | chunked peak MiB | ratio | naive ms | chunked ms | time ratio "
        "| rounds |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    full = [r for r in rep["results"] if r["mask"] == "full"]
    half = [r for r in rep["results"] if r["mask"] == "half"]
    key = lambda r: (r["V"], r["N"], r["H"])  # noqa: E731
    lines += ["## Headline: every token carries loss (mask all True)", "", header]
    lines += [_fmt_row(r) for r in sorted(full, key=key)]
    lines += ["", "## 50% completion tokens (naive still projects every row; chunked only the masked ones)", ""]
    lines += [header] + [_fmt_row(r) for r in sorted(half, key=key)]
    for r in rep["results"]:
        if r["naive_extrapolated"]:
            lines.append(
                f"\n`*` V={_k(r['V'])}, N={_k(r['N'])}, H={_k(r['H'])}: naive estimated at "
                f"{r['naive_estimate_gib']:.1f} GiB, not run; extrapolated from naive runs at N = "
                + ", ".join(_k(x) for x in r["naive_extrapolated_from_N"])
                + "".join(
                    f"; N={_k(int(m))} not run either (estimated {g:.1f} GiB)"
                    for m, g in r.get("naive_skipped_N_estimate_gib", {}).items()
                )
                + "."
            )
    lines += ["", "## Goals", ""] + goals(rep)
    return "\n".join(lines) + "\n"


def goals(rep: dict) -> list[str]:
    """Chunked peak <= 0.2x naive at the largest V and N; chunked time <= 1.0x naive at the smallest N."""
    full = [r for r in rep["results"] if r["mask"] == "full"]
    v_max, n_max, n_min = max(r["V"] for r in full), max(r["N"] for r in full), min(r["N"] for r in full)
    out = []
    for r in full:
        star = " (naive extrapolated, not measured)" if r["naive_extrapolated"] else ""
        if (r["V"], r["N"]) == (v_max, n_max) and r.get("memory_ratio") is not None:
            ok = "met" if r["memory_ratio"] <= 0.2 else "MISSED"
            out.append(f"- memory, V={_k(v_max)} N={_k(n_max)} H={_k(r['H'])}: chunked/naive peak "
                       f"{r['memory_ratio']:.3f} (goal <= 0.2): {ok}{star}")  # fmt: skip
        if r["N"] == n_min and r.get("time_ratio") is not None:
            ok = "met" if r["time_ratio"] <= 1.0 else "MISSED"
            rng = f" (per-round {r['time_ratio_min']:.2f}-{r['time_ratio_max']:.2f})" if "time_ratio_min" in r else ""
            out.append(f"- time, V={_k(r['V'])} N={_k(n_min)} H={_k(r['H'])}: chunked/naive "
                       f"{r['time_ratio']:.2f}{rng} (goal <= 1.0): {ok}{star}")  # fmt: skip
    return out


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sorted(rep["results"], key=lambda r: (r["mask"] != "full", r["V"], r["N"], r["H"]))
    labels = [f"V{_k(r['V'])}\nN{_k(r['N'])}\nH{_k(r['H'])}" + ("\n50%" if r["mask"] == "half" else "") for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(rows)), 8), sharex=True)
    x = list(range(len(rows)))
    for ax, metric, unit in ((axes[0], "peak_mib", "extra peak RSS, MiB"), (axes[1], "ms", "time of fwd+bwd, ms")):
        for off, method, color in ((-0.2, "naive", "tab:red"), (0.2, "chunked", "tab:blue")):
            vals = [r[method].get(f"{metric}_median") or 0 for r in rows]
            lo = [max(v - (r[method].get(f"{metric}_min") or v), 0) for v, r in zip(vals, rows)]
            hi = [max((r[method].get(f"{metric}_max") or v) - v, 0) for v, r in zip(vals, rows)]
            bars = ax.bar([i + off for i in x], vals, 0.4, color=color, yerr=[lo, hi], capsize=2)
            for b, r in zip(bars, rows):
                if method == "naive" and r["naive_extrapolated"]:
                    b.set_hatch("//")
                    b.set_alpha(0.45)
        key = "memory_ratio" if metric == "peak_mib" else "time_ratio"
        for i, r in enumerate(rows):
            if r.get(key) is not None:
                star = "*" if r["naive_extrapolated"] else ""
                y = r["chunked"].get(f"{metric}_median") or 1
                ax.annotate(f"{r[key]:.2f}x{star}", (i + 0.2, y), ha="center", va="bottom", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel(unit)
        ax.grid(axis="y", which="both", alpha=0.3)
    handles = [
        Patch(color="tab:red", label="naive (full logits)"),
        Patch(color="tab:blue", label="chunked (label: chunked/naive)"),
        Patch(facecolor="tab:red", alpha=0.45, hatch="//", label="naive, extrapolated (*)"),
    ]
    axes[0].legend(handles=handles, fontsize=8)
    axes[0].set_title(f"{rep['loss_type']}, T=1, fp32, one fwd+bwd, {rep['machine']['threads']} threads")
    axes[1].set_xticks(x)
    axes[1].set_xticklabels(labels, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
