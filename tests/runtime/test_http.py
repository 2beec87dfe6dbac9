"""`runtime.http.JsonHttpClient` against a real local HTTP/1.1 server on a thread: kept-alive connections (one per
thread), retries of 5xx with backoff, 4xx and non-JSON replies at once, timeouts, cancellation by `stop`."""

import json
import multiprocessing
import pickle
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from trl_distill.runtime.distributed import free_port
from trl_distill.runtime.http import JsonHttpClient


class Down(ConnectionError):
    pass


class BadReply(ValueError):
    pass


class Server(ThreadingHTTPServer):
    """Counts the connections it accepts and the requests per path; ``/flaky`` answers 503 `flaky` times first."""

    daemon_threads = True

    def __init__(self, flaky: int = 0):
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock, self.released = threading.Lock(), threading.Event()
        self.connections, self.requests, self.flaky = 0, Counter(), flaky

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def setup(self):  # once per connection
        super().setup()
        with self.server.lock:
            self.server.connections += 1
            self.connection_id = self.server.connections

    def do_GET(self):
        self.answer(b"")

    def do_POST(self):
        self.answer(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def answer(self, body: bytes):
        server, path = self.server, urlsplit(self.path).path
        with server.lock:
            server.requests[path] += 1
            n = server.requests[path]
        if path == "/hang":  # read, never answered
            server.released.wait()
            return
        if path == "/always500" or path == "/flaky" and n <= server.flaky:
            code = 500 if path == "/always500" else 503
            return self.send(code, b'{"error": "CUDA error: an illegal memory access"}')
        if path == "/bad":
            return self.send(400, b'{"error": "max allowed is 20"}')
        if path == "/html":
            page = b"<!DOCTYPE html>\n<html><body>Please   log in</body></html>"
            return self.send(200, page, "text/html; charset=utf-8")
        reply = {"method": self.command, "query": urlsplit(self.path).query, "body": body.decode(),
                 "connection": self.connection_id, "n": n}
        self.send(200, json.dumps(reply).encode())

    def send(self, status: int, raw: bytes, kind: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    server = Server(flaky=2)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.released.set()
    server.shutdown()
    server.server_close()


def client(url: str, **kwargs) -> JsonHttpClient:
    settings = dict(timeout=5, retries=3, backoff=0.01, what="The test server", unreachable_error=Down,
                    reply_error=BadReply, address_flag="--test_server", timeout_flag="--test_server_timeout")
    return JsonHttpClient(url, **{**settings, **kwargs})


def test_requests_of_one_thread_reuse_one_connection(server):
    http = client(server.url + "/")
    replies = [http.post("/ok", {"i": i}) for i in range(10)]
    assert server.connections == 1 and server.requests["/ok"] == 10
    assert [r["connection"] for r in replies] == [1] * 10 and [r["n"] for r in replies] == list(range(1, 11))


def test_each_thread_keeps_its_own_connection(server):
    http, threads, barrier = client(server.url), 4, threading.Barrier(4, timeout=30)
    seen = {}

    def work(t):
        barrier.wait()  # all 4 at once
        seen[t] = [http.post("/ok", {"t": t})["connection"] for _ in range(5)]
        barrier.wait()  # none ends (and drops its session) before the others are done

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert server.requests["/ok"] == 20 and server.connections == 4
    assert all(len(set(ids)) == 1 for ids in seen.values()) and len({ids[0] for ids in seen.values()}) == 4


def test_close_and_a_pickled_copy_open_new_connections(server):
    http = client(server.url)
    assert http.get("/ok")["connection"] == 1 and http.get("/ok")["connection"] == 1
    http.close()
    assert http.get("/ok")["connection"] == 2
    copy = pickle.loads(pickle.dumps(http))
    assert copy.get("/ok")["connection"] == 3 and http.get("/ok")["connection"] == 2 and server.connections == 3


def _connection_in_child(http, out):
    out.put(http.get("/ok")["connection"])


def test_a_forked_child_opens_its_own_connection(server):
    """(A DataLoader worker is forked from the process that set the served teacher up: it must never write on the
    parent's kept-alive socket.)"""
    http, fork = client(server.url), multiprocessing.get_context("fork")
    assert http.get("/ok")["connection"] == 1
    out = fork.Queue()
    child = fork.Process(target=_connection_in_child, args=(http, out))
    child.start()
    assert out.get(timeout=30) == 2
    child.join(30)
    assert child.exitcode == 0 and http.get("/ok")["connection"] == 1 and server.connections == 2


def test_get_post_bodies_and_query_params(server):
    http = client(server.url)
    assert http.post("/echo", {"a": [1, 2]}) | {"connection": 0, "n": 0} == {
        "method": "POST", "query": "", "body": '{"a": [1, 2]}', "connection": 0, "n": 0}
    empty = http.post("/echo", params={"x": "1"})
    assert (empty["method"], empty["query"], empty["body"]) == ("POST", "x=1", "")
    got = http.get("/echo", params={"q": "a b"})
    assert (got["method"], got["query"], got["body"]) == ("GET", "q=a+b", "")


def test_5xx_is_retried_with_backoff_then_answers(server):
    http = client(server.url, backoff=0.1)
    start = time.monotonic()
    reply = http.post("/flaky", {})
    assert reply["n"] == 3 and server.requests["/flaky"] == 3  # 503, 503, then 200
    assert 0.1 + 0.2 <= time.monotonic() - start < 3


def test_5xx_on_every_attempt_is_one_error_naming_it(server):
    with pytest.raises(Down) as error:
        client(server.url, retries=2).post("/always500", {})
    assert str(error.value) == (
        f"The test server {server.url} answered /always500 with HTTP 500 Internal Server Error "
        "'{\"error\": \"CUDA error: an illegal memory access\"}' on all 3 attempts: it fails on this request (see its "
        "log); fix or restart it.")
    assert server.requests["/always500"] == 3 and server.connections == 1


def test_4xx_is_the_reply_error_at_once(server):
    with pytest.raises(BadReply) as error:
        client(server.url).post("/bad", {})
    assert str(error.value) == (f"The test server {server.url} refused /bad: HTTP 400: "
                                "'{\"error\": \"max allowed is 20\"}'")
    assert server.requests["/bad"] == 1


def test_a_reply_that_is_not_json_names_its_content_type(server):
    with pytest.raises(BadReply) as error:
        client(server.url, command="trl vllm-serve").get("/html")
    assert str(error.value) == (
        f"The test server {server.url} answered /html with HTTP 200 but not JSON (text/html: '<!DOCTYPE html> <html>"
        "<body>Please log in</body></html>'): --test_server must be the address of the vLLM server itself "
        "(http://host:port, as `trl vllm-serve` prints it), not a proxy, login or web page.")
    assert server.requests["/html"] == 1


def test_a_server_that_never_answers_times_out_on_each_attempt(server):
    start = time.monotonic()
    with pytest.raises(Down) as error:
        client(server.url, timeout=0.5, retries=1).post("/hang", {})
    elapsed = time.monotonic() - start
    assert str(error.value) == (
        f"The test server {server.url} did not answer /hang after 2 attempts (0.5 s timeout each): timed out "
        "(accepted, no answer within --test_server_timeout). Is `vllm serve` running there? Check its log; raise "
        "--test_server_timeout if it is only slow.")
    assert server.requests["/hang"] == 2 and 2 * 0.5 <= elapsed < 2 * 0.5 + 3


def test_a_server_that_is_down_is_retried_then_named():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Down, match=r"did not answer /v1/models after 3 attempts \(5 s timeout each\): "
                                   r"ConnectionRefusedError: \[Errno 111\] Connection refused\. Is `vllm serve`"):
        client(url, retries=2).get("/v1/models")


def test_an_address_that_is_not_http_is_refused_at_once():
    start = time.monotonic()
    with pytest.raises(Down, match=r"--test_server must be an http:// or https:// address"):
        client("127.0.0.1:8000", backoff=5).get("/v1/models")
    assert time.monotonic() - start < 2  # no retry


def test_stop_cancels_the_retries(server):
    stop, http = threading.Event(), client(server.url, backoff=30)
    start = time.monotonic()  # before the timer starts: the stop comes at least 0.3 s after it
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(Down) as error:
        http.post("/always500", {}, stop=stop)
    assert str(error.value) == f"The request to the test server {server.url}/always500 was cancelled."
    assert server.requests["/always500"] == 1 and 0.3 <= time.monotonic() - start < 3


def test_a_stop_set_before_the_request_sends_nothing(server):
    stop, http = threading.Event(), client(server.url)
    stop.set()
    with pytest.raises(Down, match="was cancelled"):
        http.post("/ok", {}, stop=stop)
    assert server.requests["/ok"] == 0 and server.connections == 0


def test_a_threads_session_outlives_its_thread_until_close(server):
    """Freed with its thread, a Session would run urllib3's finalizers there, racing the interpreter's exit."""
    http = client(server.url)
    worker = threading.Thread(target=http.get, args=("/ok",))
    worker.start()
    worker.join(30)
    (session,) = http._sessions
    assert session.adapters["http://"].poolmanager.pools  # its connection pool is still open
    http.close()
    assert http._sessions == [] and not session.adapters["http://"].poolmanager.pools
