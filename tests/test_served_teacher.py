"""`ServedTeacher` without a server: an unreachable teacher server is one clear error after bounded retries, never a
hang (the tests against a real vLLM server are in test_vllm_server.py)."""

import pytest

from trl_distill.distributed import free_port
from trl_distill.served_teacher import ServedTeacher


def test_a_server_that_is_down_is_one_clear_error():
    teacher = ServedTeacher(f"http://127.0.0.1:{free_port()}", "teacher", timeout=2, retries=2, backoff=0.01)
    with pytest.raises(RuntimeError, match=r"did not answer /v1/completions after 3 attempts .* Is `vllm serve`"):
        teacher.top_k([1, 2, 3], 4)
