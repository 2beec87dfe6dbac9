"""The student's weights into the rollout engine, through vLLM's weight-transfer API, over gloo.

The trainer's rank 0 and the server's workers form a gloo group of their own (rank 0 holds its TCPStore; the workers
join as ranks 1..W when ``/init_weight_transfer_engine`` asks them). A sync is vLLM's round trip: ``/pause`` (no request
in flight), ``/start_weight_update``, ``/update_weights`` with the tensors' names, dtypes, shapes and chunking (answered
once the workers have loaded everything) while rank 0 broadcasts each chunk as one flat tensor,
``/finish_weight_update`` with the version (the optimizer step), ``/resume``. Every rank walks the chunks (a ZeRO-3
student is gathered chunk by chunk, an FSDP2 one weight by weight); only rank 0 talks to the server. The worker side is
``vllm_plugin/trl_distill_vllm/gloo_engine.py``.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch

from ..compat import gloo_group
from .engine_client import RolloutServerError, RolloutServerReplyError
from .student_weights import chunks, flat_chunks, student_weights

CHUNK_BYTES = 64 << 20


def address_facing(host: str) -> str:
    """This machine's address as `host` reaches it (the interface a packet to `host` leaves by)."""
    if host in ("localhost", "127.0.0.1", "0.0.0.0", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]


class EngineWeightSync:
    """Sends the student's weights to the rollout server `client` (an `engine_client.RolloutServerClient`)."""

    def __init__(self, client, *, is_sender: bool, group_port: int, timeout: float, chunk_bytes: int = CHUNK_BYTES):
        self.client, self.is_sender, self.group_port = client, is_sender, group_port
        self.timeout, self.chunk_bytes = timeout, chunk_bytes
        self.group = None
        self.seconds = 0.0  # time spent syncing, on this rank, since the last `take_seconds`

    def connect(self) -> None:
        """Rank 0 joins the server's workers in a new gloo group (both sides must arrive within the timeout)."""
        if not self.is_sender or self.group is not None:
            return
        world = 1 + self.client.world_size()
        address = address_facing(self.client.host)
        init = {"master_address": address, "master_port": self.group_port, "rank_offset": 1, "world_size": world,
                "timeout_s": self.timeout}
        store = torch.distributed.TCPStore("0.0.0.0", self.group_port, world, is_master=True,
                                           timeout=timedelta(seconds=self.timeout), wait_for_workers=False)
        self._store = store
        self.group = self._alongside(lambda: self.client.init_weight_transfer_engine(init),
                                     lambda: gloo_group(store, 0, world, self.timeout))

    def push(self, model: torch.nn.Module, version: int) -> None:
        """Send every weight of `model` (the unwrapped student); on every rank (ZeRO-3 gathers are collective)."""
        started = time.perf_counter()
        weights = student_weights(model)
        groups = chunks(weights, self.chunk_bytes)
        if not self.is_sender:
            for _ in flat_chunks(groups):
                pass
            self.seconds += time.perf_counter() - started
            return
        update = {"names": [w.name for w in weights], "dtype_names": [str(w.dtype).removeprefix("torch.")
                                                                      for w in weights],
                  "shapes": [list(w.shape) for w in weights], "chunks": [len(g) for g in groups]}
        def send():
            for flat in flat_chunks(groups):
                self.group.broadcast(flat.contiguous(), 0).wait()

        self.client.pause()
        try:
            self.client.start_weight_update()
            self._alongside(lambda: self.client.update_weights(update), send)
            self.client.finish_weight_update(str(version))
        except (RolloutServerError, RuntimeError) as error:  # RuntimeError: gloo's, the broadcast's peer gone
            raise self._sync_failure(error, version) from None
        finally:
            try:
                self.client.resume()
            except RolloutServerError:
                pass  # the error above says what went wrong; a server that died cannot resume
        self.seconds += time.perf_counter() - started

    def _sync_failure(self, error: Exception, version: int) -> RolloutServerError:
        """The one line for a sync that failed: a server that no longer answers is named as such first (whichever
        request or collective noticed it), one that answered and refused the weights is told what it must serve."""
        url = self.client.url
        if not self.client.answers():
            return RolloutServerError(f"The rollout server {url} stopped answering during the weight sync of step "
                                      f"{version} (it died or was stopped): restart it (`trl-distill vllm-serve "
                                      f"--model STUDENT`) and resume. The sync ended with: {error}")
        if isinstance(error, RolloutServerReplyError) or getattr(error, "answered", False):
            return type(error)(f"The rollout server {url} could not load the student's weights: it must serve the "
                               "student's own architecture and sizes (`trl-distill vllm-serve --model STUDENT`). "
                               f"It said: {error}")
        if isinstance(error, RolloutServerError):  # up, but too slow for the timeout: its own line says so
            return error
        return RolloutServerError(f"The student's weights could not be sent to the rollout server {url} (the gloo "
                                  f"group of the weight sync failed: {error}); check that --vllm_group_port is "
                                  "reachable from the server, then resume.")

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    @staticmethod
    def _alongside(request, local):
        """Run `request` (an HTTP call that blocks until the server's side of a collective is done) in a thread
        while this thread runs `local` (our side of it); `local`'s result, or the first error of either."""
        failure: list[BaseException] = []

        def call():
            try:
                request()
            except BaseException as error:  # noqa: BLE001 - re-raised below, in the caller's thread
                failure.append(error)

        thread = threading.Thread(target=call, daemon=True, name="trl-distill-weight-sync")
        thread.start()
        try:
            result = local()
        except BaseException:
            thread.join(timeout=5)
            if failure:
                raise failure[0] from None
            raise
        thread.join()
        if failure:
            raise failure[0]
        return result
