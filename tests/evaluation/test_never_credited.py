"""A verifier that gives 0 to every reference completion it is tried on before training would log pass@k 0 for a
student that writes exactly those completions: one warning says so (an answer column that is not what the
completions end with, a pattern that never matches), instead of a silent 0 at every evaluation."""

import logging

import pytest
from datasets import Dataset

from trl_distill.evaluation.generation import CHECKED_ROWS, EvalSettings, GenerationEvaluation
from trl_distill.evaluation.verifiers import resolve_verifiers
from trl_distill.rollout.sampling import Sampling
from trl_distill.testing import build_tokenizer

ROWS = {"prompt": [f"{i}+{i}=" for i in range(10)], "completion": [f"so it is {2 * i}" for i in range(10)],
        "answer": [str(2 * i) for i in range(10)]}


def check(specs: list[str], rows: dict, caplog, pattern: str | None = None) -> list[str]:
    settings = EvalSettings(resolve_verifiers(specs, "answer", pattern), "answer", 1, Sampling(4, 1.0, 1.0, None), 2,
                            None, 0)
    evaluation = GenerationEvaluation(settings, build_tokenizer(), 0, 1, None, None, None, lambda t: t, False)
    with caplog.at_level(logging.WARNING, logger="trl_distill"):
        evaluation.check(Dataset.from_dict(rows))
    return [r.getMessage() for r in caplog.records if "scores 0 on the reference completions" in r.getMessage()]


@pytest.mark.parametrize("specs, pattern, warned", [
    (["exact_match"], None, True),  # "so it is 4" is never the answer "4": pass@1 0 for a perfect student
    (["regex_match"], r"answer: (\d+)", True),  # a pattern the completions never hold
    (["last_number"], None, False),
    (["regex_match"], r"is (\d+)", False),
])
def test_a_verifier_that_credits_no_reference_completion_is_one_warning(caplog, specs, pattern, warned):
    lines = check(specs, ROWS, caplog, pattern)
    name = specs[0]
    expected = (f"Verifier '{name}' (--eval_reward_funcs) scores 0 on the reference completions of all {CHECKED_ROWS} "
                "judged rows it was tried on (the eval split): a student that writes them would log pass@k 0. Check "
                "what it compares (--eval_answer_column, --eval_answer_pattern), or pick another verifier "
                "(last_number compares the last number).")
    assert lines == ([expected] if warned else [])


def test_one_credited_reference_or_none_to_judge_is_no_warning(caplog):
    rows = {k: list(v) for k, v in ROWS.items()}
    rows["completion"][3] = "6"  # one reference that exact_match credits: the verifier can score 1
    assert check(["exact_match"], rows, caplog) == []
    caplog.clear()
    prompts_only = {"prompt": ROWS["prompt"], "answer": ROWS["answer"]}  # no reference completion to try
    assert check(["exact_match"], prompts_only, caplog) == []
