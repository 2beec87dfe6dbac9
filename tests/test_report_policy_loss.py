"""`trl-distill report` of a sampled-token run: its policy-gradient surrogate (`policy_loss`, and each teacher's part)
in a panel of its own, never on the loss panel's axis beside a divergence; the summary lists it with the losses."""

from report_checks import check_picture

from trl_distill.report.curves import panels_of, write_curves
from trl_distill.report.history import RunHistory
from trl_distill.report.summary import summary


def sampled_token_history(directory: str) -> RunHistory:
    """What a sampled-token run with two routed teachers logs (alpha 0.8): `loss`, `policy_loss` and its parts,
    `ce_loss`, the diagnostics; no `kd_loss`."""
    steps = range(1, 5)
    policy = [1.6, 1.2, 0.9, 0.7]
    series = {"loss": [(s, 0.8 * p + 0.2 * 3.0) for s, p in zip(steps, policy, strict=True)],
              "policy_loss": list(zip(steps, policy, strict=True)),
              "policy_loss/a": [(s, 0.6 * p) for s, p in zip(steps, policy, strict=True)],
              "policy_loss/b": [(s, 0.4 * p) for s, p in zip(steps, policy, strict=True)],
              "ce_loss": [(s, 3.0) for s in steps],
              "kl_teacher_student": [(s, 0.5 / s) for s in steps],
              "sampled_token_teacher_gap": [(s, -0.5 / s) for s in steps]}
    return RunHistory(directory, f"{directory}/trainer_state.json", 4, 4, series,
                      {"settings": {"alpha": 0.8, "lmbda": 1.0}})


def test_the_surrogate_has_a_panel_of_its_own(tmp_path):
    history = sampled_token_history(str(tmp_path))
    panels = {title: names for title, names, _ in panels_of(history)}
    assert panels == {"loss": ["loss", "ce_loss"], "policy gradient": ["policy_loss", "policy_loss/a", "policy_loss/b"],
                      "KL": ["kl_teacher_student"]}
    assert write_curves(history, str(tmp_path / "report.png")) == ["loss", "policy gradient", "KL"]
    check_picture(tmp_path / "report.png", ["loss", "policy gradient", "KL"])
    rows = [line.split(" | ")[0] for line in summary(history).splitlines() if line.startswith("| ")][1:]
    assert rows[:3] == ["| loss", "| policy_loss", "| ce_loss"]
    assert "| policy_loss | 1.6 (1) | 0.7 (4) | 0.7 (4) |" in summary(history)  # lower is better
