"""Round five: a user's verifiers (`--eval_reward_funcs`) and task rewards (`--task_reward_funcs`) called as TRL's
GRPOTrainer calls its rewards (plain lists), their references checked by value (a column a loader filled with nulls
is no silent pass@1 of 0), and whatever they do wrong one line naming the function, its flag, the step and the
completion, with the checkpoints already written left complete."""

import logging
import math
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from test_generation_eval import trainer_for
from transformers import AutoTokenizer

from trl_distill import DistillationConfig
from trl_distill.cli import main
from trl_distill.errors import ExternalError
from trl_distill.evaluation.references import check_references
from trl_distill.evaluation.verifiers import resolve_verifiers
from trl_distill.rollout.task_rewards import TaskRewards, reward_columns
from trl_distill.run_plan import resolve
from trl_distill.runtime.checkpoints import is_complete
from trl_distill.testing import synthetic_prompt_completion, with_answers

# Rewards written as TRL's reward docs write them: they log the batch with json and join prompt and completion
TRL_STYLE = '''
import json
import re

SEEN = []


def format_reward(completions, **kwargs):
    """1.0 for a completion of words and spaces only."""
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if re.match(r"^[a-z ]*$", content) else 0.0 for content in contents]


def accuracy_reward(prompts, completions, answer, **kwargs):
    SEEN.append({"prompts": prompts, "completions": completions, "answer": answer, **kwargs})
    json.dumps({"prompts": prompts, "answer": answer})
    joined = [prompt + completion for prompt, completion in zip(prompts, completions)]
    return [float(text.endswith(reference)) for text, reference in zip(joined, answer)]
'''
# A verifier that reads the reference completions (numbers) and raises on anything else; a reward that fails at
# its fourth call (the set-up try on the reference completions, then steps 1, 2 and 3)
FRAGILE = '''
CALLS = []


def as_number(completions, answer, **kwargs):
    return [float(int(completion) == int(reference)) for completion, reference in zip(completions, answer)]


def flaky(prompts, completions, **kwargs):
    CALLS.append(len(completions))
    if len(CALLS) == 4:
        raise RuntimeError("the grading service is down")
    return [float(len(completion) % 3 == 0) for completion in completions]


def nan_late(prompts, completions, **kwargs):
    CALLS.append(len(completions))
    return [float("nan") if len(CALLS) == 4 else 1.0 for completion in completions]


def short_late(prompts, completions, **kwargs):
    CALLS.append(len(completions))
    return [1.0] * (1 if len(CALLS) == 4 else len(completions))
'''
SAMPLED = dict(lmbda=1.0, temperature=1.0, on_policy_objective="sampled_token")
RUN = ["--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--logging_steps", "1",
       "--disable_tqdm", "true", "--use_cpu", "true", "--per_device_train_batch_size", "4", "--max_steps", "4"]


def counting(rows: int):
    """Prompt-completion rows whose completion and answer are the prompt's word count."""
    data = synthetic_prompt_completion(rows)
    counts = [str(len(prompt.split())) for prompt in data["prompt"]]
    return data.remove_columns("completion").add_column("completion", [f" {c}" for c in counts]).add_column(
        "answer", counts)


def module(tmp_path, monkeypatch, name: str, source: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def snapshot(*paths: Path) -> dict:
    return {p: p.read_bytes() for path in paths for p in ([path] if path.is_file() else sorted(path.rglob("*")))
            if p.is_file() and "__pycache__" not in p.parts}


def run(argv, capsys) -> tuple[int, list[str], str]:
    """The CLI in this process: its exit code, its `trl-distill: error:` lines, and all of stderr."""
    try:
        main(argv)
        code = 0
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("trl-distill: error:")], err


# ---- TRL's argument types ----

def test_trl_style_rewards_get_plain_lists_as_verifiers_and_as_task_rewards(tiny_pair, tmp_path, monkeypatch):
    """The eval split's columns reach a verifier as lists (they were `datasets.Column`s: `json.dumps` raised), at
    the start-up check and in `evaluate()`; a task reward gets lists too."""
    module(tmp_path, monkeypatch, "trl_style", TRL_STYLE)
    import trl_style

    trainer = trainer_for(tiny_pair, tmp_path, eval_rows=6, eval_reward_funcs=[
        "trl_style:accuracy_reward", "trl_style:format_reward"])
    metrics = trainer.evaluate()
    assert 0 <= metrics["eval_pass@1"] <= 1 and "eval_rewards/format_reward/mean" in metrics
    assert len(trl_style.SEEN) >= 3  # the start-up check, then each eval batch (6 rows in batches of 4)
    for call in trl_style.SEEN:
        state = call.pop("trainer_state")  # TRL's too: the Trainer's state, for rewards that change with the step
        assert state is trainer.state
        assert callable(call.pop("log_metric")) and callable(call.pop("log_extra"))  # and TRL's loggers
        assert all(type(value) is list for value in call.values()), {k: type(v) for k, v in call.items()}
        assert len({len(value) for value in call.values()}) == 1  # one entry per completion, each
    args = DistillationConfig(output_dir=str(tmp_path / "task"), report_to="none", **SAMPLED,
                              task_reward_funcs=["trl_style:accuracy_reward"])
    plan = resolve(args).on_policy.task_rewards  # as the trainer resolves the run
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    rows = with_answers(synthetic_prompt_completion(3))
    columns = {name: rows[name] for name in rows.column_names}  # as `datasets` gives them: Columns
    completions = [torch.tensor(tokenizer(text)["input_ids"]) for text in rows["completion"]]
    rewards = TaskRewards(plan, tokenizer, rows.column_names).score(columns, completions, 1)
    assert rewards.tolist() == [1.0, 1.0, 1.0]  # each completion is its own answer
    assert all(type(v) is list for k, v in trl_style.SEEN[-1].items() if k not in ("trainer_state", "log_metric",
                                                                                   "log_extra"))


# ---- What a function returns or raises: one line naming it, the flag, the step and the completion ----

@pytest.mark.parametrize("body, message", [
    ("raise KeyError('score')", "raised KeyError: 'score' on the completion 'a b c' at step 3 (on the student's "
                                "samples): it must score any text the student may write."),
    ("return [1.0]", "returned 1 scores for 2 completions at step 3 (on the student's samples): it must return one "
                     "per completion."),
    ("return None", "returned NoneType at step 3 (on the student's samples): it must return a list of floats"),
    ("return [1.0, 'yes']", "returned 'yes' for the completion 'd e f' at step 3"),
    ("return [float('nan'), 1.0]", "returned nan for the completion 'a b c' at step 3 (on the student's samples): "
                                   "scores must be numbers and finite"),
    ("return [1.0, float('inf')]", "returned inf for the completion 'd e f' at step 3"),
])
def test_a_task_reward_that_raises_or_returns_no_score_per_completion_is_one_line(tiny_pair, tmp_path, monkeypatch,
                                                                                   body, message):
    name = f"bad_reward_{abs(hash(body))}"
    module(tmp_path, monkeypatch, name, f"def reward(prompts, completions, **kwargs):\n"
                                         f"    if any('a b c' in c for c in completions) and len(completions) == 1:\n"
                                         f"        raise KeyError('score')\n"
                                         f"    {body}\n")
    args = DistillationConfig(output_dir=str(tmp_path / "task"), report_to="none", **SAMPLED,
                              task_reward_funcs=[f"{name}:reward"])
    rewards = resolve(args).on_policy.task_rewards  # as the trainer resolves the run
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    completions = [torch.tensor(tokenizer(text)["input_ids"]) for text in ("a b c", "d e f")]
    with pytest.raises(ExternalError) as error:  # training's boundary: one line, exit 1
        TaskRewards(rewards, tokenizer, ["prompt"]).score({"prompt": ["x", "y"]}, completions, 3)
    text = str(error.value)
    assert text.startswith("Task reward 'reward' (--task_reward_funcs) ") and message in text, text
    assert "\n" not in text and "--resume_from_checkpoint true" in text and "eval_reward_funcs" not in text


def test_the_completion_named_is_shortened_to_one_line():
    (verifier,) = resolve_verifiers(["exact_match"], "answer", None)
    picky = type(verifier)("picky", lambda prompts, completions, **kw: [1 / (len(c) < 50) for c in completions])
    long = "word " * 12 + "\n" + "x" * 3
    with pytest.raises(ValueError) as error:
        picky.score(["p", "q"], ["fine", long], {}, "in the evaluation at step 4")
    assert ("raised ZeroDivisionError: division by zero on the completion 'word word word word word word word "
            "word…' in the evaluation at step 4") in str(error.value)  # the second completion's first 39 characters
    assert "\n" not in str(error.value)


# ---- References that are null ----

def test_a_null_answer_gives_no_score_where_the_text_none_would_have_passed():
    (exact,) = resolve_verifiers(["exact_match"], "answer", None)
    (last,) = resolve_verifiers(["last_number"], "answer", None)
    assert exact.score(["p", "q"], ["None", "x"], {"answer": [None, "x"]}) == [None, 1.0]
    assert last.score(["p", "q", "r"], ["7", "7", "nan"], {"answer": [None, 7, math.nan]}) == [None, 1.0, None]
    numbers = Dataset.from_dict({"prompt": ["p", "q"], "answer": [math.nan, math.nan]})  # a CSV's empty numbers
    with pytest.raises(ValueError, match="last_number compares with the 'answer' column, which is null in all 2 rows "
                                         "of numbers.csv"):
        check_references([last], numbers, "numbers.csv")


def test_answers_null_in_every_row_are_refused_and_a_few_are_one_warning(tiny_pair, tmp_path, monkeypatch, caplog):
    """Through the trainer (the API): all null is one line naming the split and column; 2 of 10 one warning with the
    count. A user function's references are the columns it names as parameters."""
    data = with_answers(synthetic_prompt_completion(16))
    empty = data.select(range(4)).map(lambda row: {"answer": None})
    with pytest.raises(ValueError, match=r"--eval_reward_funcs: exact_match compares with the 'answer' column, "
                                         r"which is null in all 4 rows of the eval split .*--eval_answer_column\."):
        trainer_for(tiny_pair, tmp_path, evaluation=empty, eval_reward_funcs=["exact_match"])
    module(tmp_path, monkeypatch, "named_reference", "def accuracy(completions, answer, **kwargs):\n"
                                                     "    return [1.0 for _ in completions]\n")
    with pytest.raises(ValueError, match=r"accuracy compares with the 'answer' column, which is null in all 4 rows"
                                         r".* drop accuracy from --eval_reward_funcs\."):
        trainer_for(tiny_pair, tmp_path, evaluation=empty, eval_reward_funcs=["named_reference:accuracy"])
    few = data.select(range(10)).map(lambda row, i: {"answer": None if i in (3, 7) else row["answer"]},
                                     with_indices=True)
    with caplog.at_level(logging.WARNING, logger="trl_distill"):
        trainer_for(tiny_pair, tmp_path, evaluation=few, eval_reward_funcs=["exact_match"])
    warned = [r.getMessage() for r in caplog.records if "null in" in r.getMessage()]
    assert warned == ["trl_distill: --eval_reward_funcs: exact_match compares with the 'answer' column, which is "
                      "null in 2 of the 10 rows of the eval split: those rows' completions have no reference and "
                      "score None."]


def test_task_rewards_compared_with_a_null_column_are_refused_before_training(tmp_path):
    args = DistillationConfig(output_dir=str(tmp_path / "task"), report_to="none", **SAMPLED,
                              task_reward_funcs=["last_number", "exact_match"])
    rewards = resolve(args).on_policy.task_rewards  # as the trainer resolves the run
    data = with_answers(synthetic_prompt_completion(4)).map(lambda row: {"answer": None})
    with pytest.raises(ValueError, match=r"^--task_reward_funcs: last_number, exact_match compare with the 'answer' "
                                         r"column, which is null in all 4 rows of the train dataset "):
        reward_columns(rewards, data, [])


# ---- Through `trl-distill`: exit codes, one line, nothing of the user's changed ----

@pytest.fixture(scope="module")
def split_dir(tmp_path_factory) -> Path:
    """A dataset directory: train.jsonl with an answer column, test.jsonl without one (read as nulls)."""
    directory = tmp_path_factory.mktemp("splits") / "data"
    directory.mkdir()
    counting(16).to_json(str(directory / "train.jsonl"))
    counting(8).remove_columns("answer").to_json(str(directory / "test.jsonl"))
    return directory


@pytest.mark.parametrize("flags, message", [
    (["--eval_strategy", "steps", "--eval_reward_funcs", "exact_match"],
     "--eval_reward_funcs: exact_match compares with the 'answer' column, which is null in all 8 rows of "
     "{data}/test.jsonl (the 'test' split of --dataset_name {data})"),
    (["--lmbda", "1", "--temperature", "1", "--on_policy_objective", "sampled_token", "--task_reward_funcs",
      "fragile:no_such_function"], "--task_reward_funcs: 'fragile' has no function 'no_such_function'"),
    (["--lmbda", "1", "--temperature", "1", "--on_policy_objective", "sampled_token", "--task_reward_funcs",
      "broken_module:reward"], "--task_reward_funcs: cannot import 'broken_module' for 'broken_module:reward': "
                               "SyntaxError: "),
    (["--router_aux_loss_coef", "nan"], "router_aux_loss_coef must be a finite number, got nan"),
    (["--lmbda", "1", "--temperature", "1", "--on_policy_objective", "sampled_token", "--task_reward_weight", "inf"],
     "task_reward_weight must be a finite number, got inf"),
])
def test_set_up_faults_name_the_flag_given(tiny_pair, split_dir, tmp_path, monkeypatch, capsys, flags, message):
    module(tmp_path, monkeypatch, "fragile", FRAGILE)
    module(tmp_path, monkeypatch, "broken_module", "def reward(prompts, completions, **kwargs:\n    return []\n")
    before = snapshot(split_dir, tmp_path)
    out = tmp_path / "out"
    code, errors, err = run(["--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path",
                             tiny_pair["teacher"], "--dataset_name", str(split_dir), "--output_dir", str(out), *RUN,
                             *flags], capsys)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert message.format(data=split_dir) in errors[0]
    assert "eval_reward_funcs" not in errors[0] or "--eval_reward_funcs" in flags
    assert "lower the learning rate" not in errors[0].lower()
    assert not out.exists() and snapshot(split_dir, tmp_path) == before  # no eval_pass@1 0 logged: nothing ran


KEPT_LINE_END = ("The last complete checkpoint is kept: fix the function and resume with --resume_from_checkpoint "
                 "true.")


@pytest.mark.parametrize("function, line", [
    ("flaky", "Task reward 'flaky' (--task_reward_funcs) raised RuntimeError: the grading service is down at step 3 "
              "(on the student's samples): it must score any text the student may write. "),
    ("nan_late", "Task reward 'nan_late' (--task_reward_funcs) returned nan for the completion "),  # not "the loss"
    ("short_late", "Task reward 'short_late' (--task_reward_funcs) returned 1 scores for "),
], ids=["raises", "nan", "miscounts"])
def test_a_task_reward_that_fails_at_step_3_is_one_line_and_checkpoint_2_stays_complete(tiny_pair, split_dir,
                                                                                       tmp_path, monkeypatch,
                                                                                       capsys, function, line):
    """Raises, returns NaN, or miscounts at its fourth call (step 3): one line naming it and its flag, exit 1; the
    guard's "the student's loss is not finite: lower the learning rate" never speaks for a NaN reward."""
    reward = module(tmp_path, monkeypatch, f"fragile_task_{function}", FRAGILE)
    before = snapshot(split_dir, reward)
    out = tmp_path / "out"
    code, errors, err = run(["--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path",
                             tiny_pair["teacher"], "--dataset_name", str(split_dir / "train.jsonl"), "--output_dir",
                             str(out), *RUN, "--lmbda", "1", "--temperature", "1", "--alpha", "1",
                             "--on_policy_objective", "sampled_token", "--task_reward_funcs",
                             f"fragile_task_{function}:{function}", "--max_new_tokens", "4", "--save_strategy",
                             "steps", "--save_steps", "2"], capsys)
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"trl-distill: error: {line}"), errors
    assert " at step 3 (on the student's samples)" in errors[0] and errors[0].endswith(KEPT_LINE_END), errors
    assert is_complete(str(out / "checkpoint-2")) and not (out / "checkpoint-4").exists()
    assert snapshot(split_dir, reward) == before


def test_a_verifier_that_passes_the_start_up_check_then_raises_on_the_students_text(tiny_pair, split_dir, tmp_path,
                                                                                    monkeypatch, capsys):
    """The reference completions are numbers, `int()` reads them; the untrained student's text it cannot: the first
    evaluation (step 2) is one line naming the verifier and the completion; checkpoint-1 stays complete."""
    train = tmp_path / "data"
    train.mkdir()
    (train / "train.jsonl").write_bytes((split_dir / "train.jsonl").read_bytes())
    counting(8).to_json(str(train / "test.jsonl"))
    verifier = module(tmp_path, monkeypatch, "fragile_eval", FRAGILE)
    before = snapshot(train, verifier)
    out = tmp_path / "out"
    code, errors, err = run(["--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path",
                             tiny_pair["teacher"], "--dataset_name", str(train), "--output_dir", str(out), *RUN,
                             "--eval_strategy", "steps", "--eval_steps", "2", "--eval_reward_funcs",
                             "fragile_eval:as_number", "--eval_max_new_tokens", "4", "--per_device_eval_batch_size",
                             "4", "--save_strategy", "steps", "--save_steps", "1"], capsys)
    assert code == 1 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    line = errors[0]
    assert line.startswith("trl-distill: error: Verifier 'as_number' (--eval_reward_funcs) raised ValueError: invalid "
                           "literal for int() with base 10: "), line
    assert " on the completion '" in line and " in the evaluation at step 2: it must score any text" in line
    assert line.endswith("resume with --resume_from_checkpoint true.")
    assert is_complete(str(out / "checkpoint-1")) and not (out / "checkpoint-2").exists()
    assert snapshot(train, verifier) == before
