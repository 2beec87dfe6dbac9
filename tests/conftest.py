import os
from pathlib import Path

import pytest

from trl_distill.testing import launch, read_rank_records, save_tiny_pair

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
SCRIPTS = Path(__file__).parent / "scripts"


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


# Fixtures that launch several processes: a test using one is a multi-process test, marked or not
MULTI_PROCESS_FIXTURES = {"zero2_zero3_runs", "lora_runs", "bf16_and_fp32_runs", "runs", "smoke", "step_runs"}


def pytest_collection_modifyitems(config, items):
    """`make test-fast` runs ``-m "not distributed"``: keep every multi-process test out of it."""
    for item in items:
        if MULTI_PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.distributed)
