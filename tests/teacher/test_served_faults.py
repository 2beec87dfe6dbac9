"""A served teacher that fails mid-training stops `trl-distill` with one line naming the server and what it did, exit
status 1 and no traceback, on every rank, the last complete checkpoint kept: a real vLLM server killed mid-run, and a
stdlib HTTP server on 127.0.0.1 in front of the real one (the session fixture `served`) that passes its replies on,
then from request N on answers HTTP 500, hangs, or changes the real reply (a position short, an HTML page,
``prompt_logprobs: null``)."""

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
from scripts.fault_worker import start_ranks, stop_ranks, wait_ranks  # tests/ is on sys.path

from trl_distill.runtime.checkpoints import MARKER, is_complete
from trl_distill.testing import kill_tree, synthetic_prompt_completion, vllm_server

pytestmark = pytest.mark.distributed  # a vLLM server, and runs of the command line
ROOT = Path(__file__).parents[2]
HTML = b"<!DOCTYPE html><html><head><title>Sign in - Corporate Proxy</title></head><body>Please log in</body></html>"


class FaultServer(ThreadingHTTPServer):
    """Passes every request on to `upstream` and its reply back, until the `at`-th ``/v1/completions`` request
    made once `armed()` (the first is the trainer's probe): from it on (only it, with `once`) it fails as `fault`
    says. Requests are counted by their body, so a retry is the same request: a busy machine's slow answer, timed
    out and asked again, does not move the fault to an earlier batch. `completions` holds each attempt as
    ``(request number, time)``."""

    daemon_threads = True

    def __init__(self, upstream: str, fault: str, at: int, once: bool = False, armed=lambda: True):
        super().__init__(("127.0.0.1", 0), FaultHandler)
        self.upstream, self.fault, self.at, self.once, self.armed = upstream, fault, at, once, armed
        self.completions, self.numbers, self.lock, self.released = [], {}, threading.Lock(), threading.Event()

    def attempts(self, n: int) -> list[float]:
        """When request `n` was sent, each attempt."""
        return [at for number, at in self.completions if number == n]

    @property
    def requests(self) -> int:
        """Distinct requests (retries not counted) made once armed."""
        return len(self.numbers)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FaultHandler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.answer(None)

    def do_POST(self):
        self.answer(self.rfile.read(int(self.headers["Content-Length"])))

    def answer(self, body):
        server, faulty = self.server, False
        if self.path == "/v1/completions":
            with server.lock:
                n = server.numbers.setdefault(body, len(server.numbers) + 1) if server.armed() else 0
                server.completions.append((n, time.monotonic()))
            faulty = n > 0 and (n == server.at if server.once else n >= server.at)
        if faulty and server.fault == "hang":  # accepted, read, never answered
            server.released.wait()
            return
        if faulty and server.fault == "http_500":
            return self.send(500, b'{"error": "CUDA error: an illegal memory access was encountered"}')
        if faulty and server.fault == "html":
            return self.send(200, HTML, "text/html")
        status, raw = upstream_reply(server.upstream, self.path, body)
        if faulty and server.fault in ("positions", "null"):
            out = json.loads(raw)
            choice = out["choices"][0]
            choice["prompt_logprobs"] = None if server.fault == "null" else choice["prompt_logprobs"][:-1]
            raw = json.dumps(out).encode()
        self.send(status, raw)

    def send(self, status: int, raw: bytes, kind: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


_REPLIES, _ASKING, _ASKING_LOCK = {}, {}, threading.Lock()


def upstream_reply(upstream: str, path: str, body) -> tuple[int, bytes]:
    """The real server's answer to `body`, asked once for all fault servers: their runs train on the same batches,
    and five runs' requests at once on 2 cores would slow the real server past the runs' 2 s timeout."""
    key = (upstream, path, body)
    with _ASKING_LOCK:
        lock = _ASKING.setdefault(key, threading.Lock())
    with lock:
        if key not in _REPLIES:
            request = urllib.request.Request(upstream + path, body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as reply:
                    status, raw = reply.status, reply.read()
            except urllib.error.HTTPError as error:
                status, raw = error.code, error.read()
            if status != 200:
                return status, raw
            _REPLIES[key] = status, raw
        return _REPLIES[key]


def fault_server(upstream: str, fault: str, at: int, once: bool = False, armed=lambda: True) -> FaultServer:
    server = FaultServer(upstream, fault, at, once, armed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("served_faults") / "data.jsonl"
    synthetic_prompt_completion(48).to_json(path)
    return path


def cli_args(served, data: Path, url: str, out: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", served["student"], "--teacher_server", url, "--teacher_model_name_or_path",
            "teacher", "--teacher_server_top_k", "4", "--dataset_name", str(data), "--output_dir", str(out),
            "--max_steps", "8", "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "2",
            "--logging_steps", "1", "--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none",
            "--disable_tqdm", "true", "--max_length", "64", "--teacher_server_timeout", "2", *extra]


def one_line(rank, fragment: str) -> str:
    """The rank's stderr is the one ``trl-distill: error:`` line holding `fragment` (warnings from the libraries
    before it aside), and no traceback."""
    err = rank.err
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("trl-distill")]
    assert len(errors) == 1 and errors[0].startswith("trl-distill: error: ") and fragment in errors[0], err[-3000:]
    assert err.rstrip().endswith(errors[0]), err[-3000:]  # the last thing it printed
    return errors[0]


def checkpoints(out: Path) -> dict[str, bool]:
    """``{checkpoint-N: marked complete and whole}``."""
    return {p.name: (p / MARKER).exists() and is_complete(p) for p in sorted(out.glob("checkpoint-*"))}


# The request that fails is the 5th: the probe, then batches 1-4; batch 4 is requested while step 3 trains, and
# read by step 4's loss. checkpoint-2 was written whole before.
FAULTS = {
    "http_500": "answered /v1/completions with HTTP 500 Internal Server Error '{\"error\": \"CUDA error",
    "hang": "timed out (accepted, no answer within --teacher_server_timeout)",
    "positions": "returned prompt_logprobs for",
    "html": "with HTTP 200 but not JSON (text/html: '<!DOCTYPE html>",
    "null": "returned no prompt_logprobs (got null) for a prompt",
}


@pytest.fixture(scope="module")
def fault_runs(served, data, tmp_path_factory) -> dict:
    """One 1-process run per fault, all at once (their retries and timeouts overlap): ``{fault: (rank, server,
    output_dir)}``, every run over. The "null" run fetches in a DataLoader worker, the others on request threads."""
    tmp, runs = tmp_path_factory.mktemp("fault_runs"), {}
    try:
        for fault in FAULTS:
            server = fault_server(served["url"], fault, at=5)
            args = cli_args(served, data, server.url, tmp / fault, "--teacher_server_concurrency", "1",
                            "--dataloader_num_workers", "1" if fault == "null" else "0")
            runs[fault] = (start_ranks(args, tmp / f"{fault}_logs")[0], server, tmp / fault)
        codes = wait_ranks([rank for rank, _, _ in runs.values()], timeout=180)
        assert codes == [1] * len(FAULTS), {f: r.err[-2000:] for f, (r, _, _) in runs.items()}
        yield runs
    finally:
        for rank, server, _ in runs.values():
            stop_ranks([rank])
            server.released.set()
            server.shutdown()


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_server_fault_mid_training_is_one_line_and_keeps_the_checkpoint(fault_runs, fault):
    rank, server, out = fault_runs[fault]
    line = one_line(rank, FAULTS[fault])
    assert server.url in line and "Stopped at step 4: resume from the last complete checkpoint" in line
    assert checkpoints(out) == {"checkpoint-2": True}
    assert "model.safetensors" not in {p.name for p in out.iterdir()}  # no final save
    if fault in ("http_500", "hang"):  # retried 3 times; the next request (queued behind it, taken up by the thread
        # as it gave up) made one attempt at most: it was cancelled, its retries stopped
        assert len(server.attempts(5)) == 4 and server.requests in (5, 6), server.completions
        assert len(server.attempts(6)) <= 1, server.completions
        assert ("on all 4 attempts: it fails on this request" if fault == "http_500" else
                "after 4 attempts (2 s timeout each)") in line
    else:  # a reply no retry would change: not retried (a DataLoader worker goes on to fetch the 2 batches after
        # the one the loader holds ahead, whatever their answers)
        assert len(server.attempts(5)) == 1, server.completions
        assert server.requests in (range(5, 9) if fault == "null" else (5, 6)), server.completions
    if fault == "hang":  # the process left as the error arrived, not after the requests still waiting
        assert rank.ended - server.attempts(5)[0] < 4 * 2 + 7 + 10


def test_a_fault_one_rank_meets_stops_both_ranks_with_its_line(served, data, tmp_path):
    """2 processes (ZeRO-2 student): the first request made once checkpoint-2 is complete, and it alone, comes back a
    position short; the rank that sent it and the other one both stop at the same step with its message."""
    out = tmp_path / "out"
    server = fault_server(served["url"], "positions", at=1, once=True,
                          armed=lambda: (out / "checkpoint-2" / MARKER).exists())
    args = cli_args(served, data, server.url, out, "--deepspeed", str(ROOT / "configs/deepspeed/zero2_student.json"))
    ranks = start_ranks(args, tmp_path / "logs", nproc=2)
    try:
        assert wait_ranks(ranks, timeout=240) == [1, 1], [r.err[-3000:] for r in ranks]
    finally:
        stop_ranks(ranks)
        server.shutdown()
    lines = [one_line(rank, "returned prompt_logprobs for") for rank in ranks]
    assert sum("(met by rank" in line for line in lines) == 1
    assert len({line.split(" Stopped at step ")[1] for line in lines}) == 1  # the same step on both
    assert abs(ranks[0].ended - ranks[1].ended) < 10
    saved = checkpoints(out)
    assert saved["checkpoint-2"] and all(saved[name] for name in saved if (out / name / MARKER).exists()), saved


def test_a_vllm_server_killed_mid_training_is_one_line(served, data, tmp_path):
    """A real vLLM server of its own, killed (SIGKILL) once checkpoint-2 is complete: the next request finds nothing
    listening, is retried 3 times with backoff, then the run stops with one line."""
    with vllm_server(served["teacher"]) as url:
        port = url.rsplit(":", 1)[1]
        vllm = [p for p in psutil.process_iter(["cmdline"])
                if "vllm.entrypoints.openai.api_server" in " ".join(p.info["cmdline"] or ())
                and port in (p.info["cmdline"] or ())]
        assert len(vllm) == 1
        out = tmp_path / "out"
        ranks = start_ranks(cli_args(served, data, url, out, "--max_steps", "400"), tmp_path / "logs")
        try:
            deadline = time.monotonic() + 120
            while not (out / "checkpoint-2" / MARKER).exists() and ranks[0].poll() is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            kill_tree(vllm[0].pid)
            killed = time.monotonic()
            assert wait_ranks(ranks, timeout=120) == [1], ranks[0].err[-3000:]
        finally:
            stop_ranks(ranks)
    line = one_line(ranks[0], "did not answer /v1/completions after 4 attempts (2 s timeout each): ")
    assert "Connection refused" in line and "Is `vllm serve` running there?" in line
    assert ranks[0].ended - killed < 7 + 4 * 2 + 10
    saved = checkpoints(out)
    marked = [name for name in saved if (out / name / MARKER).exists()]
    assert marked and all(saved[name] for name in marked), saved  # every checkpoint marked complete is whole
    assert "model.safetensors" not in {p.name for p in out.iterdir()}
