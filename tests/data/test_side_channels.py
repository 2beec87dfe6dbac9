"""A collated batch carries at most one key besides the model's inputs and labels, in every mode that adds extras
(issue 57): each collator and the sampler add named fields to the one `MicroBatchExtras` under `EXTRAS`. (A served
teacher's and the rollout engine's batches are checked in their own tests, which have a vLLM server:
`test_sampled_token_training`, `test_panel_on_policy`.)"""

import pickle

import pytest
import torch
from oracles import write_teacher_cache
from side_channels import side_channels
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import (
    EXTRAS,
    SIGNAL,
    MicroBatchExtras,
    PositionIdsCollator,
    add_extras,
    extras_of,
    pop_extra,
    put_signal,
    take_signal,
)
from trl_distill.data.loss_layout import LossTokensCollator
from trl_distill.teacher.served import ServedTeacher, ServedTeacherCollator
from trl_distill.teacher.server_client import TeacherServerError
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings

HINT = "{prompt} hint:{completion} =>"
SAMPLED = dict(lmbda=1.0, max_new_tokens=6, alpha=1.0, temperature=1.0, on_policy_objective="sampled_token",
               sampled_token_kl_coef=0.5)


def trainer_for(tiny_pair, tmp_path, teacher=None, names=None, **overrides) -> DistillationTrainer:
    data = synthetic_prompt_completion(16)
    if names is not None:
        data = data.add_column("teacher", [names[i % len(names)] for i in range(len(data))])
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1,
                                 save_strategy="no", use_cpu=True)
    settings.update(overrides)
    return DistillationTrainer(tiny_pair["student"], teacher, args=DistillationConfig(**settings), train_dataset=data,
                               processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]))


@pytest.fixture(scope="module")
def cache_dir(tiny_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("side_channel_cache")
    writer = trainer_for(tiny_pair, tmp, tiny_pair["teacher"])
    write_teacher_cache(writer, str(tmp / "cache"), top_k=8, shard_rows=16)
    return tmp / "cache"


def first_batch(trainer) -> dict:
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def fields(batch: dict) -> set[str]:
    """The extras' fields that are set (`signals` by their keys)."""
    extras = extras_of(batch)
    named = {name for name in vars(extras) if name != "signals" and getattr(extras, name) is not None}
    return named | {f"signals[{key}]" for key in extras.signals}


@pytest.mark.parametrize("mode", ["cache", "routed cache and live", "teacher prompt", "cross-tokenizer"])
def test_a_collated_batch_carries_one_side_channel(tiny_pair, other_teacher, second_teacher, cache_dir, tmp_path,
                                                   mode):
    settings, want = {
        "cache": (dict(teacher_cache=str(cache_dir)), {f"signals[{SIGNAL}]"}),
        "routed cache and live": (dict(teachers=[f"a={second_teacher}", f"b=cache:{cache_dir}"]),
                                  {"route", f"signals[{SIGNAL}:b]"}),
        "teacher prompt": (dict(teacher_model_name_or_path=tiny_pair["teacher"], teacher_prompt=HINT),
                           {"teacher_prompts"}),
        "cross-tokenizer": (dict(teacher_model_name_or_path=other_teacher), {"cross_tokenizer"}),
    }[mode]
    names = ["a", "b"] if mode.startswith("routed") else None
    batch = first_batch(trainer_for(tiny_pair, tmp_path, names=names, **settings))
    assert side_channels(batch) == [EXTRAS]
    assert fields(batch) == want | {"loss_layout"}  # the host labels too (a map-style dataset)


@pytest.mark.parametrize("mode", ["routed with task rewards", "teacher prompt", "cross-tokenizer"])
def test_the_students_samples_carry_one_side_channel(tiny_pair, other_teacher, second_teacher, tmp_path, mode):
    """On-policy: the batch the sampler makes of the student's samples (scored by the teacher, with task rewards)."""
    settings, before, after = {
        "routed with task rewards": (
            dict(teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"],
                 task_reward_funcs=["oracles:shared_characters_reward"], **SAMPLED),
            {"route", "task_columns", "loss_layout"}, {"route", "task_rewards"}),
        "teacher prompt": (dict(teacher_model_name_or_path=tiny_pair["teacher"], teacher_prompt=HINT, **SAMPLED),
                           {"teacher_prompts", "loss_layout"}, {"teacher_prompts"}),
        "cross-tokenizer": (dict(teacher_model_name_or_path=other_teacher, lmbda=1.0, max_new_tokens=6),
                            {"cross_tokenizer", "loss_layout"}, {"cross_tokenizer"}),
    }[mode]
    trainer = trainer_for(tiny_pair, tmp_path, names=["a", "b"] if mode.startswith("routed") else None, **settings)
    batch = first_batch(trainer)
    assert side_channels(batch) == [EXTRAS] and fields(batch) == before
    pop_extra(batch, "loss_layout")  # (taken as the step starts)
    sampled, sampled_rows = trainer.sampler.maybe_resample(batch)
    assert sampled_rows and side_channels(sampled) == [EXTRAS] and fields(sampled) == after
    assert side_channels(batch) == [EXTRAS]  # the dataset's batch keeps its own
    if "task_rewards" in after:
        assert extras_of(sampled).task_rewards.shape == (4,)
    with torch.no_grad():
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        trainer.compute_loss(trainer.model, sampled)
    assert side_channels(sampled) == []  # the loss took every field: the model saw none


def test_a_served_signal_under_sequence_parallelism_travels_in_the_one_key(tmp_path):
    """A served teacher's request (a future) inside the loss layout's and sequence parallelism's collators: one key;
    pickled to the group's ranks, a failed fetch travels as its error, with the labels its rank's part needs."""
    source = ServedTeacher("http://127.0.0.1:9", "teacher")

    def failing(rows, positions, stop=None, sampled_only=False):
        raise TeacherServerError("the teacher server is down")

    source.fetch_arrays = failing
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
            {"input_ids": [5, 6, 7, 0, 0], "labels": [-100, 6, 7, -100, -100]}]

    def base(examples):
        return {key: torch.tensor([example[key] for example in examples]) for key in ("input_ids", "labels")}

    collate = LossTokensCollator(PositionIdsCollator(ServedTeacherCollator(base, source), multiple=4))
    try:
        batch = collate(rows)
        assert side_channels(batch) == [EXTRAS] and fields(batch) == {f"signals[{SIGNAL}]", "loss_layout"}
        assert batch["input_ids"].shape == (2, 8)  # padded to a multiple of 4
        sent = pickle.loads(pickle.dumps(batch))
        holder = take_signal(sent)
        assert torch.equal(holder.labels, batch["labels"]) and side_channels(sent) == [EXTRAS]
        with pytest.raises(TeacherServerError, match="is down"):
            holder.signal  # noqa: B018
    finally:
        source.close()


def test_the_extras_are_copied_on_write():
    """Setting or taking a field makes new extras: a copy of a batch dict keeps its own, as it kept its own keys."""
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long)}
    add_extras(batch, route=torch.tensor([0, 1]))
    put_signal(batch, "teacher_signal:a", "a's signal")
    copy = dict(batch)
    assert torch.equal(pop_extra(copy, "route"), torch.tensor([0, 1])) and take_signal(copy, "teacher_signal:a")
    assert EXTRAS not in copy  # nothing left: the key goes
    assert extras_of(batch).route.tolist() == [0, 1] and list(extras_of(batch).signals) == ["teacher_signal:a"]
    assert pop_extra(copy, "route") is None and take_signal(copy, "teacher_signal:a") is None
    with pytest.raises(KeyError):
        pop_extra(batch, "teacher_route")  # a field's name, not an old key's
    assert isinstance(batch[EXTRAS], MicroBatchExtras) and len(side_channels(batch)) == 1
