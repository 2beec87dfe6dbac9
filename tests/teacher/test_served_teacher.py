"""A served teacher without a server: an unreachable or silent teacher server is one clear error after bounded
retries, never a hang, and settings a served teacher cannot honour are refused before anything starts (the tests
against a real vLLM server are in test_vllm_server.py and test_served_training.py)."""

import socket
import time

import pytest

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.runtime.distributed import free_port
from trl_distill.teacher.server_client import TeacherServerClient, TeacherServerError
from trl_distill.testing import synthetic_prompt_completion


def test_a_server_that_is_down_is_one_clear_error():
    teacher = TeacherServerClient(f"http://127.0.0.1:{free_port()}", "teacher", timeout=2, retries=2, backoff=0.01)
    with pytest.raises(TeacherServerError, match=r"did not answer /v1/completions after 3 attempts .* `vllm serve`"):
        teacher.top_k([1, 2, 3], 4)


def test_a_server_that_never_answers_times_out():
    """A socket that accepts connections and never replies (a hung server): each attempt ends at the timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        teacher = TeacherServerClient(f"http://127.0.0.1:{silent.getsockname()[1]}", "teacher", timeout=0.5, retries=1,
                                backoff=0.01)
        start = time.monotonic()
        with pytest.raises(TeacherServerError, match=r"after 2 attempts \(0.5 s timeout each\): .*timed out"):
            teacher.top_k([1, 2, 3], 4)
        assert time.monotonic() - start < 10


def test_the_trainer_refuses_a_down_server_before_training(tiny_pair, tmp_path):
    args = DistillationConfig(output_dir=str(tmp_path / "out"), teacher_server=f"http://127.0.0.1:{free_port()}",
                              report_to="none", use_cpu=True, bf16=False, max_length=64)
    with pytest.raises(TeacherServerError, match="did not answer /v1/models"):
        DistillationTrainer(tiny_pair["student"], args=args, train_dataset=synthetic_prompt_completion(8))


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=2.0), "at temperature 1 only"),
    (dict(packing=True), "set packing=False and padding_free=False"),
    (dict(teacher_server_top_k=0), "teacher_server_top_k and teacher_server_concurrency must be >= 1"),
])
def test_settings_a_served_teacher_cannot_honour_are_refused(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        DistillationConfig(output_dir=str(tmp_path), teacher_server="http://127.0.0.1:1", **bad)


def test_a_server_and_a_cache_together_are_refused(tiny_pair, tmp_path):
    args = DistillationConfig(output_dir=str(tmp_path / "out"), teacher_server="http://127.0.0.1:1",
                              teacher_cache=str(tmp_path / "cache"), report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="either --teacher_server .* or --teacher_cache"):
        DistillationTrainer(tiny_pair["student"], args=args, train_dataset=synthetic_prompt_completion(8))
