"""Generation-based evaluation: the student completes the eval split's prompts, verifiers score each completion, and
the teacher scores the student's own samples (its per-token NLL of them).

The eval rows are cut into batches of `per_device_eval_batch_size` in order, and batch ``b`` goes to rank
``b % world``: a batch holds the same rows whatever the process count, and its samples come from a seed of its own
(``seed``, batch, generation), so 2 processes log what 1 does. Every rank runs as many rounds as the busiest one
(repeating its first batch, uncounted, when it has run out): generating from a ZeRO-3 or FSDP2 model and scoring
with a partitioned teacher are collective.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..loss.diagnostics import LossDiagnostics
from ..rollout.sampling import Sampling
from .calls import RewardLogs, Verifier, as_written, plain, text_of
from .references import check_references
from .verifiers import answer_column, resolve_verifiers

if TYPE_CHECKING:
    from ..run_plan import EvaluationPlan

logger = logging.getLogger("trl_distill")
CHECKED_ROWS = 8  # the first rows of an eval split each verifier is tried on before training

# The per-rank sums an evaluation adds up (then reduced over ranks): prompts, Σ c/j (pass@1, over the prompts the
# first verifier judged j > 0 of the n completions of), Σ [c > 0] (pass@n, over the prompts it judged all n of),
# completions, their tokens, those ended by EOS, the prompts judged at all and those judged whole; then each
# verifier's score sum and count. (A None score, a row without a reference, leaves its completion out, as TRL's
# rewards do: not counted a failure.)
_FIXED = ("prompts", "pass_1", "pass_n", "completions", "tokens", "ended", "judged", "judged_all")


def gather_object(names: list) -> list:
    """Every rank's `names`, as one list (collective)."""
    from accelerate.utils import gather_object as gather

    return gather(names)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` of `n` completions correct (Chen et al., 2021):
    ``1 - C(n - c, k) / C(n, k)``."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def before_first_answer(messages: list[dict]) -> list[dict]:
    roles = [m.get("role") for m in messages]
    return messages[: roles.index("assistant")] if "assistant" in roles else messages


def first_answer(messages: list[dict]) -> str:
    """A conversation's first assistant turn's text ("" when it has none)."""
    answers = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    return text_of([answers[0]]) if answers else ""


def reference_completions(columns: dict, n: int, tokenizer, wrap: bool) -> tuple[list, list[list[int]]]:
    """The `n` rows' own completions, standing in for the student's at a set-up check as the student's reach a reward
    function (`wrap`: each as one assistant message), and their token ids (ending with EOS, as a sampled completion
    that ended): the completion column's text without the EOS text SFT's preparation appended (the student's are
    decoded without special tokens), or a conversation's first assistant turn ("" where a row has neither)."""
    if "completion" in columns:
        raw = columns["completion"]
    elif "messages" in columns:
        raw = [first_answer(m) if isinstance(m, list) else "" for m in columns["messages"]]
    else:
        raw = [""] * n
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    texts = ["" if c is None else text_of(c) for c in raw]
    texts = [t[: -len(eos)] if eos and t.endswith(eos) else t for t in texts]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + ([] if eos_id is None else [eos_id]) for t in texts]
    return ([[{"role": "assistant", "content": t}] for t in texts] if wrap else texts), ids


def warn_if_never_credited(verifier: Verifier, scores: list, completions: list, split: str) -> None:
    """One warning when a verifier gives 0 to every reference completion it judged: a student that learns to write
    them would log pass@k 0 too (an answer column that is not what the completions end with, a pattern that never
    matches), the evaluation saying nothing of the student."""
    judged = [s for s, c in zip(scores, completions, strict=True) if s is not None and text_of(c).strip()]
    if judged and not any(judged):
        logger.warning(f"{verifier.label} scores 0 on the reference completions of all {len(judged)} judged rows "
                       f"it was tried on ({split}): a student that writes them would log pass@k 0. Check what it "
                       "compares (--eval_answer_column, --eval_answer_pattern), or pick another verifier "
                       "(last_number compares the last number).")


@dataclass
class EvalSettings:
    """What one generation-based evaluation needs from the run's arguments."""

    verifiers: list[Verifier]
    answer_column: str | None
    num_generations: int
    sampling: Sampling
    batch_size: int
    max_prompts: int | None
    seed: int


def eval_settings(plan: EvaluationPlan, dataset, batch_size: int, seed: int) -> EvalSettings:
    """The settings for `dataset` (a prepared eval split) from the run's evaluation plan: the built-ins' answer
    column picked and checked."""
    funcs = list(plan.reward_funcs)
    column = answer_column(funcs, plan.answer_column, dataset.column_names,
                           "eval_reward_funcs compare with an answer column, and the eval split")
    verifiers = resolve_verifiers(funcs, column or "answer", plan.answer_pattern)
    return EvalSettings(verifiers, column, plan.num_generations, plan.sampling, batch_size, plan.max_prompts, seed)


class GenerationEvaluation:
    """One run's generation-based evaluation. It is handed what it calls, not the trainer:

    - `collate(indices)`: the prepared eval rows at `indices`, collated as the trainer collates them;
    - `sample(batch, sampling)`: ``(new_batch, completions)``, the student's completions of the batch's prompts;
    - `score(new_batch)`: the teacher's diagnostics of the sampled rows (`LossDiagnostics`); None instead of a
      function when the run's teacher cannot score sampled rows (a cache, several teachers, none);
    - `reduce(tensor)`: the sum over ranks (collective).
    """

    def __init__(self, settings: EvalSettings, tokenizer, process_index: int, num_processes: int,
                 collate: Callable, sample: Callable, score: Callable, reduce: Callable, conversational: bool):
        self.settings, self.tokenizer = settings, tokenizer
        self.rank, self.world = process_index, num_processes
        self.collate, self.sample, self.score, self.reduce = collate, sample, score, reduce
        self.conversational = conversational

    def batches(self, rows: int) -> list[range]:
        size = self.settings.batch_size
        return [range(start, min(start + size, rows)) for start in range(0, rows, size)]

    def check(self, dataset, name: str = "eval", state=None) -> None:
        """Before training (every rank alike): the verifiers' reference columns hold values (`references`), and each
        verifier scores the split's first rows, their reference completions standing in for the student's, so a
        verifier that raises or miscounts is one line now, not at the first evaluation."""
        split = "the eval split" if name == "eval" else f"the {name} eval split"
        check_references(self.settings.verifiers, dataset, split, self.settings.max_prompts, warn=self.rank == 0)
        rows = dataset.select(range(min(CHECKED_ROWS, len(dataset))))
        prompts, columns = self.prompts_and_columns(rows)
        completions, ids = reference_completions(columns, len(prompts), self.tokenizer, self.conversational)
        for verifier in self.settings.verifiers:  # (what they log here is of the references: dropped)
            scores = verifier.score(prompts, completions, columns, f"on the first rows of {split} (their reference "
                                    "completions standing in for the student's)", completion_ids=ids,
                                    trainer_state=state, **RewardLogs().kwargs())
            if self.rank == 0:
                warn_if_never_credited(verifier, scores, completions, split)

    def prompts_and_columns(self, rows) -> tuple[list, dict]:
        """The rows' prompts and columns as TRL hands them to a reward function: plain lists, as the dataset holds
        them (`as_written`: no EOS SFT appended, none of the columns its preparation added)."""
        columns = as_written({name: plain(rows[name]) for name in rows.column_names}, self.tokenizer.eos_token)
        prompts = columns.get("prompt")
        if prompts is None:  # conversational rows: the messages before the first assistant turn (what is completed)
            prompts = [before_first_answer(m) for m in columns["messages"]] if "messages" in columns \
                else [None] * len(rows)
        return prompts, columns

    def completion_texts(self, completions: list[torch.Tensor]) -> tuple[list, list[list[int]]]:
        eos = self.tokenizer.eos_token_id
        ids = [c.tolist() for c in completions]
        texts = [self.tokenizer.decode([t for t in row if t != eos], skip_special_tokens=True) for row in ids]
        if self.conversational:
            return [[{"role": "assistant", "content": text}] for text in texts], ids
        return texts, ids

    @torch.no_grad()
    def run(self, dataset, state=None, running: bool = False) -> dict[str, float]:
        """Generate, verify and score over `dataset` (collective); `state`: the Trainer's (its step is named in a
        verifier's fault; TRL's ``trainer_state``), `running`: during training. The metrics, without ``eval_``."""
        settings, started = self.settings, time.perf_counter()
        step = 0 if state is None else state.global_step
        rows = len(dataset) if settings.max_prompts is None else min(len(dataset), settings.max_prompts)
        batches = self.batches(rows)
        n, names = settings.num_generations, [v.name for v in settings.verifiers]
        sums = torch.zeros(len(_FIXED) + 2 * len(names), dtype=torch.float64)
        scored = LossDiagnostics("cpu")
        logged = RewardLogs()  # what the verifiers log (TRL's log_metric), as eval metrics
        for round_ in range(math.ceil(len(batches) / self.world) if batches else 0):
            index = round_ * self.world + self.rank
            counted = index < len(batches)
            rows_of = batches[index if counted else 0]
            subset = dataset.select(rows_of)
            batch = self.collate(rows_of)
            prompts, columns = self.prompts_and_columns(subset)
            correct = torch.zeros(len(rows_of), dtype=torch.float64)
            judged = torch.zeros(len(rows_of), dtype=torch.float64)  # the first verifier's non-None scores
            for generation in range(n):
                seed = (settings.seed * 1_000_003 + index * 1_009 + generation) & (2**62 - 1)
                sampling = Sampling(settings.sampling.max_new_tokens, settings.sampling.temperature,
                                    settings.sampling.top_p, settings.sampling.top_k, seed)
                new_batch, completions = self.sample(batch, sampling)
                measured = self.score(new_batch) if self.score is not None else None
                if not counted:
                    continue
                if measured is not None:
                    scored.merge(measured)
                texts, ids = self.completion_texts(completions)
                sums[3] += len(ids)
                sums[4] += sum(len(row) for row in ids)
                sums[5] += sum(bool(row) and row[-1] == self.tokenizer.eos_token_id for row in ids)
                for i, verifier in enumerate(settings.verifiers):
                    scores = verifier.score(prompts, texts, columns, f"in the evaluation at step {step}", running,
                                            completion_ids=ids, trainer_state=state, **logged.kwargs())
                    valid = [s for s in scores if s is not None]
                    sums[len(_FIXED) + 2 * i] += sum(valid)
                    sums[len(_FIXED) + 2 * i + 1] += len(valid)
                    if i == 0:
                        correct += torch.tensor([s is not None and s >= 1.0 for s in scores], dtype=torch.float64)
                        judged += torch.tensor([s is not None for s in scores], dtype=torch.float64)
            if counted:
                sums[0] += len(rows_of)
                sums[1] += float((correct / judged.clamp(min=1)).sum())
                sums[2] += sum(pass_at_k(n, int(c), n) for c, j in zip(correct.tolist(), judged.tolist(), strict=True)
                               if j == n)
                sums[6] += float((judged > 0).sum())
                sums[7] += float((judged == n).sum())
        totals = self.reduce(torch.cat([sums, scored.sums, scored.counts]))
        fixed, verified = totals[: len(_FIXED)].tolist(), totals[len(_FIXED): len(sums)].tolist()
        metrics = {"pass@1": fixed[1] / max(fixed[6], 1.0)}
        if n > 1:
            metrics[f"pass@{n}"] = fixed[2] / max(fixed[7], 1.0)
        for i, name in enumerate(names):
            if verified[2 * i + 1] > 0:
                metrics[f"rewards/{name}/mean"] = verified[2 * i] / verified[2 * i + 1]
        metrics["generated_length"] = fixed[4] / max(fixed[3], 1.0)
        metrics["eos_rate"] = fixed[5] / max(fixed[3], 1.0)
        teacher = scored.means(*totals[len(sums):].chunk(2))
        if "teacher_ce" in teacher:
            metrics["teacher_nll"] = teacher["teacher_ce"]
        metrics["generation_prompts"] = fixed[0]
        logged.take(metrics, gather_object if self.world > 1 else None, self.reduce)
        metrics["generation_runtime"] = time.perf_counter() - started
        return metrics
