"""A served teacher without a server: an unreachable or silent teacher server is one clear error after bounded
retries, never a hang, and settings a served teacher cannot honour are refused before anything starts (the tests
against a real vLLM server are in test_vllm_server.py and test_served_training.py)."""

import socket
import time

import pytest

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.run_plan import resolve
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
        resolve(DistillationConfig(output_dir=str(tmp_path), teacher_server="http://127.0.0.1:1", **bad))


def test_a_server_and_a_cache_together_are_refused(tiny_pair, tmp_path):
    args = DistillationConfig(output_dir=str(tmp_path / "out"), teacher_server="http://127.0.0.1:1",
                              teacher_cache=str(tmp_path / "cache"), report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="either --teacher_server .* or --teacher_cache"):
        DistillationTrainer(tiny_pair["student"], args=args, train_dataset=synthetic_prompt_completion(8))


def test_a_failed_fetch_pickles_as_its_error_and_raises_where_it_is_read():
    """A DataLoader worker pickles each batch into its queue: a holder whose fetch failed must pickle (raising
    there loses the batch, and the run hangs on it) and raise the server's error where the loss reads it."""
    import pickle
    from concurrent.futures import Future

    from trl_distill.data.batch import SignalHolder

    failed = Future()
    failed.set_exception(TeacherServerError("The teacher server returned no prompt_logprobs (got null)."))
    done = Future()
    done.set_result(((1, 2), (3, 4)))
    for holder in (SignalHolder(failed), SignalHolder(None, error=failed.exception())):
        copy = pickle.loads(pickle.dumps(holder))
        with pytest.raises(TeacherServerError, match="got null"):
            _ = copy.signal
    assert pickle.loads(pickle.dumps(SignalHolder(done, build=lambda r: sum(r, ())))).signal == (1, 2, 3, 4)


_BUSY_AT_EXIT = """
import sys, time
import numpy
import torch  # loaded, as in a run: a daemon thread running Python as the interpreter finalizes aborts it
from trl_distill.teacher.served import RequestPool

def busy(stop):  # a request retrying until training stops, building its numpy arrays
    while not stop.is_set():
        numpy.unique(numpy.arange(1000) % 7)

pool = RequestPool(4)
for _ in range(8):
    pool.submit(busy)
time.sleep(0.2)
sys.exit(1)  # a run leaving on a server fault, its requests still in flight
"""


def test_a_process_leaving_with_requests_in_flight_exits_with_its_status():
    """Without the pool's exit hook, about half of these exits abort with -6 ("terminate called without an active
    exception") instead of leaving with status 1."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _BUSY_AT_EXIT], stderr=subprocess.PIPE, text=True)
             for _ in range(3)]  # at once: each spends its ~10 s importing
    for proc in procs:
        err = proc.communicate(timeout=180)[1]
        assert proc.returncode == 1 and "terminate" not in err, (proc.returncode, err[-2000:])
