"""The student's on-policy completions sampled by the rollout server (``use_vllm``), its weights synced from the
trainer before the first rollout and every `vllm_sync_steps` optimizer steps after (`weight_sync`).

Each rank samples its own rows. A row's sampling seed is a pure function of ``(seed, step, rank, micro-batch,
row)``, so a resumed run samples what the uninterrupted one did (the server holding the same weights: resume at a
multiple of `vllm_sync_steps`). A fault on any rank (the server down, dying, answering nonsense, a sync failing)
stops every rank with its one line; a sync that cannot finish is bounded by `vllm_server_timeout`.
"""

from __future__ import annotations

import time

import torch

from ..errors import ExternalError
from ..runtime.distributed import first_failure
from .engine_client import RolloutServerClient, RolloutServerError, server_url
from .sampling import Sampling
from .weight_sync import EngineWeightSync

# What `take_stats` counts: rows and tokens sampled, rows ended by EOS, the sum of the engine's log-probs of the
# sampled tokens; then (from the loss) the sums of |gap| and gap (trainer − engine log-prob) and the tokens scored.
COUNTS = ("rows", "tokens", "ended", "logprob", "abs_gap", "gap", "scored")


def row_seed(seed: int, step: int, rank: int, micro: int, row: int) -> int:
    """The sampling seed of one row: distinct per (step, rank, micro-batch, row), the same on resume."""
    return (((seed * 1_000_003 + step) * 1_009 + rank) * 10_007 + micro) * 100_003 + row & (2**62 - 1)


class EngineRollouts:
    """A `DistillationTrainer`'s rollout server: `sample` returns each prompt's completion (token ids). Without
    `syncs` (a served teacher sampling for `seq_kd`: `client` is its server) nothing is synced or checked here."""

    def __init__(self, context, client: RolloutServerClient | None = None, syncs: bool = True, salt: int = 0):
        self.context, args = context, context.args
        self.client = client or RolloutServerClient(
            server_url(args.vllm_server_base_url, args.vllm_server_host, args.vllm_server_port),
            timeout=args.vllm_server_timeout)
        self.syncs, self.salt = syncs, salt  # salt: another seed stream per engine (the student's is 0)
        self.sync = None
        self.synced_step = None  # the optimizer step whose weights the server holds
        self.micro = (None, 0)  # (step, micro-batches sampled in it)
        self.seconds = {"generate": 0.0, "sync": 0.0}
        self.counts = dict.fromkeys(COUNTS, 0.0)

    def _stop(self, message: str | None, rank_error=None) -> None:
        """Every rank at once: raise the lowest rank's fault (if any) with where to resume from."""
        first = first_failure(message, self.context.accelerator)
        if first is None:
            return
        rank, text = first
        whose = "" if message is not None else f" (met by rank {rank}; every rank stopped)"
        error = type(rank_error) if isinstance(rank_error, ExternalError) else RolloutServerError
        raise error(f"{text}{whose} Stopped at step {self.context.step + 1}: resume from the last "
                    "complete checkpoint with --resume_from_checkpoint true once the server is fixed.") from rank_error

    def _guarded(self, action) -> None:
        failure = None
        try:
            action()
        except (ExternalError, ValueError) as error:
            failure = error
        self._stop(None if failure is None else str(failure), failure)

    def _connect(self) -> None:
        run = self.context
        self._guarded(lambda: self.client.connect(run.tokenizer))
        self.sync = EngineWeightSync(self.client, is_sender=run.accelerator.is_main_process,
                                     group_port=run.args.vllm_group_port, timeout=run.args.vllm_server_timeout)
        self._guarded(self.sync.connect)

    def _push(self, step: int) -> None:
        """The student's weights of `step` into the server (every rank takes part; a ZeRO-3 student gathers)."""
        student = self.context.accelerator.unwrap_model(self.context.wrapped)
        self._guarded(lambda: self.sync.push(student, step))  # also the barrier: no rank samples stale weights
        self.synced_step = step
        self.seconds["sync"] += self.sync.take_seconds()

    def sample(self, prompts: list[torch.Tensor], eos_ids: list[int],
               sampling: Sampling | None = None) -> tuple[list[torch.Tensor], list[list[float]]]:
        """One completion per prompt, by the student as of this optimizer step (synced first when due), and the
        engine's log-prob of each of its tokens. `sampling` (evaluation): its settings and seed instead of
        training's; the server is synced to the current step first, and nothing is counted for the training logs."""
        run, args = self.context, self.context.args
        step = run.step
        if self.syncs and self.sync is None:
            self._connect()
        due = self.synced_step is None or step != self.synced_step and (
            sampling is not None or step % args.vllm_sync_steps == 0)
        if self.syncs and due:
            self._push(step)
        if sampling is None:
            micro = self.micro[1] if self.micro[0] == step else 0
            self.micro = (step, micro + 1)
            rank = run.accelerator.process_index
            seeds = [row_seed(args.seed + self.salt, step, rank, micro, row) for row in range(len(prompts))]
            sampling = run.plan.on_policy.sampling  # training's, as HF generate's (`CompletionSampler.sample`)
            counted = True
        else:
            seeds = [row_seed(sampling.seed, 0, 0, 0, row) for row in range(len(prompts))]
            counted = False
        started, rollouts, failure = time.perf_counter(), [], None
        try:
            rollouts = self.client.sample([p.tolist() for p in prompts], seeds, max_tokens=sampling.max_new_tokens,
                                          temperature=sampling.temperature, top_p=sampling.top_p,
                                          top_k=sampling.top_k, stop_token_ids=eos_ids)
        except (ExternalError, ValueError) as error:
            failure = error
        self._stop(None if failure is None else str(failure), failure)
        if counted:
            self.seconds["generate"] += time.perf_counter() - started
            self.counts["rows"] += len(rollouts)
            self.counts["tokens"] += sum(len(r.token_ids) for r in rollouts)
            self.counts["ended"] += sum(r.ended for r in rollouts)
            self.counts["logprob"] += sum(sum(r.logprobs) for r in rollouts)
        device = prompts[0].device
        return [torch.tensor(r.token_ids, dtype=prompts[0].dtype, device=device) for r in rollouts], [
            r.logprobs for r in rollouts]

    def take_stats(self) -> list[float]:
        """``[generate s, sync s, *COUNTS]`` since the last call, on this rank."""
        out = [self.seconds["generate"], self.seconds["sync"], *(self.counts[k] for k in COUNTS)]
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.counts = dict.fromkeys(COUNTS, 0.0)
        return [float(v) for v in out]

    def close(self) -> None:
        self.client.close()
