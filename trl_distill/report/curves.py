"""The report's picture: one PNG, a panel per question (is the loss falling, is the student agreeing with the
teacher, is it getting closer, how does it do on held-out data), each drawn only when the run logged it. The
sampled-token objective's surrogate (`policy_loss`) has a panel of its own, apart from the divergences."""

from __future__ import annotations

from .history import RunHistory

TITLE = "trl-distill report"  # the PNG's Title chunk: `write.write_report` knows its own pictures by it

# (panel title, the logged series it draws, y label); a name ending in "*" draws every series it begins
PANELS = (
    ("loss", ("loss", "kd_loss", "ce_loss"), "training loss"),
    # the sampled-token objective's policy-gradient surrogate: no divergence, so not on the loss's axis
    ("policy gradient", ("policy_loss", "policy_loss/*"), "sampled-token surrogate (not a divergence)"),
    ("agreement", ("top1_agreement", "eval_top1_agreement"), "top-1 agreement with the teacher"),
    ("KL", ("kl_teacher_student", "eval_kl_teacher_student"), "KL(teacher ‖ student), T = 1"),
    ("eval", ("eval_loss", "eval_kd_loss", "eval_ce_loss"), "evaluation loss"),
    ("generation", ("eval_pass@*", "eval_rewards/*"), "held-out prompts: pass@k, verifier means"),
    ("samples", ("eval_teacher_nll",), "teacher NLL of the student's samples"),
)
PANEL_INCHES, DPI = (5.0, 3.5), 100


def panels_of(history: RunHistory) -> list[tuple[str, list[str], str]]:
    """The panels this run has something to draw in, with the series each draws."""
    found = []
    for title, patterns, label in PANELS:
        names = [n for p in patterns for n in (sorted(s for s in history.series if s.startswith(p[:-1]))
                                                  if p.endswith("*") else [p])]
        present = [name for name in names if history.values(name)]
        if present:
            found.append((title, present, label))
    return found


def write_curves(history: RunHistory, path: str) -> list[str]:
    """Draw the run's panels into a PNG at `path` (two columns; its metadata names the panels); returns them."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only, whatever the machine's display
    import matplotlib.pyplot as plt

    panels = panels_of(history)
    if not panels:
        panels = [("loss", [], "training loss")]  # nothing logged yet: one empty panel, still a picture
    columns = 2 if len(panels) > 1 else 1
    rows = (len(panels) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows),
                                dpi=DPI, squeeze=False)
    for ax, (title, names, label) in zip(axes.flat, panels, strict=False):
        for name in names:
            steps, values = zip(*history.values(name), strict=True)
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(names) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    figure.suptitle(f"trl-distill: {history.directory}", fontsize=9)
    figure.tight_layout()
    titles = [title for title, _, _ in panels]
    figure.savefig(path, metadata={"Title": TITLE, "Description": "panels: " + "; ".join(titles)})
    plt.close(figure)
    return titles
