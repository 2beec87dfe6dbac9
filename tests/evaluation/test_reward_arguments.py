"""Reward functions get what TRL's GRPOTrainer gives them, and nothing one does changes another's: a function that
edits its argument lists in place, an ``async def`` function (TRL awaits those), a conversational prompt-completion
row's completions as messages (TRL's ``[{"role": "assistant", ...}]``), an answer column of numbers loaded as floats
(``3`` read 3.0), and a function named by its file or by a model's path: one line naming the flag."""

import sys

import pytest
import torch
from transformers import AutoTokenizer

from trl_distill import DistillationConfig
from trl_distill.evaluation.calls import Verifier, text_of
from trl_distill.evaluation.verifiers import exact_match, regex_match
from trl_distill.rollout.task_rewards import TaskRewards, reward_inputs
from trl_distill.run_plan import resolve

SAMPLED = dict(lmbda=1.0, temperature=1.0, on_policy_objective="sampled_token")


def shouting(prompts, completions, answer, **kwargs):
    """Normalises in place, as reward code often does, and drops what it has read of the answers."""
    completions[:] = [c.upper() for c in completions]
    answer.clear()
    return [1.0 for _ in completions]


def test_a_function_that_edits_its_arguments_in_place_changes_nothing_the_next_one_gets():
    completions, answers = ["yes", "no"], ["yes", "no"]
    columns = {"answer": answers}
    assert Verifier("shouting", shouting).score(["p", "q"], completions, columns) == [1.0, 1.0]
    assert completions == ["yes", "no"] and columns["answer"] == ["yes", "no"]  # the caller's lists as they were
    # (was: the next function got ["YES", "NO"] and no answers: exact_match 0 instead of 1 for each)
    assert Verifier("exact_match", exact_match("answer")).score(["p", "q"], completions, columns) == [1.0, 1.0]


def test_a_function_that_drops_a_completion_is_still_counted_against_what_it_was_given():
    def dropping(prompts, completions, **kwargs):
        completions.pop()
        return [1.0 for _ in completions]

    with pytest.raises(ValueError) as error:
        Verifier("dropping", dropping, "task_reward_funcs").score(["p", "q"], ["a", "b"], {}, "at step 3")
    assert str(error.value) == ("Task reward 'dropping' (--task_reward_funcs) returned 1 scores for 2 completions at "
                                "step 3: it must return one per completion.")


def test_an_async_function_is_awaited_as_trl_awaits_it():
    async def judged(prompts, completions, **kwargs):
        return [float(c == "yes") for c in completions]

    async def failing(prompts, completions, **kwargs):
        if "no" in completions:
            raise RuntimeError("the judge is down")
        return [1.0 for _ in completions]

    assert Verifier("judged", judged).score(["p", "q"], ["yes", "no"], {}) == [1.0, 0.0]
    with pytest.raises(ValueError) as error:
        Verifier("failing", failing).score(["p", "q"], ["yes", "no"], {}, "at step 2")
    assert str(error.value) == ("Verifier 'failing' (--eval_reward_funcs) raised RuntimeError: the judge is down on "
                                "the completion 'no' at step 2: it must score any text the student may write.")


def test_whole_numbers_loaded_as_floats_match_their_text():
    """A JSON column of numbers with one fraction is all floats: ``3`` is loaded as 3.0 (was: compared as "3.0",
    so a completion ``3`` scored 0)."""
    answers = {"answer": [3.0, 2.5, 1e6, "7"]}
    completions = ["3", "2.5", "1000000", "7"]
    assert Verifier("exact_match", exact_match("answer")).score(["p"] * 4, completions, answers) == [1.0] * 4
    regex = Verifier("regex_match", regex_match("answer", r"= (\S+)"))
    assert regex.score(["p"] * 4, [f"x = {c}" for c in completions], answers) == [1.0] * 4
    assert Verifier("exact_match", exact_match("answer")).score(["p"], ["3.0"], {"answer": [3.0]}) == [0.0]


def format_reward(completions, **kwargs):
    """TRL's docs' format reward, as written there: conversational completions."""
    import re

    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(r"^\s*\S", content) else 0.0 for content in contents]


def test_conversational_prompt_completion_rows_give_task_rewards_messages_as_trl_does(tiny_pair, tmp_path,
                                                                                    monkeypatch):
    """A prompt of messages (TRL's conversational prompt-completion) makes the completions one assistant message
    each, as TRL's GRPOTrainer gives them (was: plain strings, and TRL's format reward raised)."""
    import sys
    import types

    rewards = types.ModuleType("conversational_rewards")
    rewards.format_reward = format_reward
    monkeypatch.setitem(sys.modules, "conversational_rewards", rewards)
    prompts = [[{"role": "user", "content": "count to three"}], [{"role": "user", "content": "say hi"}]]
    columns = {"prompt": prompts, "completion": [[{"role": "assistant", "content": "1 2 3"}],
                                                 [{"role": "assistant", "content": "hi"}]]}
    assert reward_inputs(columns) == (prompts, True)
    assert reward_inputs({"prompt": ["count to three", "say hi"]}) == (["count to three", "say hi"], False)
    args = DistillationConfig(output_dir=str(tmp_path / "out"), report_to="none", **SAMPLED,
                              task_reward_funcs=["conversational_rewards:format_reward"])
    rewards = resolve(args).on_policy.task_rewards  # as the trainer resolves the run
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    completions = [torch.tensor(tokenizer(text)["input_ids"]) for text in ("one two", "hi")]
    assert TaskRewards(rewards, tokenizer, list(columns)).score(columns, completions, 1).tolist() == [1.0, 1.0]


ON_POLICY = ["--lmbda", "1", "--temperature", "1", "--on_policy_objective", "sampled_token"]


@pytest.mark.parametrize("flags, message", [
    ([*ON_POLICY, "--task_reward_funcs", "rewards.py:accuracy"],
     "--task_reward_funcs 'rewards.py:accuracy' names a file: name its module, as rewards:accuracy, with rewards.py "
     "in the working directory (or its directory on PYTHONPATH)."),
    ([*ON_POLICY, "--task_reward_funcs", "Qwen/Qwen2.5-Math-RM-72B"],
     "--task_reward_funcs 'Qwen/Qwen2.5-Math-RM-72B' is a path, not a task reward: give a Python function as "
     "module:function (e.g. my_rewards:accuracy); a reward model, which TRL's reward_funcs may name, is not one here."),
    (["--eval_reward_funcs", "script_rewards:accuracy"],
     "--eval_reward_funcs: cannot import 'script_rewards' for 'script_rewards:accuracy': SystemExit: 2 (the module "
     "exits as it is imported: keep a script's argument parsing under `if __name__ == \"__main__\":`)"),
    ([*ON_POLICY, "--task_reward_funcs", "regex_match", "--eval_answer_pattern", "####\\s*(\\S+"],
     "--eval_answer_pattern '####\\\\s*(\\\\S+' is not a regular expression (missing ), unterminated subpattern at "
     "position 7), and regex_match in --task_reward_funcs extracts the answer with it: fix it, e.g. "
     "'####\\s*(\\S+)'."),
], ids=["file", "model", "script", "pattern"])
def test_a_function_that_cannot_be_had_is_one_line_naming_its_flag(tmp_path, monkeypatch, capsys, flags, message):
    """Refused as the config is built, before anything loads: nothing of the user's module runs (a file given for
    a module was half-imported), and a module that exits as it imports (a script parsing our command line) or a
    pattern `re` refuses is one line, not argparse's usage or `re`'s traceback."""
    from trl_distill.cli import main

    (tmp_path / "rewards.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
                                         "def accuracy(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    (tmp_path / "script_rewards.py").write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = ["--model_name_or_path", "student", "--dataset_name", "data.jsonl", "--output_dir", "out", "--report_to",
            "none", *flags]
    monkeypatch.setattr(sys, "argv", ["trl-distill", *argv])  # what the script's parse_args() reads, as on the CLI
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    ours = [line for line in err.splitlines() if line.startswith("trl-distill") and  # (not the script's argparse
            not line.startswith("trl-distill: error: unrecognized arguments")]  # line, which it prints as it exits)
    assert ours == [f"trl-distill: error: {message}"] and err.rstrip().endswith(ours[0])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == before  # nothing ran or was written


@pytest.mark.parametrize("n", [1, 2])
def test_pass_at_k_leaves_out_the_prompts_without_a_reference(tiny_pair, n):
    """Two of four eval rows have a null answer: their completions score None (left out, as TRL leaves out a None
    reward, and as the warning says), so a student right on the other two has pass@1 1 (was 0.5: a prompt the
    verifier could not judge counted as failed); the verifier's mean and the prompt count as before."""
    from datasets import Dataset

    from trl_distill.evaluation.generation import EvalSettings, GenerationEvaluation
    from trl_distill.rollout.sampling import Sampling

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    rows = Dataset.from_dict({"prompt": ["a", "b", "c", "d"], "answer": ["x", None, "y", None]})
    verifier = Verifier("exact_match", exact_match("answer"), answer="answer")
    settings = EvalSettings([verifier], "answer", n, Sampling(4, 1.0, 1.0, 0), 4, None, 0)
    answers = {"a": "x", "b": "z", "c": "y", "d": "z"}  # the student writes each row's answer (or z: no reference)

    def sample(batch, sampling):
        return None, [torch.tensor(tokenizer(answers[p])["input_ids"] + [tokenizer.eos_token_id]) for p in batch]

    evaluation = GenerationEvaluation(settings, tokenizer, 0, 1, lambda indices: [rows[i]["prompt"] for i in indices],
                                      sample, None, lambda totals: totals, conversational=False)
    metrics = evaluation.run(rows)
    assert metrics["pass@1"] == 1.0 and metrics["rewards/exact_match/mean"] == 1.0
    assert metrics["generation_prompts"] == 4
    if n == 2:
        assert metrics["pass@2"] == 1.0


def gold(completions, completion, **kwargs):
    """Compares with the reference completion column, as a user's function may."""
    gold.seen = kwargs
    return [float(text_of(c).strip() == reference.strip()) for c, reference in zip(completions, completion)]


def test_the_reference_completion_reaches_a_function_as_the_dataset_holds_it(tiny_pair, tmp_path, monkeypatch):
    """SFT appends EOS text to each prepared completion and adds its own columns: a function gets the row as written
    (was: completion ' 3</s>', so a function comparing with it scored 0, and input_ids / labels beside it)."""
    import sys
    import types

    from datasets import Dataset

    from trl_distill.evaluation.generation import EvalSettings, GenerationEvaluation
    from trl_distill.rollout.sampling import Sampling

    monkeypatch.setitem(sys.modules, "gold_rewards", types.SimpleNamespace(gold=gold))
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    eos = tokenizer.eos_token
    prepared = {"prompt": ["a", "b"], "completion": [f" 3{eos}", f" 4{eos}"], "input_ids": [[1, 2], [3, 4]],
                "labels": [[-100, 2], [-100, 4]]}
    args = DistillationConfig(output_dir=str(tmp_path / "out"), report_to="none", **SAMPLED,
                              task_reward_funcs=["gold_rewards:gold"])
    rewards = resolve(args).on_policy.task_rewards  # as the trainer resolves the run
    samples = [torch.tensor(tokenizer(text)["input_ids"]) for text in (" 3", " 5")]
    assert TaskRewards(rewards, tokenizer, ["prompt", "completion"]).score(
        {k: prepared[k] for k in ("prompt", "completion")}, samples, 1).tolist() == [1.0, 0.0]
    rows = Dataset.from_dict(prepared)
    settings = EvalSettings([Verifier("gold", gold)], None, 1, Sampling(4, 1.0, 1.0, 0), 4, None, 0)
    evaluation = GenerationEvaluation(settings, tokenizer, 0, 1, lambda indices: list(indices),
                                      lambda batch, sampling: (None, samples), None, lambda totals: totals, False)
    assert evaluation.run(rows)["pass@1"] == 0.5
    assert not {"input_ids", "labels"} & set(gold.seen)


@pytest.mark.parametrize("flags, reward", [([], ""), (["--on_policy_objective", "sampled_token", "--task_reward_funcs",
                                                       "exact_match"], " (and the task reward with it)")],
                         ids=["divergence", "sampled_token"])
def test_alpha_0_on_the_students_own_samples_is_one_line(tmp_path, capsys, flags, reward):
    """With a teacher, alpha=0 and lmbda=1 trained the cross-entropy of the student's own samples alone (the
    teacher's judgement and the task reward weighted 0), and ended 'Student trained on the cross-entropy alone'."""
    from trl_distill.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--model_name_or_path", "student", "--teacher_model_name_or_path", "teacher", "--dataset_name",
              "data.jsonl", "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--alpha", "0", "--lmbda",
              "1", "--temperature", "1", *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("trl-distill")] == [
        "trl-distill: error: alpha=0 trains on the cross-entropy alone, and with lmbda=1.0 the completions are the "
        f"student's own samples: it would learn its own text, the teacher's judgement of it weighted 0{reward}. Set "
        "alpha > 0 (1: the teacher's signal alone), or lmbda=0."]
    assert not (tmp_path / "out").exists()
    DistillationConfig(output_dir=str(tmp_path / "seq"), report_to="none", alpha=0.0, seq_kd=True,
                       teacher_model_name_or_path="teacher")  # sequence-level KD on the teacher's samples: kept
    with pytest.raises(ValueError, match="alpha=0 trains on the cross-entropy alone"):
        from trl_distill import DistillationTrainer

        DistillationTrainer("student", teacher_model="teacher", args=DistillationConfig(
            output_dir=str(tmp_path / "api"), report_to="none", alpha=0.0, lmbda=0.5))


def test_a_sampled_token_run_records_and_reports_its_objective(tmp_path):
    """The run record (checkpoints, `trl-distill report`) named only `divergence: forward_kl` for a sampled-token run
    that never used it: it records the objective, the task rewards and the teacher prompt, and a resume under
    another objective is refused as another set-up."""
    import json

    from trl_distill.report.history import load_history
    from trl_distill.report.summary import summary
    from trl_distill.runtime.checkpoints import MARKER, check_resume, run_record

    args = DistillationConfig(output_dir=str(tmp_path / "out"), report_to="none", **SAMPLED,
                              task_reward_funcs=["exact_match"])
    record = run_record(resolve(args).recorded, "teacher", 1, False)
    assert {k: record["settings"][k] for k in ("on_policy_objective", "task_reward_funcs", "teacher_prompt")} == {
        "on_policy_objective": "sampled_token", "task_reward_funcs": ["exact_match"], "teacher_prompt": None}
    checkpoint = tmp_path / "out" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    divergence = run_record(resolve(DistillationConfig(output_dir=str(tmp_path / "out"), report_to="none", lmbda=1.0,
                                                       temperature=1.0)).recorded, "teacher", 1, False)
    (checkpoint / MARKER).write_text(json.dumps({"run": divergence}))
    with pytest.raises(ValueError, match="on_policy_objective: 'divergence' there, 'sampled_token' now"):
        check_resume(str(checkpoint), record)
    state = {"global_step": 1, "max_steps": 1, "log_history": [{"step": 1, "loss": 1.0, "policy_loss": 0.5}]}
    (tmp_path / "out" / "trainer_state.json").write_text(json.dumps(state))
    (tmp_path / "out" / "trl_distill_run.json").write_text(json.dumps(record))
    text = summary(load_history(str(tmp_path / "out")))
    assert "- on_policy_objective: sampled_token" in text and "- task_reward_funcs: ['exact_match']" in text
