"""Task rewards (`--task_reward_funcs`) tried before anything trains, as eval verifiers are: on the first train
rows, their reference completions standing in for the student's samples, with the arguments training gives them; a
broken one is one line and exit 2, not a fault at step 1. Scores are what TRL's GRPOTrainer takes (its
``torch.tensor(scores, dtype=torch.float32)``: bools, ints, numpy scalars), and rewards get TRL's ``log_metric`` and
``log_extra`` beside ``trainer_state``."""

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from test_reward_faults import RUN, SAMPLED, counting, module, run, snapshot
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import extras_of
from trl_distill.evaluation.calls import RewardLogs, Verifier
from trl_distill.evaluation.generation import EvalSettings, GenerationEvaluation
from trl_distill.evaluation.verifiers import resolve_verifiers
from trl_distill.rollout.sampling import Sampling
from trl_distill.rollout.task_rewards import TaskColumnsCollator, TaskRewards, row_columns
from trl_distill.run_plan import resolve
from trl_distill.teacher.capabilities import columns_of
from trl_distill.testing import build_tokenizer, tiny_run_settings

BROKEN = '''
def no_kwargs(completions):
    return [1.0 for _ in completions]


def needs_solution(prompts, completions, solution, **kwargs):
    return [1.0 for _ in completions]


def always_raises(prompts, completions, **kwargs):
    raise RuntimeError("no grader configured")


def one_score(prompts, completions, **kwargs):
    return [1.0]
'''
WHEN = "on the first rows of the train dataset (their reference completions standing in for the student's samples)"
CALLED = ("it is called with prompts, completions, completion_ids, trainer_state, log_metric, log_extra and each "
          "column of the rows by name (prompt, completion, answer)")


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("task_rewards") / "train.jsonl"
    counting(16).to_json(str(path))
    return path


@pytest.mark.parametrize("function, message", [
    ("no_kwargs", f"cannot take the arguments of a reward function (got an unexpected keyword argument 'prompts') "
                  f"{WHEN}: {CALLED}; take those it does not read with **kwargs, as TRL's reward functions do."),
    ("needs_solution", f"cannot take the arguments of a reward function (missing a required argument: 'solution') "
                       f"{WHEN}: {CALLED}; name a column the rows have, or give the parameter a default."),
    ("always_raises", "raised RuntimeError: no grader configured on the completion '{first}' " + WHEN +
                      ": it must score any text the student may write."),
    ("one_score", f"returned 1 scores for 2 completions {WHEN}: it must return one per completion."),
])
def test_a_broken_task_reward_is_one_line_before_any_step(tiny_pair, train_file, tmp_path, monkeypatch, capsys,
                                                           function, message):
    reward = module(tmp_path, monkeypatch, "broken_rewards", BROKEN)
    before = snapshot(train_file, reward)
    out = tmp_path / "out"
    code, errors, err = run(["--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path",
                             tiny_pair["teacher"], "--dataset_name", str(train_file), "--output_dir", str(out), *RUN,
                             "--lmbda", "1", "--temperature", "1", "--on_policy_objective", "sampled_token",
                             "--task_reward_funcs", f"broken_rewards:{function}"], capsys)
    first = counting(16)[0]["completion"].strip()  # the first row's reference completion, as the student's
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert errors == [f"trl-distill: error: Task reward {function!r} (--task_reward_funcs) "
                      f"{message.format(first=first)}"]
    assert "eval_reward_funcs" not in errors[0]
    assert not out.exists() and snapshot(train_file, reward) == before  # nothing written: no step ran


def test_the_set_up_try_passes_what_training_passes(tiny_pair, tmp_path, monkeypatch):
    """The set-up call and a training call (the collator's columns, the student's samples) get the same keywords of
    the same types: plain lists, one entry per completion; the reference completions without SFT's EOS text, their
    ids ending with EOS; the Trainer's state and TRL's loggers."""
    module(tmp_path, monkeypatch, "recording_reward", '''
CALLS = []


def reward(prompts, completions, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, **kwargs})
    return [True for _ in completions]
''')
    import recording_reward

    recording_reward.CALLS.clear()
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    data = counting(8)
    trainer = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], train_dataset=data,
                                  processing_class=tokenizer, args=DistillationConfig(**tiny_run_settings(
                                      output_dir=str(tmp_path / "out"), save_strategy="no", max_new_tokens=3,
                                      task_reward_funcs=["recording_reward:reward"], **SAMPLED)))
    (set_up,) = recording_reward.CALLS
    rows = trainer.train_dataset.select(range(2))
    assert set_up["prompts"] == rows["prompt"] and set_up["answer"] == rows["answer"]
    assert set_up["completions"] == [c.removesuffix(tokenizer.eos_token) for c in rows["completion"]]
    assert set_up["completion_ids"] == [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                                        for c in set_up["completions"]]
    assert set_up["trainer_state"] is trainer.state
    collate = TaskColumnsCollator(lambda examples: {}, row_columns(trainer.train_dataset, columns_of(trainer.teacher)))
    columns = extras_of(collate([rows[i] for i in range(2)])).task_columns  # as a training batch carries them
    samples = [torch.tensor(ids) for ids in set_up["completion_ids"]]
    rewards = trainer.sampler.task_rewards.score(columns, samples, 1, trainer.state)
    assert rewards.tolist() == [1.0, 1.0]  # True counts 1.0, as in TRL
    training = recording_reward.CALLS[-1]
    assert training.keys() == set_up.keys()
    for key, value in set_up.items():
        assert type(training[key]) is type(value), key
        if type(value) is list:
            assert len(value) == 2 and [type(v) for v in training[key]] == [type(v) for v in value], key


# ---- Scores as TRL takes them ----

def trl_takes(scores: list):
    """What TRL's GRPOTrainer makes of a reward function's scores: None as NaN, then one float32 tensor written
    into its rewards column (None when that fails)."""
    column = torch.zeros(len(scores))
    try:
        with warnings.catch_warnings():  # (torch's on a list of arrays: slow)
            warnings.simplefilter("ignore")
            column[:] = torch.tensor([torch.nan if s is None else s for s in scores], dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        return None
    return column.tolist()


@pytest.mark.parametrize("score", [True, False, np.bool_(True), 3, np.int64(2), np.float32(0.25), np.float64(0.5),
                                   torch.tensor(0.75), torch.tensor([0.5]), torch.tensor(1, dtype=torch.bfloat16),
                                   Fraction(1, 4), None, "1.0", b"1", 1 + 1j, [0.5], np.array(0.5),
                                   torch.tensor([0.5, 1.0]), np.array([[1.0, 2.0], [3.0, 4.0]]), {"score": 1.0}],
                         ids=lambda score: " ".join(repr(score).split()))
def test_a_score_is_taken_where_trl_takes_it_and_refused_where_trl_refuses_it(score):
    constant = Verifier("constant", lambda prompts, completions, **kw: [score, score], "task_reward_funcs")
    taken = trl_takes([score, score])
    if taken is None:
        with pytest.raises(ValueError) as error:
            constant.score(["p", "q"], ["a", "b"], {}, "at step 3")
        text = str(error.value)
        assert text.startswith("Task reward 'constant' (--task_reward_funcs) returned ") and "\n" not in text
        assert text.endswith(" for the completion 'a' at step 3: scores must be numbers and finite (None leaves a "
                             "completion out).")
    else:
        got = constant.score(["p", "q"], ["a", "b"], {})
        assert [math.nan if v is None else v for v in got] == pytest.approx(taken, nan_ok=True)


@pytest.mark.parametrize("returned", [(1.0, 0.0), np.array([1.0, 0.0]), torch.tensor([1.0, 0.0]),
                                      (v for v in (1.0, 0.0))], ids=["tuple", "numpy", "tensor", "generator"])
def test_any_sequence_trl_iterates_is_a_list_of_scores(returned):
    constant = Verifier("constant", lambda prompts, completions, **kw: returned)
    assert constant.score(["p", "q"], ["a", "b"], {}) == [1.0, 0.0]


@pytest.mark.parametrize("returned", [0.5, torch.tensor(0.5), np.array(0.5), "1.0", {"a": 1.0}, None])
def test_a_return_trl_cannot_iterate_is_one_line(returned):
    constant = Verifier("constant", lambda prompts, completions, **kw: returned, "task_reward_funcs")
    with pytest.raises(ValueError) as error:
        constant.score(["p", "q"], ["a", "b"], {}, "at step 2")
    assert str(error.value) == (f"Task reward 'constant' (--task_reward_funcs) returned {type(returned).__name__} at "
                                "step 2: it must return a list of floats (or None), one per completion.")


# ---- TRL's log_metric and log_extra ----

LOGGING = '''
def reward(prompts, completions, log_metric, log_extra, **kwargs):
    log_metric("length", sum(map(len, completions)) / len(completions))
    log_extra("note", ["x"] * len(completions))
    return [1.0 for _ in completions]
'''


def test_what_a_task_reward_logs_is_logged_as_trl_logs_it(tiny_pair, tmp_path, monkeypatch):
    module(tmp_path, monkeypatch, "logging_reward", LOGGING)
    args = DistillationConfig(output_dir=str(tmp_path / "task"), report_to="none", **SAMPLED,
                              task_reward_funcs=["logging_reward:reward"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    rewards = TaskRewards(resolve(args).on_policy.task_rewards, tokenizer, ["prompt"])  # as the trainer resolves it
    means = []
    for texts in (["ab", "abcd"], ["abcdef", "abcdef"]):
        samples = [torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
        means.append(sum(len(tokenizer.decode(s, skip_special_tokens=True)) for s in samples) / 2)
        assert rewards.score({"prompt": ["p", "q"]}, samples, 1).tolist() == [1.0, 1.0]

    class OneProcess:
        num_processes = 1

    logs = {"loss": 1.0}
    rewards.log_into(logs, OneProcess(), "cpu")
    assert logs == {"loss": 1.0, "length": pytest.approx(sum(means) / 2)}  # the mean of the calls' values
    rewards.log_into(logs := {}, OneProcess(), "cpu")
    assert logs == {}  # taken once


def test_every_ranks_logged_names_are_logged_in_one_order():
    """Two ranks that logged other names: each name's mean over both ranks' calls (a name beside one of ours gets
    ``log_metric/``)."""
    ranks = [RewardLogs(), RewardLogs()]
    ranks[0].log_metric("b", 1.0)
    ranks[0].log_metric("loss", 2.0)
    ranks[1].log_metric("b", 3.0)
    ranks[1].log_metric("a", 5.0)
    names = [name for rank in ranks for name in rank.metrics]
    sent = []

    def reduce(local):
        sent.append(local)
        return sum(sent) if len(sent) == 2 else local

    logs = [{"loss": 0.5}, {"loss": 0.5}]
    ranks[0].take(logs[0], lambda _: names, reduce)
    ranks[1].take(logs[1], lambda _: names, reduce)
    assert logs[1] == {"loss": 0.5, "a": 5.0, "b": 2.0, "log_metric/loss": 2.0}


def test_what_a_verifier_logs_is_an_eval_metric(tmp_path, monkeypatch):
    module(tmp_path, monkeypatch, "logging_verifier", LOGGING)
    from datasets import Dataset

    tokenizer = build_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3="]})
    answer = tokenizer("abc", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    settings = EvalSettings(resolve_verifiers(["logging_verifier:reward"], "answer", None), None, 1,
                            Sampling(4, 1.0, 1.0, None), 2, None, 0)

    def sample(batch, sampling):
        return batch, [torch.tensor(answer) for _ in range(len(batch["input_ids"]))]

    def collate(rows):
        return {"input_ids": torch.ones(len(rows), 2, dtype=torch.long)}

    evaluation = GenerationEvaluation(settings, tokenizer, 0, 1, collate, sample, None, lambda t: t, False)
    evaluation.check(dataset)  # the start-up check's calls log nothing
    metrics = evaluation.run(dataset)
    assert metrics["length"] == len(tokenizer.decode(answer, skip_special_tokens=True))
    assert metrics["rewards/reward/mean"] == 1.0
