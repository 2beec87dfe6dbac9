"""On-policy and sequence-level distillation: the draw, the sampled completions, and GKD's loss as an oracle."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.rollout.on_policy import completion_batch, split_prompts
from trl_distill.rollout.sampling import DATASET, STUDENT, TEACHER, completion_source
from trl_distill.testing import launch, logged, synthetic_prompt_completion, tiny_run_settings

WORKER = Path(__file__).parents[1] / "scripts" / "on_policy_worker.py"


def make_trainer(tiny_pair, tmp_path, **overrides):
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=4,
                                 save_strategy="no", use_cpu=True, max_new_tokens=6)
    settings.update(overrides)
    return DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=DistillationConfig(**settings),
                               train_dataset=synthetic_prompt_completion(32),
                               processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]))


class Recorder:
    """Wraps the sampler's `sample` and the trainer's `compute_loss`: which source each step used, what was sampled,
    and which tokens carried loss."""

    def __init__(self, trainer):
        self.sampled, self.labelled = [], []
        sample, loss = trainer.sampler.sample, trainer.compute_loss

        def sampling(source, batch):
            new, completions = sample(source, batch)
            self.sampled.append((source, [c.tolist() for c in completions]))
            return new, completions

        def computing(model, inputs, *args, **kwargs):
            if model.training:
                labels = inputs["labels"]
                self.labelled.append([row[row != -100].tolist() for row in labels])
            return loss(model, inputs, *args, **kwargs)

        trainer.sampler.sample, trainer.compute_loss = sampling, computing


def test_the_draw_is_a_function_of_seed_and_step():
    draws = [completion_source(0.5, False, 42, step) for step in range(200)]
    torch.manual_seed(0)  # no global RNG state: drawing in another order, after other draws, changes nothing
    backwards = [completion_source(0.5, False, 42, step) for step in reversed(range(200))]
    assert draws == backwards[::-1]
    assert draws != [completion_source(0.5, False, 43, step) for step in range(200)]  # the seed matters
    assert 70 < draws.count(STUDENT) < 130 and set(draws) == {STUDENT, DATASET}
    assert {completion_source(0.0, True, 1, s) for s in range(50)} == {TEACHER}
    assert {completion_source(1.0, True, 1, s) for s in range(50)} == {STUDENT}


def test_prompts_and_completions_round_trip():
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 9, 10, 0, 0]])
    labels = torch.tensor([[-100, -100, 7, 8, -100], [-100, 9, 10, -100, -100]])
    mask = (ids != 0).long()
    prompts = split_prompts(ids, labels, mask)
    assert [p.tolist() for p in prompts] == [[5, 6], [5]]
    batch = completion_batch(prompts, [torch.tensor([1, 2, 3]), torch.tensor([4])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 1, 2, 3], [5, 4, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 1, 2, 3], [-100, 4, -100, -100, -100]]


def test_a_step_drawn_off_policy_is_exactly_off_policy(tiny_pair, tmp_path):
    """lmbda > 0 runs the draw every step; a step drawn off the policy must train exactly as lmbda = 0 does."""
    plain, drawn = make_trainer(tiny_pair, tmp_path / "a"), make_trainer(tiny_pair, tmp_path / "b", lmbda=1e-9)
    plain.train()
    drawn.train()
    assert [h["generated_length"] for h in drawn.state.log_history if "loss" in h] == [0.0] * 4  # never sampled...
    assert [h["on_policy_fraction"] for h in drawn.state.log_history if "loss" in h] == [0.0] * 4  # ...but drawn
    for key in ("loss", "kd_loss", "ce_loss"):
        assert logged(plain.state.log_history, key) == logged(drawn.state.log_history, key)


@pytest.mark.parametrize("mode", ["lmbda", "seq_kd"])
def test_generated_completions_are_what_is_trained_on(tiny_pair, tmp_path, mode):
    overrides = {"lmbda": 1.0} if mode == "lmbda" else {"seq_kd": True}
    trainer = make_trainer(tiny_pair, tmp_path, **overrides)
    recorder = Recorder(trainer)
    trainer.train()
    expected_source = STUDENT if mode == "lmbda" else TEACHER
    assert [source for source, _ in recorder.sampled] == [expected_source] * 4
    assert [completions for _, completions in recorder.sampled] == recorder.labelled  # only sampled tokens
    dataset_completions = {tuple(r) for r in trainer.train_dataset["labels"]}
    assert all(len(c) <= 6 for _, step in recorder.sampled for c in step)
    assert not any(tuple(c) in dataset_completions for _, step in recorder.sampled for c in step)
    logs = [h for h in trainer.state.log_history if "on_policy_fraction" in h]
    assert [h["on_policy_fraction"] for h in logs] == [1.0 if mode == "lmbda" else 0.0] * 4
    assert all(0 < h["generated_length"] <= 6 for h in logs)


def test_loss_on_a_generated_batch_equals_gkd_generalized_jsd(tiny_pair, tmp_path):
    from trl.experimental.gkd import GKDTrainer

    trainer = make_trainer(tiny_pair, tmp_path, divergence="jsd", beta=0.3, temperature=2.0, alpha=1.0,
                           kd_temperature_scaling=False, lmbda=1.0)
    batch = next(iter(trainer.get_train_dataloader()))
    batch, _ = trainer.sampler.sample(STUDENT, trainer._prepare_inputs(batch))
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.compute_loss(trainer.model, batch)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        student = trainer.model(**inputs).logits[:, :-1]
        teacher = trainer.teacher.module(**inputs).logits[:, :-1]
        theirs = GKDTrainer.generalized_jsd_loss(student, teacher, batch["labels"][:, 1:], beta=0.3, temperature=2.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_two_processes_same_draws_after_resume_and_uneven_teacher_generation(tiny_pair, tmp_path):
    pair = str(Path(tiny_pair["teacher"]).parent)
    launch(WORKER, pair, str(tmp_path), "full", timeout=300)
    launch(WORKER, pair, str(tmp_path), "resume", str(tmp_path / "full" / "checkpoint-3"), timeout=300)
    full, resumed = ([json.loads((tmp_path / run / f"rank{r}.json").read_text()) for r in (0, 1)]
                     for run in ("full", "resume"))
    assert full[0]["sources"] == full[1]["sources"]  # one draw per step, shared by the ranks
    assert set(full[0]["sources"].values()) == {STUDENT, TEACHER}
    assert {s: full[0]["sources"][s] for s in resumed[0]["sources"]} == resumed[0]["sources"]
    assert sorted(resumed[0]["sources"]) == ["4", "5", "6"]
    # the teacher sampled different lengths on the two ranks (ZeRO-3, synced) and every rank finished
    teacher_steps = [s for s, source in full[0]["sources"].items() if source == TEACHER]
    assert teacher_steps and all(full[0]["lengths"][s] != full[1]["lengths"][s] for s in teacher_steps)
    assert full[0]["global_step"] == full[1]["global_step"] == 6
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "checkpoint-6")
    assert sum(p.numel() for p in student.parameters()) == 37280  # the tiny student, saved whole


def test_language_modeling_data_has_no_prompts_to_sample_from(tiny_pair, tmp_path):
    from datasets import Dataset

    trainer = make_trainer(tiny_pair, tmp_path, lmbda=1.0)
    trainer.train_dataset = trainer._prepare_dataset(
        Dataset.from_dict({"text": ["reverse: cat dog => dog cat"] * 8}), trainer.processing_class, trainer.args,
        packing=False, formatting_func=None, dataset_name="train")
    with pytest.raises(ValueError, match="need prompts"):
        trainer.train()


def test_rows_without_a_prompt_are_refused_before_training_with_their_count(tiny_pair, tmp_path):
    from datasets import Dataset

    rows = [{"prompt": "", "completion": "abc def"}, *synthetic_prompt_completion(4)]
    args = DistillationConfig(**tiny_run_settings(output_dir=str(tmp_path / "out"), use_cpu=True, lmbda=0.5))
    for _ in range(2):  # the refused run leaves no lock behind: the same output_dir is refused the same way again
        with pytest.raises(ValueError, match=r"need prompts, and 1 of the 5 prepared train rows have none"):
            DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=args,
                                train_dataset=Dataset.from_list(rows))
    plain = DistillationConfig(**tiny_run_settings(output_dir=str(tmp_path / "out"), use_cpu=True))
    DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=plain, train_dataset=Dataset.from_list(rows))


@pytest.mark.parametrize("lmbda, use_vllm, stage, refused", [
    (0.5, False, 3, True), (0.5, True, 3, False), (0.5, False, 2, False), (0.0, False, 3, False)])
def test_hf_generate_from_a_zero3_student_is_refused_from_the_runs_on_policy_plan(lmbda, use_vllm, stage, refused):
    from types import SimpleNamespace

    from trl_distill.rollout.on_policy import refuse_zero3_student_sampling
    from trl_distill.run_plan import resolve

    plan = resolve(DistillationConfig(output_dir="unused", report_to="none", use_cpu=True, lmbda=lmbda,
                                      use_vllm=use_vllm)).on_policy
    plugin = SimpleNamespace(zero_stage=stage)
    if refused:
        with pytest.raises(ValueError, match=r"^On-policy distillation \(lmbda > 0\) with a ZeRO-3 student needs its "
                                             "completions from the rollout server: pass --use_vllm"):
            refuse_zero3_student_sampling(plan, plugin)
    else:
        refuse_zero3_student_sampling(plan, plugin)
    refuse_zero3_student_sampling(plan, None)  # no DeepSpeed student: HF generate samples
