import os
from pathlib import Path

import pytest
import torch
from rank_pool import RankPool
from transformers import AutoTokenizer

from trl_distill import testing
from trl_distill.runtime.process_setup import prepare_process
from trl_distill.testing import (
    VLLM_VENV,
    build_sentencepiece_style_tokenizer,
    build_tiny_model,
    build_tokenizer,
    launch,
    read_rank_records,
    save_tiny_pair,
    vllm_server,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No test reaches a hub: a name that is not a local path asks a closed port on this machine, never an outside address
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
prepare_process()  # as a run's process does before DeepSpeed: the suite's own warnings quiet, its build directory
SCRIPTS = Path(__file__).parent / "scripts"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session", autouse=True)
def shared_ranks():
    """The session's shared ranks (tests/rank_pool.py): every torchrun launch of 2 processes runs there as a job,
    started on the first one; a test that kills or freezes a rank launches on its own (``own_launch=True``). They
    first start over a stale build lock, as a killed first launch leaves it (tests/runtime/test_build_locks.py)."""
    pool = RankPool(plant_stale_lock=True)
    testing.use_shared_ranks(pool)
    yield pool
    testing.use_shared_ranks(None)
    pool.close()


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict[str, str]:
    """A tokenizer, a teacher and a student saved with `save_pretrained` (loaded by path, as from the hub)."""
    return save_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session")
def zero2_zero3_runs(tiny_pair, tmp_path_factory) -> dict:
    """The 2-process runs of tests/scripts/distill_worker.py: ZeRO-2 student, ZeRO-3 teacher, DeepSpeed on CPU.

    Returns ``{"main": [rank0, rank1], "resume": [...], "divergences": [...], "zero3_student": [...],
    "ddp": [...], "dir": Path}``.
    """
    out = tmp_path_factory.mktemp("zero2_zero3")
    worker = SCRIPTS / "distill_worker.py"
    pair = str(Path(tiny_pair["teacher"]).parent)
    launch(worker, pair, str(out), "main", timeout=600)  # the first launch may build DeepSpeed's CPU comm op
    launch(worker, pair, str(out), "resume", str(out / "main" / "checkpoint-8"), timeout=300)
    launch(worker, pair, str(out), "divergences", timeout=300)
    launch(worker, pair, str(out), "zero3_student", timeout=300)
    launch(worker, pair, str(out), "ddp", timeout=300)
    runs = {mode: read_rank_records(out / mode) for mode in ("main", "resume", "divergences", "zero3_student", "ddp")}
    runs["dir"] = out
    return runs


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> dict:
    """A real vLLM server (its own venv, `make vllm-env`) serving a tiny fp32 teacher, started once per session.

    The teacher has head_dim 64 (vLLM's CPU attention refuses the 16 of the usual tiny models); a tiny student with
    the same tokenizer is saved beside it. Returns ``{"url", "teacher" (its directory), "student", "model" (the
    teacher, in this process), "tokenizer"}``. Skips, with the reason, where the venv is absent.
    """
    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.skip(f"no vLLM venv at {VLLM_VENV}: run `make vllm-env` to run the served-teacher tests")
    directory = tmp_path_factory.mktemp("served")
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, "teacher", hidden_size=128, num_attention_heads=2, intermediate_size=256,
                             num_hidden_layers=2).eval()
    with torch.no_grad():
        model.model.norm.weight.fill_(8.0)  # logits 8x: a peaked teacher, so top-k KD is far from zero
    paths = {"teacher": str(directory / "teacher"), "student": str(directory / "student")}
    model.save_pretrained(paths["teacher"])
    build_tiny_model(tokenizer, "student", seed=1).save_pretrained(paths["student"])
    for path in paths.values():
        tokenizer.save_pretrained(path)
    with vllm_server(paths["teacher"]) as url:
        yield {"url": url, **paths, "model": model, "tokenizer": tokenizer}


@pytest.fixture(scope="session")
def rollout_server(tmp_path_factory) -> dict:
    """A real vLLM server of a tiny fp32 student, started as `trl-distill vllm-serve` starts one (weight-transfer
    routes, our gloo engine), once per session; its weights are the trainers' to sync. The student has head_dim 32
    (vLLM's CPU attention refuses 16) and shares the other tiny models' tokenizer. Returns ``{"url", "student"
    (its directory), "tokenizer"}``. Skips, with the reason, where the venv is absent."""
    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.skip(f"no vLLM venv at {VLLM_VENV}: run `make vllm-env` to run the rollout-server tests")
    directory = tmp_path_factory.mktemp("rollout") / "student"
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, "student", seed=1, hidden_size=64, num_attention_heads=2).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with vllm_server(directory, name="student", rollout=True) as url:
        yield {"url": url, "student": str(directory), "tokenizer": tokenizer}


# Fixtures that launch several processes: a test using one is a multi-process test, marked or not
MULTI_PROCESS_FIXTURES = {"zero2_zero3_runs", "lora_runs", "bf16_and_fp32_runs", "runs", "smoke", "step_runs",
                          "metrics_runs", "rollout_runs", "expendable_server",
                          "served", "rollout_server", "documented_server"}


# Fixtures that start a vLLM server
SERVER_FIXTURES = {"served", "rollout_server", "expendable_server", "documented_server"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """`make test-fast` runs ``-m "not distributed"``: keep every multi-process test out of it. Under pytest-xdist
    (``make test``: ``-n 2 --dist loadgroup``) the multi-process tests run in two groups, each on one worker and in
    order: those with a vLLM server (the session's servers start once, on that worker) and the others (on the other
    worker); each worker has its own shared ranks. The one-process tests fill both workers."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if MULTI_PROCESS_FIXTURES & fixtures:
            item.add_marker(pytest.mark.distributed)
        if item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.xdist_group("vllm" if SERVER_FIXTURES & fixtures else "distributed"))


@pytest.fixture(scope="session")
def other_teacher(tmp_path_factory) -> str:
    """A teacher with a SentencePiece-style tokenizer (▁, byte fallback) and a ChatML template whose markers are
    special tokens: the other family from the tiny students' byte-level BPE."""
    directory = tmp_path_factory.mktemp("other_teacher")
    tokenizer = build_sentencepiece_style_tokenizer(vocab_size=300)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    build_tiny_model(tokenizer, "teacher", seed=3).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def second_teacher(tiny_pair, tmp_path_factory) -> str:
    """Another teacher of the same shape and tokenizer (other weights)."""
    path = tmp_path_factory.mktemp("teacher_b") / "teacher_b"
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    build_tiny_model(tok, "teacher", seed=7).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
