"""Sequence parallelism (DeepSpeed Ulysses, 2 ranks): each rank holds half of every 2k-token row, for the student
and for the ZeRO-3 teacher, and the run computes what the same run without it computes (data parallel over the same
rows): the logged losses and, through SGD, the student's gradients. Bad input is one line before anything loads."""

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from oracles import write_teacher_cache
from transformers import AutoTokenizer, BloomConfig

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import SignalHolder, shard_signal
from trl_distill.loss.sparse import SparseTeacherSignal
from trl_distill.run_plan import Parallelism, resolve
from trl_distill.runtime.sequence_parallel import (
    attention_implementation,
    check_sequence_parallel_args,
    check_sequence_parallel_models,
    sequence_parallel_size,
)
from trl_distill.teacher.resolve import resolve_teacher
from trl_distill.teacher.step_pass import plain_rows
from trl_distill.testing import (
    build_tiny_model,
    build_tokenizer,
    launch,
    logged,
    long_prompt_completion,
    read_rank_records,
    tiny_llama_config,
    tiny_run_settings,
)

SCRIPTS = Path(__file__).parents[1] / "scripts"
TOKENS = 2048
KEYS = ("loss", "kd_loss", "ce_loss")
ZERO2 = {"zero_optimization": {"stage": 2}}


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory) -> Path:
    """A tokenizer, a teacher and a student whose positions reach 4k tokens."""
    directory = tmp_path_factory.mktemp("long_pair")
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(directory / "tokenizer")
    for seed, size in enumerate(("teacher", "student")):
        build_tiny_model(tokenizer, size, seed=seed, max_position_embeddings=4096).save_pretrained(directory / size)
        tokenizer.save_pretrained(directory / size)
    return directory


def run(pair: Path, out: Path, mode: str, accumulation: int, *extra: str, tokens: int = TOKENS,
        env: dict | None = None) -> list[dict]:
    sys.path.insert(0, str(SCRIPTS))
    proc = launch(SCRIPTS / "sequence_parallel_worker.py", str(pair), str(out), mode, str(accumulation), str(tokens),
                  *extra, timeout=600, env=env)
    records = read_rank_records(out)
    for rank in records:
        rank["weights"] = torch.load(out / f"weights{rank['rank']}.pt")
        rank["printed"] = proc.stdout  # both ranks' output
    return records


def assert_same_run(sp: list[dict], dp: list[dict]) -> None:
    """Every logged loss to 1e-5, and the student's weights after SGD (their change is lr times the gradient)."""
    for key in KEYS:
        want = logged(dp[0]["log_history"], key)
        assert len(want) == 2
        for rank in sp:
            got = logged(rank["log_history"], key)
            for step, value in want.items():
                assert got[step] == pytest.approx(value, rel=1e-5), (key, step)
    moved = max((dp[0]["weights"][n] - sp[0]["weights"][n]).abs().max().item() for n in dp[0]["weights"])
    assert moved < 1e-5
    for name, value in dp[0]["weights"].items():
        torch.testing.assert_close(sp[0]["weights"][name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sp[1]["weights"][name], value, rtol=1e-5, atol=1e-6)  # rank 1 alike


@pytest.mark.distributed
def test_sp2_with_a_zero3_teacher_trains_as_without(long_pair, tmp_path):
    """sp 2, gradient accumulation 2, the once-per-step teacher pass: the rows of a data-parallel run with
    accumulation 1 (the loader gives each micro-batch one rank's row, split over both)."""
    sp = run(long_pair, tmp_path / "sp", "sp", 2)
    dp = run(long_pair, tmp_path / "dp", "dp", 1)
    assert_same_run(sp, dp)
    for rank in sp:  # each rank's attention (student and teacher) got half of each row and saw the whole row
        assert rank["seen"] == [[TOKENS // 2, TOKENS]]
        # the step pass's forwards: both micro-batches' shards at once, every step
        assert all(len(step) == 2 for step in rank["rows"])
    assert sp[0]["rows"] != sp[1]["rows"]  # the two ranks hold different halves
    said = "sequence parallelism 2 (DeepSpeed Ulysses, sdpa attention): each rank holds 1024 of every 2048-token row"
    assert sp[0]["printed"].count(said) == 1 and said not in dp[0]["printed"]  # rank 0 says so, once
    # One process, one trainer after another: data-parallel, sequence-parallel, data-parallel again; each computes
    # what it computes in a process of its own (the sequence-parallel trainer put back the attention it exchanged
    # and DeepSpeed's sequence groups as its training ended, so the last one runs plain data parallelism)
    launch(SCRIPTS / "sequence_parallel_worker.py", str(long_pair), str(tmp_path / "in_turn"), "dp+sp+dp", "2",
           str(TOKENS), timeout=600)
    for i, mode, alone in ((0, "dp", dp), (1, "sp", sp), (2, "dp", dp)):
        records = read_rank_records(tmp_path / "in_turn" / f"{i}-{mode}")
        for rank, own in zip(records, alone, strict=True):
            for key in KEYS:
                assert logged(rank["log_history"], key) == pytest.approx(logged(own["log_history"], key), rel=1e-6)
            weights = torch.load(tmp_path / "in_turn" / f"{i}-{mode}" / f"weights{rank['rank']}.pt")
            for name, value in own["weights"].items():
                torch.testing.assert_close(weights[name], value, rtol=1e-6, atol=1e-7, msg=f"{i}-{mode} {name}")


@pytest.mark.distributed
def test_sp2_from_a_teacher_cache_with_a_lora_student_trains_as_without(long_pair, tmp_path):
    """The cache's signal is read for whole rows and split the same way: each rank keeps its positions' part. The
    student is a LoRA adapter (q and v): its weights after SGD match too."""
    tokenizer = AutoTokenizer.from_pretrained(long_pair / "tokenizer")
    settings = tiny_run_settings(output_dir=str(tmp_path / "writer"), per_device_train_batch_size=1, max_steps=2,
                                 save_strategy="no", max_length=TOKENS, use_cpu=True)
    writer = DistillationTrainer(str(long_pair / "student"), str(long_pair / "teacher"),
                                 args=DistillationConfig(**settings), train_dataset=long_prompt_completion(8, TOKENS),
                                 processing_class=tokenizer)
    write_teacher_cache(writer, str(tmp_path / "cache"), top_k=writer.vocab_size, log_prob_dtype="float32")
    sp = run(long_pair, tmp_path / "sp", "sp", 2, str(tmp_path / "cache"), env={"SP_WORKER_LORA": "1"})
    dp = run(long_pair, tmp_path / "dp", "dp", 1, str(tmp_path / "cache"), env={"SP_WORKER_LORA": "1"})
    assert any("lora_A" in name for name in sp[0]["weights"])
    assert_same_run(sp, dp)


@pytest.mark.distributed
def test_sp2_from_a_served_teacher_on_rows_of_odd_length_trains_as_without(served, tmp_path):
    """A real vLLM server of the teacher answers for whole rows of 63 tokens (its context is 128), which do not split
    over 2 ranks: each batch is padded to 64 (DeepSpeed refused 63 before), the pad learns nothing, and each rank
    keeps its positions' part of the top-64: the run computes what the data-parallel one on the unpadded rows does."""
    pair, env = Path(served["teacher"]).parent, {"SP_WORKER_ARGS": '{"temperature": 1.0}'}
    sp = run(pair, tmp_path / "sp", "sp", 2, served["url"], tokens=63, env=env)
    dp = run(pair, tmp_path / "dp", "dp", 1, served["url"], tokens=63, env=env)
    assert_same_run(sp, dp)
    assert sp[0]["seen"] == [[32, 64]]


def test_a_signal_of_whole_rows_is_split_by_position():
    labels = torch.tensor([[-100, -100, 5, 6, 7, 8], [-100, 3, 4, -100, 9, 1]])
    # loss tokens (the shifted labels): row 0 at 1..4, row 1 at 0, 1, 3, 4; width 6 split in two shards of 3
    count = int((labels[:, 1:] != -100).sum())
    signal = SparseTeacherSignal(torch.arange(count)[:, None], torch.zeros(count, 1), torch.arange(count).float())
    holder = SignalHolder(signal)
    holder.labels = labels
    first, second = (shard_signal(holder, signal, 3, rank) for rank in (0, 1))
    assert first.ids.squeeze(1).tolist() == [0, 1, 4, 5]  # row 0 at 1, 2; row 1 at 0, 1
    assert second.ids.squeeze(1).tolist() == [2, 3, 6, 7]  # row 0 at 3, 4; row 1 at 3, 4
    assert shard_signal(SignalHolder(signal), signal, 6, 0) is signal  # not split: as it is


def test_the_step_pass_under_sequence_parallelism_needs_one_length():
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "shift_labels": torch.ones(1, 4, dtype=torch.long)}
    longer = {k: torch.ones(1, 6, dtype=torch.long) for k in batch}
    assert plain_rows([batch, batch], same_width=True) is None
    assert plain_rows([batch, longer]) is None
    assert "differ in length" in plain_rows([batch, longer], same_width=True)


def test_the_config_refuses_before_anything_else(tmp_path):
    """One process, sequence_parallel_size 2: refused as the run is resolved (`run_plan.resolve`), before the
    DeepSpeed student the size needs is looked at (a config built without it, so that none is set up here)."""
    args = DistillationConfig(output_dir=str(tmp_path), sequence_parallel_size=2, use_cpu=True)
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 must divide the number of processes \(1\)"):
        resolve(args)


@pytest.mark.parametrize("overrides, message", [
    ({"sequence_parallel_size": 3}, "must divide the number of processes (2)"),
    ({"sequence_parallel_attn_implementation": "eager"}, "cannot wrap attn_implementation='eager'"),
    ({"deepspeed": None}, "needs a DeepSpeed student"),
    ({"lmbda": 0.5}, "on-policy (lmbda > 0) and seq_kd"),
    ({"packing": True}, "cannot keep packed documents apart"),
    ({"teachers": ["a=./a", "b=./b"]}, "takes one teacher"),
])
def test_what_cannot_combine_is_refused_as_the_config_is_built(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as error:
        check_sequence_parallel_args(sp_args(**overrides))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def sp_args(size: int = 2, **overrides) -> SimpleNamespace:
    """The fields `check_sequence_parallel_args` reads, as a config of a `size`-process run has them (a whole
    `DistillationConfig` would set up that many processes)."""
    fields = dict(sequence_parallel_size=size, sequence_parallel_attn_implementation="sdpa", parallelism_config=None,
                  deepspeed=ZERO2, lmbda=0.0, seq_kd=False, teachers=None, cross_tokenizer=None,
                  teacher_tokenizer_name_or_path=None, packing=False, padding_free=False, auto_find_batch_size=False,
                  model_init_kwargs=None, teacher_model_init_kwargs=None)
    return SimpleNamespace(**{**fields, **overrides})


def test_both_models_load_with_the_exchanged_attention(monkeypatch, tiny_pair, tmp_path):
    """The student through the config SFTTrainer loads it with; the teacher through the plan (the config keeps its
    own kwargs as written), unless its kwargs name an attention."""
    config = DistillationConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)  # (one process)
    plain = resolve(config)
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = sp_args()
    check_sequence_parallel_args(args)
    assert args.parallelism_config.sp_size == 2 and args.parallelism_config.sp_backend == "deepspeed"
    assert args.parallelism_config.sp_handler.sp_attn_implementation == "sdpa"
    assert args.model_init_kwargs["attn_implementation"] == "sdpa"
    assert args.teacher_model_init_kwargs is None and attention_implementation(args) == "sdpa"
    plan = replace(plain, parallelism=Parallelism(True, False, 2, attention_implementation(args)))
    teacher = resolve_teacher(tiny_pair["teacher"], plan, student=tiny_pair["student"], processing_class=None,
                              eval_dataset=None, peft_config=None)
    assert teacher.init_kwargs["attn_implementation"] == "sdpa"
    own = {"attn_implementation": "eager", "revision": "main"}  # teacher_model_init_kwargs naming its own attention
    plan = replace(plan, teacher_settings=replace(plan.teacher_settings, init_kwargs=own))
    teacher = resolve_teacher(tiny_pair["teacher"], plan, student=tiny_pair["student"], processing_class=None,
                              eval_dataset=None, peft_config=None)
    assert teacher.init_kwargs == {"attn_implementation": "eager", "revision": "main"}


def test_accelerates_own_parallelism_config_gets_the_attention(monkeypatch):
    """`ParallelismConfig(sp_backend="deepspeed", sp_size=2)` as accelerate's docs write it (no handler settings)."""
    from accelerate import ParallelismConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    args = sp_args(1, parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))
    check_sequence_parallel_args(args)
    assert sequence_parallel_size(args) == 2 and args.sequence_parallel_size == 1  # the config as written
    assert args.parallelism_config.sp_handler.sp_attn_implementation == "sdpa"
    assert attention_implementation(args) == "sdpa" and args.teacher_model_init_kwargs is None  # (the plan's)


def test_accelerates_own_parallelism_config_refuses_what_cannot_be_split(monkeypatch):
    """The size given only in accelerate's `ParallelismConfig` (the field left at 1) refuses what the field's size
    refuses: generation-based evaluation and a teacher's own prompt, one line each."""
    from accelerate import ParallelismConfig

    from trl_distill.evaluation.checks import check_generation_eval_args
    from trl_distill.teacher.privileged import check_teacher_prompt_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    size_in_accelerate = dict(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))
    evaluation = sp_args(1, **size_in_accelerate, num_generations_eval=1, eval_temperature=None,
                         eval_max_new_tokens=None, eval_generation_prompts=None, eval_reward_funcs="exact_match",
                         eval_answer_column=None, eval_answer_pattern=None, eval_packing=None)
    with pytest.raises(ValueError, match=r"eval_reward_funcs\) with sequence_parallel_size > 1 is not supported"):
        check_generation_eval_args(evaluation)
    check_generation_eval_args(sp_args(1, **{**vars(evaluation), "parallelism_config": None}))  # without it: fine
    prompt = sp_args(1, **size_in_accelerate, teacher_prompt="{prompt}")
    with pytest.raises(ValueError, match="rows are split over ranks under sequence parallelism"):
        check_teacher_prompt_args(prompt)

def test_models_that_cannot_be_split_are_refused_before_loading():
    size = sequence_parallel_size(sp_args(4))
    tokenizer = build_tokenizer()
    with pytest.raises(ValueError, match=r"The teacher's 2 attention heads are not divisible by "
                                         r"sequence_parallel_size=4"):
        check_sequence_parallel_models(size, {"teacher": tiny_llama_config(tokenizer, num_attention_heads=2)})
    with pytest.raises(ValueError, match=r"The student's 4 key/value heads and sequence_parallel_size=4|"
                                         r"BloomForCausalLM\) does not route its attention"):
        check_sequence_parallel_models(size, {"student": BloomConfig(n_head=4, hidden_size=32)})
    check_sequence_parallel_models(size, {"student": tiny_llama_config(tokenizer, num_attention_heads=4)})


def test_the_position_ids_collator_adds_positions_and_pickles():
    import pickle

    from trl_distill.data.batch import PositionIdsCollator

    def collate(examples):
        return {"input_ids": torch.ones(len(examples), 3, dtype=torch.long), "labels": torch.ones(len(examples), 3)}

    collate.padding_free = False
    wrapped = PositionIdsCollator(collate)
    batch = wrapped([{}, {}])
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert wrapped.padding_free is False
    collate.pad_token_id = 7
    padded = PositionIdsCollator(collate, multiple=4)([{}, {}])  # width 3 over a sequence-parallel size of 4
    assert padded["input_ids"].tolist() == [[1, 1, 1, 7]] * 2 and padded["labels"].tolist() == [[1, 1, 1, -100]] * 2
    assert padded["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    copy = pickle.loads(pickle.dumps(PositionIdsCollator(dict)))  # a DataLoader worker gets a pickled collator
    assert copy.collator is dict
