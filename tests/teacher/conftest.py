"""The teacher tests' own fixture: a second teacher beside the session's tiny pair."""

import pytest
from transformers import AutoTokenizer

from trl_distill.testing import build_tiny_model


@pytest.fixture(scope="session")
def second_teacher(tiny_pair, tmp_path_factory) -> str:
    """Another teacher of the same shape and tokenizer (other weights)."""
    path = tmp_path_factory.mktemp("teacher_b") / "teacher_b"
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    build_tiny_model(tok, "teacher", seed=7).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
