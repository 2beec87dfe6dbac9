"""The verifiers of the generation-based evaluation, against scores worked out by hand; a user's function loaded from
a module path, as GRPO users name theirs; the unbiased pass@k; each bad input one line."""

import math
import sys

import pytest

from trl_distill import DistillationConfig
from trl_distill.evaluation.generation import pass_at_k
from trl_distill.evaluation.verifiers import find_last_number, resolve_verifiers
from trl_distill.run_plan import resolve

PROMPTS = ["a", "b", "c", "d"]


def scores(name, completions, answers, pattern=None, column="answer"):
    (verifier,) = resolve_verifiers([name], column, pattern)
    return verifier.score(PROMPTS[: len(completions)], completions, {column: answers})


def test_exact_match_compares_stripped_text():
    got = scores("exact_match", [" 42", "42 ", "4 2", "43"], ["42", " 42", "42", "42"])
    assert got == [1.0, 1.0, 0.0, 0.0]


def test_exact_match_reads_a_conversational_completion():
    completions = [[{"role": "assistant", "content": "yes"}], [{"role": "assistant", "content": "no"}]]
    assert scores("exact_match", completions, ["yes", "yes"]) == [1.0, 0.0]


def test_regex_match_takes_the_first_group_of_the_first_match():
    got = scores("regex_match", ["work #### 17", "#### 17 then #### 18", "#### 18", "no answer"],
                 ["17", "17", "17", "17"], pattern=r"####\s*(\d+)")
    assert got == [1.0, 1.0, 0.0, 0.0]


def test_regex_match_without_a_group_takes_the_whole_match():
    assert scores("regex_match", ["x=5;", "x=6;"], ["x=5", "x=5"], pattern=r"x=\d") == [1.0, 0.0]


def test_last_number_reads_the_final_number_written():
    assert find_last_number("7+9=16 so 8,786.") == 8786.0
    assert find_last_number("-3 then -0.5") == -0.5
    assert find_last_number("none here") is None
    got = scores("last_number", ["3+4=7 so 7", "so 1,234", "12 so 13", "nothing"], ["7", 1234, "12", "0"])
    assert got == [1.0, 1.0, 0.0, 0.0]


def test_a_user_function_from_a_module_path_gets_the_columns(tmp_path, monkeypatch):
    """TRL's reward signature: prompts, completions and each dataset column as a keyword; ``module:function`` and
    TRL's dotted ``module.function`` both load it."""
    (tmp_path / "my_rewards.py").write_text(
        "def length_match(prompts, completions, target_length, **kwargs):\n"
        "    return [float(len(c) == n) for c, n in zip(completions, target_length)]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("my_rewards:length_match", "my_rewards.length_match"):
        (verifier,) = resolve_verifiers([spec], "answer", None)
        assert verifier.name == "length_match"
        assert verifier.score(["p", "q"], ["abc", "ab"], {"target_length": [3, 3]}) == [1.0, 0.0]
    sys.modules.pop("my_rewards", None)


def test_none_scores_are_kept_as_none():
    (verifier,) = resolve_verifiers(["exact_match"], "answer", None)
    skip = type(verifier)("skip", lambda prompts, completions, **kw: [None, 1])
    assert skip.score(["p", "q"], ["a", "b"], {}) == [None, 1.0]


@pytest.mark.parametrize("n,c,k,want", [(1, 1, 1, 1.0), (1, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 1, 4, 1.0),
                                        (4, 0, 4, 0.0), (5, 2, 2, 1 - math.comb(3, 2) / math.comb(5, 2))])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want)


def bad(tmp_path, **fields):
    """The run these fields describe, resolved (how they combine is checked there, before anything loads)."""
    return resolve(DistillationConfig(output_dir=str(tmp_path / "out"), report_to="none", **fields))


def test_an_unknown_verifier_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="Unknown verifier 'exactmatch'.*built-in .*exact_match"):
        bad(tmp_path, eval_reward_funcs=["exactmatch"])


def test_a_module_that_does_not_import_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="cannot import 'no_such_module_here'"):
        bad(tmp_path, eval_reward_funcs=["no_such_module_here:f"])


def test_regex_match_without_a_pattern_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="regex_match verifier needs eval_answer_pattern"):
        bad(tmp_path, eval_reward_funcs=["regex_match"])


def test_greedy_pass_at_k_is_refused(tmp_path):
    with pytest.raises(ValueError, match="set eval_temperature > 0"):
        bad(tmp_path, eval_reward_funcs=["exact_match"], num_generations_eval=4, eval_temperature=0.0)


def test_packed_eval_rows_are_refused(tmp_path):
    with pytest.raises(ValueError, match="eval_packing=False"):
        bad(tmp_path, eval_reward_funcs=["exact_match"], packing=True)
    bad(tmp_path, eval_reward_funcs=["exact_match"], packing=True, eval_packing=False)  # training stays packed


def test_a_function_that_raises_or_miscounts_is_one_line():
    (verifier,) = resolve_verifiers(["exact_match"], "answer", None)
    raising = type(verifier)("boom", lambda prompts, completions, **kw: 1 / 0)
    with pytest.raises(ValueError, match="Verifier 'boom' .* raised ZeroDivisionError"):
        raising.score(["p"], ["a"], {})
    short = type(verifier)("short", lambda prompts, completions, **kw: [1.0])
    with pytest.raises(ValueError, match="returned 1 scores for 2 completions"):
        short.score(["p", "q"], ["a", "b"], {})
    words = type(verifier)("words", lambda prompts, completions, **kw: ["yes", "no"])
    with pytest.raises(ValueError, match="scores must be numbers"):
        words.score(["p", "q"], ["a", "b"], {})
