"""`trl-distill plan`'s long-sequence rows: per-GPU activations and loss memory against the sequence length, with
and without sequence parallelism (`--sequence_parallel`), for our setup (ZeRO-2 student + ZeRO-3 teacher)."""

from __future__ import annotations

from dataclasses import replace

from .plan import GIB, ModelSpec, Settings, estimate

GROWING = ("activations", "logits_loss", "teacher_step")
"""The rows that grow with the sequence: the rest (weights, gradients, optimizer, gather buffers) do not."""


def long_rows(student: ModelSpec, teacher, s: Settings, lengths: tuple[int, ...] | None = None) -> list[dict]:
    """For each length (default: the plan's, then doubling to 16x): the growing rows' bytes per GPU without
    sequence parallelism and with the plan's `sequence_parallel` (or 2 when the plan has none), and whether the
    whole setup fits."""
    size = s.sequence_parallel if s.sequence_parallel > 1 else 2
    lengths = lengths or tuple(s.seq_len * 2**i for i in range(5))
    out = []
    for length in lengths:
        row = {"seq_len": length}
        for label, sp in (("without", 1), ("with", size)):
            if s.gpus % sp:
                continue
            rows = estimate(student, teacher, replace(s, seq_len=length, sequence_parallel=sp))
            row[label] = {"growing": sum(rows[k] for k in GROWING), "total": sum(rows.values()),
                          "fits": sum(rows.values()) <= s.budget, "sequence_parallel": sp}
        out.append(row)
    return out


def format_long_rows(rows: list[dict]) -> str:
    """The rows as a table (GiB per GPU): activations + loss memory, and the whole total, each way."""
    with_sp = next((r["with"]["sequence_parallel"] for r in rows if "with" in r), None)
    title = "Long sequences, ours (GiB per GPU: activations + loss + teacher step, then the whole total)"
    lines = [title + ("" if with_sp is None else f", without and with sequence parallel {with_sp}:"),
             f"{'seq_len':>10}{'no SP':>14}{'total':>10}{'fits':>6}" + ("" if with_sp is None else
                                                                        f"{'SP':>14}{'total':>10}{'fits':>6}")]
    for row in rows:
        cells = f"{row['seq_len']:>10}"
        for label in ("without", "with"):
            if label in row:
                r = row[label]
                cells += f"{r['growing'] / GIB:>14.2f}{r['total'] / GIB:>10.2f}{'yes' if r['fits'] else 'NO':>6}"
        lines.append(cells)
    return "\n".join(lines)
