"""The GPU run's report: `gpu_bench.md` from the record `gpu_bench.py` writes as `gpu_bench.json`, and the lines it
prints as each row ends and in its closing summary of the failed rows."""

from __future__ import annotations

from rows import ROWS

MIB = 1 << 20


def training_figures(name: str, result: dict, sizes: dict) -> dict:
    """A training row's figures from its rank record (tokens per step: the row's sequence, on-policy the prompt
    and the sampled tokens)."""
    rank = result["record"]
    cuda = rank.get("cuda") or {}
    memory = rank["memory"]
    figures = {"peak_gpu_mib": cuda.get("max_allocated", 0) / MIB or None, "device": cuda.get("device"),
               "peak_rss_mib": max(m.get("VmHWM", 0) for m in memory.values()) / MIB}  # fmt: skip
    if "cache" in rank:  # cache_write: a whole pass, no optimizer step
        cache = rank["cache"]
        return {**figures, "seconds": rank["seconds"], **cache, "loss_tokens_per_s": cache["loss_tokens"] / rank[
            "seconds"], "bytes_per_token": cache["bytes"] / max(cache["loss_tokens"], 1)}
    spec, timed = rank["spec"], rank["timed_seconds"]
    lo, hi = spec["prompt_len_range"]
    new = spec.get("config", {}).get("max_new_tokens") if spec.get("config", {}).get("lmbda") else None
    tokens = (lo + hi) / 2 + new if new else spec["seq_len"]
    return {**figures, "tokens_per_step": tokens, "timed_steps": rank["timed_steps"],
            "step_s": timed / rank["timed_steps"], "tokens_per_s": rank["timed_steps"] * tokens / timed,
            "teacher_mib": rank["teacher_bytes"]["held"] / MIB, "train_loss": rank["train_loss"],
            "dtypes": rank.get("dtypes")}  # fmt: skip


def failure_lines(name: str, result: dict) -> str:
    """``name: FAILED (why)`` and the indented last lines of its output."""
    lines = result.get("tail", "").splitlines()
    return f"{name}: FAILED ({result['error'].strip()})" + "".join(f"\n    | {line}" for line in lines)


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def markdown(rep: dict) -> str:
    s, mod = rep["sizes"], rep["models"]
    dt = "bf16" if s.get("bf16", True) else "fp32"
    on = s["on_policy"]
    extra = [f"{k.split('_params')[0]} {v / 1e6:,.1f}M" for k, v in mod.items()
             if k.endswith("_params") and k not in ("teacher_params", "student_params")]  # fmt: skip
    params = (f"teacher {mod['teacher_params'] / 1e6:,.1f}M, student {mod['student_params'] / 1e6:,.1f}M parameters"
              + (f" ({', '.join(extra)})" if extra else "") if mod else "no training row")
    lines = [f"# The GPU run ({rep['mode']})", "",
             f"{rep['machine'].get('gpu') or 'no GPU'}; {params}"
             + f" (random-init, {s['vocab_size']}-token vocabulary), {s['seq_len']}-token rows, micro batch 1, {dt}; "
             f"off-policy rows {s['off_policy']['steps']} steps of which {s['off_policy']['warmup']} warm-up, "
             f"on-policy rows {on['steps']} of which {on['warmup']} warm-up, {on['new_tokens']} sampled tokens each; "
             f"{rep['total_runtime_s']:.0f} s in all, {rep['machine']['date'][:16]}.", "",
             "| training row | step s | tokens/s | peak GPU MiB | peak RSS MiB | teacher MiB held | train loss | "
             "wall s | vs | step time, peak GPU vs it |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    training = rep["training"]
    for name, r in training.items():
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else ""
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].strip()[:160]} | | | | | | {wall} | | |")
            continue
        gpu = f"{r['peak_gpu_mib']:.0f}" if r["peak_gpu_mib"] else "n/a"
        if "seconds" in r:  # cache_write
            lines.append(f"| {name} | {r['seconds']:.1f} s for {r['rows']} rows | {r['loss_tokens_per_s']:.0f} "
                         f"loss tokens/s, {r['bytes_per_token']:.0f} B each (top-{r['top_k']}) | {gpu} | "
                         f"{r['peak_rss_mib']:.0f} | | | {wall} | | |")
            continue
        vs = ROWS[name].vs
        base = training.get(vs, {})
        versus = (f"{ratio(r['step_s'], base['step_s'])}, {ratio(r['peak_gpu_mib'], base['peak_gpu_mib'])}"
                  if "step_s" in base else "")  # fmt: skip
        lines.append(f"| {name} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {gpu} | {r['peak_rss_mib']:.0f} | "
                     f"{r['teacher_mib']:.0f} | {r['train_loss']:.4f} | {wall} | {vs or ''} | {versus} |")
    lines += ["", "Rows: " + "; ".join(f"**{n}** {ROWS[n].what}" for n in training) + "."]
    loss = rep.get("loss")
    if loss:
        cfg = loss["config"]
        lines += ["", f"Loss, one forward + backward, {cfg['dtype']}, V = {cfg['vocab_size']}, hidden "
                  f"{cfg['student_hidden']} (student) / {cfg['teacher_hidden']} (teacher)"
                  + (f"; Liger skipped: {loss['liger_skipped']}" if loss["liger_skipped"] else "") + ".", "",
                  "| method | tokens | ms median [min, max] | extra peak GPU MiB | loss | vs naive |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in loss["results"]:
            if "error" in r:
                lines.append(f"| {r['method']} | {r['tokens']} | failed: {r['error'].strip()[:160]} | | | |")
                continue
            extra = f"{r['extra_peak_gpu_mib']:.0f}" if r["extra_peak_gpu_mib"] is not None else "n/a"
            lines.append(f"| {r['method']} | {r['tokens']} | {r['ms']:.1f} [{r['ms_min']:.1f}, {r['ms_max']:.1f}] "
                         f"| {extra} | {r['loss']:.6f} | {r.get('loss_vs_naive', float('nan')):.1e} |")
    return "\n".join(lines) + "\n"
