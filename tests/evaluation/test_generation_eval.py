"""Generation-based evaluation in `evaluate()`, one process: what it logs equals the same numbers taken from the
models' own `generate` and `model(...).logits` (the teacher's NLL of the student's samples, pass@1), pass@k with
several samples, the metrics during training and in the report, other teacher kinds, and bad input as one line
before anything trains. (Two processes log what one does: tests/runtime/test_distill_metrics.py.)"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, with_answers

EVEN = "trl_distill.testing:even_length_reward"
NEW_TOKENS = 8


def trainer_for(pair, tmp_path, name="run", eval_rows=10, train=None, evaluation=None, **overrides):
    settings = dict(output_dir=str(tmp_path / name), max_steps=2, save_strategy="no", eval_reward_funcs=[EVEN],
                    eval_max_new_tokens=NEW_TOKENS, per_device_eval_batch_size=4,
                    teacher_model_name_or_path=pair["teacher"])
    settings.update(overrides)
    data = with_answers(synthetic_prompt_completion(16))
    return DistillationTrainer(pair["student"], args=DistillationConfig(**tiny_run_settings(**settings)),
                               train_dataset=train if train is not None else data,
                               eval_dataset=evaluation if evaluation is not None else data.select(range(eval_rows)),
                               processing_class=AutoTokenizer.from_pretrained(pair["tokenizer"]))


@torch.no_grad()
def reference(pair, trainer, teachers=None, route=None, weights=None) -> dict:
    """Greedy completions of the eval prompts from the student's own `generate` (batches of 4, left-padded), the
    teacher's NLL of them from `teacher(...).logits`, and the share of even-length completions. Several `teachers`
    (directories): each row's own (`route`, its teacher's index), else their mixture with `weights`."""
    tok = AutoTokenizer.from_pretrained(pair["tokenizer"])
    student = AutoModelForCausalLM.from_pretrained(pair["student"]).eval()
    models = [AutoModelForCausalLM.from_pretrained(t).eval() for t in teachers or [pair["teacher"]]]
    weights = weights or [1.0] * len(models)
    rows = trainer.eval_dataset
    prompts = [torch.tensor(r["input_ids"][: [i for i, x in enumerate(r["labels"]) if x != -100][0]]) for r in rows]
    nll, tokens, even, ended, lengths = 0.0, 0, 0, 0, []
    for number, start in enumerate(range(0, len(prompts), 4)):
        batch = prompts[start: start + 4]
        width = max(len(p) for p in batch)
        ids = torch.stack([F.pad(p, (width - len(p), 0), value=tok.pad_token_id) for p in batch])
        mask = torch.stack([F.pad(torch.ones_like(p), (width - len(p), 0)) for p in batch])
        out = student.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, width:]
        for index, (prompt, row) in enumerate(zip(batch, out), start=4 * number):
            row = row.tolist()
            completion = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            full = torch.tensor([prompt.tolist() + completion])
            logp = [F.log_softmax(m(full).logits[0, len(prompt) - 1: -1].double(), -1) for m in models]
            logp = logp[route[index]] if route is not None else \
                torch.logsumexp(torch.stack([lp + math.log(w) for lp, w in zip(logp, weights)]), 0)
            nll -= logp.gather(1, full[0, len(prompt):, None]).sum().item()
            tokens += len(completion)
            lengths.append(len(completion))
            ended += completion[-1] == tok.eos_token_id
            text = tok.decode([t for t in completion if t != tok.eos_token_id], skip_special_tokens=True)
            even += len(text) % 2 == 0
    return {"teacher_nll": nll / tokens, "pass@1": even / len(prompts), "generated_length": sum(lengths) / len(lengths),
            "eos_rate": ended / len(prompts)}


def test_evaluate_logs_the_models_own_numbers_for_the_students_samples(tiny_pair, tmp_path):
    trainer = trainer_for(tiny_pair, tmp_path)
    metrics = trainer.evaluate()
    want = reference(tiny_pair, trainer)
    assert 0 < want["pass@1"] < 1  # the verifier separates the samples
    assert metrics["eval_teacher_nll"] == pytest.approx(want["teacher_nll"], abs=1e-5)
    assert metrics["eval_pass@1"] == pytest.approx(want["pass@1"], abs=1e-12)
    assert metrics["eval_rewards/even_length_reward/mean"] == pytest.approx(want["pass@1"], abs=1e-12)
    assert metrics["eval_generated_length"] == pytest.approx(want["generated_length"])
    assert metrics["eval_eos_rate"] == pytest.approx(want["eos_rate"])
    assert metrics["eval_generation_prompts"] == 10 and "eval_loss" in metrics and "eval_kd_loss" in metrics
    assert trainer.state.log_history[-1]["eval_pass@1"] == metrics["eval_pass@1"]  # logged as returned


def test_pass_at_k_samples_reproducibly_and_leaves_the_training_generator_alone(tiny_pair, tmp_path):
    trainer = trainer_for(tiny_pair, tmp_path, num_generations_eval=3, eval_temperature=1.0,
                          eval_generation_prompts=6)
    first = trainer.evaluate()
    torch.manual_seed(5)
    second = trainer.evaluate()
    after = torch.get_rng_state()
    trainer.args.eval_reward_funcs, funcs = None, trainer.args.eval_reward_funcs
    torch.manual_seed(5)
    trainer.evaluate()  # the stock evaluation alone: it draws from the generator as much as with the samples
    trainer.args.eval_reward_funcs = funcs
    assert torch.equal(after, torch.get_rng_state())
    for name in ("eval_pass@1", "eval_pass@3", "eval_teacher_nll", "eval_generated_length"):
        assert first[name] == second[name], name
    # a 0/1 verifier: the mean reward over every completion is the mean over prompts of c / n, i.e. pass@1
    assert first["eval_pass@1"] == pytest.approx(first["eval_rewards/even_length_reward/mean"], abs=1e-12)
    assert first["eval_pass@1"] <= first["eval_pass@3"] and first["eval_generation_prompts"] == 6
    greedy = trainer_for(tiny_pair, tmp_path, "greedy", eval_generation_prompts=6).evaluate()
    assert first["eval_generated_length"] != greedy["eval_generated_length"] or \
        first["eval_teacher_nll"] != greedy["eval_teacher_nll"]  # sampled at temperature 1, not greedy


def test_training_logs_the_generation_metrics_at_each_evaluation_and_the_report_shows_them(tiny_pair, tmp_path):
    from trl_distill.report import write_report

    trainer = trainer_for(tiny_pair, tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2,
                          eval_reward_funcs=[EVEN, "exact_match"], eval_generation_prompts=4)
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_pass@1" in h]
    assert [h["step"] for h in evals] == [2, 4]
    assert all("eval_rewards/exact_match/mean" in h and "eval_teacher_nll" in h for h in evals)
    trainer.save_state()
    write_report(trainer.args.output_dir)
    summary = (tmp_path / "run" / "report.md").read_text()
    best = max(h["eval_pass@1"] for h in evals)
    assert f"| eval_pass@1 | {evals[0]['eval_pass@1']:.6g} (2) | {evals[1]['eval_pass@1']:.6g} (4) | {best:.6g}" \
        in summary  # first, last and best (the highest: a pass rate)
    picture = json.loads(json.dumps(str(tmp_path / "run" / "report.png")))
    from PIL import Image

    assert "generation" in Image.open(picture).info["Description"]


def test_without_a_teacher_the_verifiers_still_run(tiny_pair, tmp_path):
    """The SFT baseline (alpha 0, no teacher) is judged by its samples too; no teacher scores them."""
    metrics = trainer_for(tiny_pair, tmp_path, teacher_model_name_or_path=None, alpha=0.0).evaluate()
    assert "eval_teacher_nll" not in metrics and 0 < metrics["eval_pass@1"] < 1


@pytest.mark.parametrize("combine", ["route", "mixture"])
def test_several_teachers_score_the_samples_as_they_teach(tiny_pair, second_teacher, tmp_path, combine):
    """Routed, each row's sample is scored by its own teacher; mixed, by the mixture of the teachers at temperature 1
    (trained at 2: not the mixture of the tempered teachers brought back to 1): eval_teacher_nll equals the NLL
    computed from both teachers' own logits."""
    teachers, names = [tiny_pair["teacher"], second_teacher], ["a", "b", "b", "a", "b"]
    data = with_answers(synthetic_prompt_completion(16))
    data = data.add_column("teacher", [names[i % len(names)] for i in range(len(data))])
    mixed = {} if combine == "route" else dict(teacher_combine="mixture", teacher_weights=[0.25, 0.75], temperature=2.0)
    trainer = trainer_for(tiny_pair, tmp_path, train=data, evaluation=data.select(range(10)), **mixed,
                          teacher_model_name_or_path=None, teachers=[f"a={teachers[0]}", f"b={teachers[1]}"])
    metrics = trainer.evaluate()
    route = [["a", "b"].index(name) for name in data.select(range(10))["teacher"]]
    want = reference(tiny_pair, trainer, teachers, route=route if combine == "route" else None, weights=[0.25, 0.75])
    assert metrics["eval_teacher_nll"] == pytest.approx(want["teacher_nll"], abs=1e-5)
    alone = [reference(tiny_pair, trainer, [t])["teacher_nll"] for t in teachers]
    assert abs(alone[0] - alone[1]) > 1e-3  # the two teachers score apart: the combination is what is measured


def test_a_teacher_with_another_tokenizer_scores_the_samples(tiny_pair, other_teacher, tmp_path):
    metrics = trainer_for(tiny_pair, tmp_path, teacher_model_name_or_path=other_teacher).evaluate()
    assert metrics["eval_teacher_nll"] > 0 and metrics["eval_pass@1"] >= 0


# ---- Bad input: one line, before anything trains ----

def test_no_answer_column_for_a_built_in_is_one_line(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="the eval split has no 'answer' or 'solution' column .*--eval_answer_column"):
        trainer_for(tiny_pair, tmp_path, evaluation=synthetic_prompt_completion(4), eval_reward_funcs=["exact_match"])
    with pytest.raises(ValueError, match="has no 'target' column"):
        trainer_for(tiny_pair, tmp_path, eval_reward_funcs=["last_number"], eval_answer_column="target")


def test_a_verifier_that_raises_or_miscounts_on_the_first_rows_is_one_line(tiny_pair, tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(
        "def needs_score(prompts, completions, score, **kwargs):\n    return [1.0] * len(completions)\n"
        "def one(prompts, completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"Verifier 'needs_score' \(--eval_reward_funcs\) cannot take the arguments of "
                                         r"a reward function \(missing a required argument: 'score'\) .* name a column "
                                         r"the rows have, or give the parameter a default\.$"):
        trainer_for(tiny_pair, tmp_path, eval_reward_funcs=["bad_rewards:needs_score"])
    with pytest.raises(ValueError, match="Verifier 'one' .* returned 1 scores for 8 completions"):
        trainer_for(tiny_pair, tmp_path, eval_reward_funcs=["bad_rewards:one"])
    assert not (tmp_path / "run").exists()  # nothing left behind


def test_no_eval_split_or_no_prompts_is_one_line(tiny_pair, tmp_path):
    from datasets import Dataset

    args = DistillationConfig(**tiny_run_settings(output_dir=str(tmp_path / "none"), eval_reward_funcs=[EVEN],
                                                  teacher_model_name_or_path=tiny_pair["teacher"]))
    with pytest.raises(ValueError, match="this run has no eval split: pass eval_dataset"):
        DistillationTrainer(tiny_pair["student"], args=args, train_dataset=synthetic_prompt_completion(8),
                            processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]))
    text = Dataset.from_dict({"text": ["the cat is red", "a dog is blue"]})
    with pytest.raises(ValueError, match="2 of the 2 prepared rows of the eval split have none"):
        trainer_for(tiny_pair, tmp_path, evaluation=text)
