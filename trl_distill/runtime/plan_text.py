"""The memory planner's output: the table of `trl-distill plan`, one column per setup, and its recommendation."""

from __future__ import annotations

from .plan import GIB, ROWS


def _row(label: str, values, fmt) -> str:
    return f"{label:<24}" + "".join(f"{fmt(v):>19}" for v in values)


def format_plan(result: dict) -> str:
    """A table: one column per setup, one row per component, in GiB per GPU (MiB for tiny models)."""
    s, setups = result["settings"], result["configs"]
    unit, scale = ("MiB", 2**20) if max(x["total"] for x in setups.values()) < GIB else ("GiB", GIB)

    def size(n: int) -> str:
        return f"{n / scale:.2f}"

    lines = [
        f"Per-GPU memory ({unit}), {s['nodes']} node(s) x {s['gpus_per_node']} GPUs x {s['gpu_memory_gb']:g} GiB; "
        f"budget {result['budget'] / GIB:.2f} GiB after {result['headroom']:.0%} headroom",
        f"{s['dtype']}, micro batch {s['micro_batch']}, seq {s['seq_len']}, {s['optimizer']}, gradient checkpointing "
        f"{'on' if s['gradient_checkpointing'] else 'off'}, loss chunk {result['chunk_rows']} rows, gradient "
        f"accumulation {s['gradient_accumulation']}, teacher rows per forward {result['teacher_rows']}"
        + (f", sequence parallel {s['sequence_parallel']} (not TRL's column)" if s["sequence_parallel"] > 1 else ""),
        *(f"{role}: {m['params'] / 1e9:.3f}B params, h={m['hidden']}, L={m['layers']}, V={m['vocab']}, "
          f"i={m['intermediate']}" + moe_text(m.get("moe")) + f" ({m['source']})" + ("" if "ours" not in m else
          f"; in ours: teacher_params {size(m['ours']['teacher_params'])}, teacher_step "
          f"{size(m['ours']['teacher_step'])} {unit}") for role, m in result["models"].items()),
        "",
        _row("component", setups, str),
        *(_row(row, [x["rows"][row] for x in setups.values()], size) for row in ROWS),
        _row("total", [x["total"] for x in setups.values()], size),
        _row("fits", [x["fits"] for x in setups.values()], lambda fits: "yes" if fits else "NO"),
    ]
    if any("deepspeed" in x for x in setups.values()):  # DeepSpeed's estimators cover its own setups only
        ds = [sum(x["deepspeed"].values()) if "deepspeed" in x else None for x in setups.values()]
        lines.append(_row("deepspeed model states", ds, lambda n: "-" if n is None else size(n)))
    lines += ["", *(f"  {name}: {x['description']}" for name, x in setups.items()),
              "  (teacher_step: the teacher's hidden states at the step's loss tokens and its lm_head, held through "
              "each optimizer step: the teacher runs once per step)", ""]
    return "\n".join(lines + [recommendation_text(result)])


def moe_text(moe: dict | None) -> str:
    """An MoE model's line: experts routed per token and the parameters a token computes with."""
    if not moe:
        return ""
    return (f", MoE {moe['experts']} experts ({moe['experts_per_token']} per token, {moe['moe_layers']} layers), "
            f"{moe['active_params'] / 1e9:.3f}B active")


def recommendation_text(result: dict) -> str:
    rec = result["recommendation"]
    served = result["configs"]["served"]
    elsewhere = (f" Or serve the teacher with vLLM on other GPUs (--teacher_server): {served['total'] / GIB:.2f} GiB "
                 "per GPU here (the `served` column)." if served["fits"] else "")
    if rec["config"] is None:
        return f"Recommendation: nothing fits, even at micro batch 1 with gradient checkpointing. Add GPUs.{elsewhere}"
    text = f"Recommendation: {rec['config']} ({result['configs'][rec['config']]['description']})"
    total = f"{rec['total'] / GIB:.2f} GiB per GPU"
    whole = (" On 1 GPU the teacher is held whole: nothing to partition over, so no ZeRO-3 hooks (teacher_deepspeed "
             "keeps ZeRO-3)." if result["gpus"] == 1 and rec["config"] in ("ours", "offload_optimizer") else "")
    if rec["settings"]:
        knobs = ", ".join(f"--{k} {v}" for k, v in rec["settings"].items())
        return f"Nothing fits as given. {text}, {total} with {knobs}.{whole}{elsewhere}"
    return f"{text}, {total}.{whole}"
