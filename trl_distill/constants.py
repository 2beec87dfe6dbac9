"""Names the configuration offers as choices, kept in a leaf module so that `trl_distill.config` can list them
without importing the code behind them (each owner checks its table against these names: tests/test_config.py)."""

LOSS_TYPES = ("forward_kl", "reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tvd")
"""The divergences of `loss.divergences.DIVERGENCES`, in its order."""

OBJECTIVES = ("divergence", "sampled_token")
"""What the student learns from its own samples (`rollout.objective_checks`)."""

BUILT_IN_VERIFIERS = ("exact_match", "regex_match", "last_number")
"""The verifiers `evaluation.verifiers` has built in."""

TEACHER_COMBINES = ("route", "mixture", "sum")
"""How several teachers teach (`teacher.panel`)."""

VLLM_MODES = ("server", "colocate")
"""Where the student's rollout engine runs."""
