"""On-policy and mixed distillation (GKD, Agarwal et al. 2023): a training batch's completions may be replaced by
ones the student (`lmbda`) or the teacher (`seq_kd`) samples for the same prompts, then distilled exactly like
dataset completions.

The student/dataset choice is drawn once per optimizer step from ``(seed, step)`` alone, so every rank draws the
same and a resumed run draws what the uninterrupted one did. Sampling from a ZeRO-3 or FSDP2 model (a partitioned
teacher, a ZeRO-3 or FSDP2 student) runs with ``synced_gpus=True``: every rank keeps taking part in its forward passes
(collectives) until all ranks are done.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch

from ..data.batch import add_extras, extras_of, pop_extra
from ..loss.rollout_correction import RolloutCorrection
from ..loss.sampled_token import SampledTokenJob
from ..runtime.fsdp2 import is_fsdp2
from ..teacher.capabilities import SEQ_KD_REFUSAL, Samples, SamplingServer, ScoresSamples, required
from .sampling import DATASET, STUDENT, Sampling, completion_source, seeded

if TYPE_CHECKING:  # annotations: the run's plan, and the rollout server's client (imported by a run that uses one)
    from ..run_plan import OnPolicyPlan
    from .engine_rollouts import EngineRollouts

# The three sources of a step's completions
def prompts_of(batch: dict) -> list[torch.Tensor]:
    """`split_prompts` of a batch, with one clear error for a row without a prompt."""
    prompts = split_prompts(batch["input_ids"], batch["labels"], batch["attention_mask"])
    if any(len(p) == 0 for p in prompts):
        raise ValueError(
            "Sampled completions (lmbda > 0 or seq_kd) need prompts, and a row has none: every token carries loss. "
            "Use a prompt-completion or conversational dataset (the completion / assistant turn is resampled)."
        )
    return prompts


def check_sampling_prompts(dataset, on_policy: OnPolicyPlan) -> None:
    """Before training: one clear error when completions are to be sampled (`lmbda` > 0, `seq_kd`) and prepared rows
    have no prompt to sample from (their first token already carries loss), with their count."""
    if not on_policy.samples:
        return
    bare = promptless_rows(dataset)
    if bare:
        raise ValueError(
            f"Sampled completions (lmbda > 0 or seq_kd) need prompts, and {bare} of the {len(dataset)} prepared train "
            "rows have none (an empty prompt, or language-modeling text: every token carries loss). Give each row "
            "a prompt (a prompt-completion or conversational dataset), or filter those rows out.")


def promptless_rows(dataset) -> int:
    """How many prepared rows have no prompt: their first token already carries loss (0 for a dataset that is not
    a prepared `datasets.Dataset`)."""
    if not hasattr(dataset, "data") or "labels" not in dataset.column_names:
        return 0
    import pyarrow.compute as pc

    labels = dataset.data.column("labels")
    lengths = pc.list_value_length(labels)
    first = pc.list_element(pc.filter(labels, pc.greater(lengths, 0)), 0)
    return int(pc.sum(pc.not_equal(first, -100)).as_py() or 0)


def split_prompts(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's prompt: the attended tokens before its first label (a row with no label keeps all its tokens)."""
    prompts = []
    for ids, row_labels, mask in zip(input_ids, labels, attention_mask):
        ids = ids[mask.bool()]
        targets = (row_labels[mask.bool()] != -100).nonzero()
        prompts.append(ids[: int(targets[0]) if len(targets) else len(ids)])
    return prompts


def left_pad(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=prompts[0].dtype, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    return ids, mask


def completion_batch(prompts: list[torch.Tensor], completions: list[torch.Tensor], pad_id: int) -> dict:
    """A right-padded training batch: prompt + completion per row, loss on the completion tokens only."""
    rows = [torch.cat([p, c]) for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=rows[0].dtype, device=rows[0].device)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, (prompt, sequence) in enumerate(zip(prompts, rows)):
        ids[row, : len(sequence)], mask[row, : len(sequence)] = sequence, 1
        labels[row, len(prompt) : len(sequence)] = sequence[len(prompt) :]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def repeated_ngrams(tokens: list[int], n: int = 4) -> tuple[int, int]:
    """``(n-grams, repeats)`` of one completion: its n-grams, and how many of them already occurred in it."""
    seen, repeats = set(), 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        repeats += gram in seen
        seen.add(gram)
    return max(len(tokens) - n + 1, 0), repeats


def trim_after_eos(generated: torch.Tensor, eos_ids: set[int]) -> list[torch.Tensor]:
    """Each row's new tokens up to and including its first end-of-sequence token."""
    out = []
    for row in generated:
        ends = [i for i, token in enumerate(row.tolist()) if token in eos_ids]
        out.append(row[: ends[0] + 1] if ends else row)
    return out


@torch.no_grad()
def sample_completions(model, batch: dict, generation_kwargs: dict, pad_id: int, eos_ids: set[int],
                       synced_gpus: bool, context=contextlib.nullcontext) -> tuple[dict, list[torch.Tensor]]:
    """Replace the batch's completions by ones `model` samples for its prompts; returns the new batch and the
    sampled completions. `context` wraps the generation (e.g. a PEFT model's `disable_adapter`)."""
    prompts = prompts_of(batch)
    ids, mask = left_pad(prompts, pad_id)
    was_training = model.training
    model.eval()
    # An MoE model whose config asks for its router logits (a student with its router loss on) would compute its
    # load-balancing loss at every decoding step, over the cache's attention mask: not while sampling
    routed = {"output_router_logits": False} if hasattr(model.config.get_text_config(), "output_router_logits") else {}
    try:
        with context():
            out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad_id, synced_gpus=synced_gpus,
                                 **routed, **generation_kwargs)
    finally:
        model.train(was_training)
    completions = trim_after_eos(out[:, ids.shape[1] :], eos_ids)
    return completion_batch(prompts, completions, pad_id), completions


def refuse_zero3_student_sampling(on_policy: OnPolicyPlan, student_plugin) -> None:
    """HF `generate` from a ZeRO-3 student is not supported: one clear error before any engine is built (the
    rollout server samples any student: `use_vllm`)."""
    if on_policy.lmbda > 0 and not on_policy.use_vllm and student_plugin is not None and student_plugin.zero_stage == 3:
        raise ValueError(
            "On-policy distillation (lmbda > 0) with a ZeRO-3 student needs its completions from the rollout server: "
            "pass --use_vllm with `trl-distill vllm-serve --model STUDENT` running, sample from a ZeRO-2 (or "
            "ZeRO-0/1) student, or set lmbda=0."
        )


class CompletionSampler:
    """A `DistillationTrainer`'s on-policy / sequence-level side: draws each step's source, samples the completions
    and counts what it sampled for the logs (`on_policy_fraction`, `generated_length`)."""

    def __init__(self, context, teacher, plan: OnPolicyPlan, task_columns: list[str] | None = None):
        self.context, self.teacher = context, teacher  # the run, and its teacher (which scores sampled rows)
        self.scorer = teacher.capability(ScoresSamples)  # asked once: a kind's capabilities are its type's
        self.plan = plan  # the run's on-policy plan: when, how and what is sampled
        self.task_rewards = None  # `task_reward_funcs`: the reward of each sampled completion
        if task_columns is not None:
            from .task_rewards import TaskRewards

            self.task_rewards = TaskRewards(plan.task_rewards, context.tokenizer, task_columns)
        # the sampled-token objective's counts since the last log: advantage, gap (and the tokens with a teacher
        # log-prob), clipped, tokens; reward, rows
        self.objective = dict.fromkeys(("advantage", "gap", "gap_tokens", "clipped", "tokens", "reward", "rewarded"),
                                       0.0)
        self.stats = dict.fromkeys(("micro_steps", "on_policy", "rows", "tokens", "ended", "ngrams", "repeated"), 0)
        self.on_policy = False  # whether the current micro-batch's completions are the student's own samples
        self.engine = None
        if plan.use_vllm:  # the rollout server
            from .engine_rollouts import EngineRollouts

            self.engine = EngineRollouts(context)
        self.teacher_engine = None  # a served teacher's server, sampling for seq_kd
        self.since = time.perf_counter()  # the start of the span the next log covers

    @property
    def tokenizer(self):
        """The student's tokenizer (a processor's)."""
        return self.context.tokenizer

    @property
    def active(self) -> bool:
        return self.plan.samples

    def maybe_resample(self, inputs: dict) -> tuple[dict, bool]:
        """The micro-batch to train on, and whether its completions were sampled (not the dataset's)."""
        run = self.context
        source = completion_source(self.plan.lmbda, self.plan.seq_kd, self.plan.seed, run.step)
        self.stats["micro_steps"] += 1
        self.on_policy = source == STUDENT
        if source == DATASET:
            return inputs, False
        columns = extras_of(inputs).task_columns
        inputs, completions = self.sample(source, run.prepare_inputs(inputs))
        if self.task_rewards is not None and source == STUDENT:  # each sample's task reward, from its row's columns
            rewards = self.task_rewards.score(columns, completions, run.step + 1, run.state)
            add_extras(inputs, task_rewards=rewards)
            self.objective["reward"] += float(rewards.sum())
            self.objective["rewarded"] += len(rewards)
        self.stats["on_policy"] += source == STUDENT
        self.stats["rows"] += len(completions)
        self.stats["tokens"] += sum(len(c) for c in completions)
        tokenizer = self.tokenizer
        self.stats["ended"] += sum(len(c) > 0 and int(c[-1]) == tokenizer.eos_token_id for c in completions)
        for completion in completions:
            grams, repeated = repeated_ngrams(completion.tolist())
            self.stats["ngrams"] += grams
            self.stats["repeated"] += repeated
        return inputs, True

    def sample(self, source: str, batch: dict, sampling: Sampling | None = None,
               score: bool = True) -> tuple[dict, list[torch.Tensor]]:
        """`batch` with its completions sampled by `source` (the student or the teacher), and those completions.
        `sampling`: other settings than training's (evaluation); `score`: have the teacher score the new rows."""
        run, tokenizer = self.context, self.tokenizer
        eos_ids = {tokenizer.eos_token_id}
        kwargs = (sampling or self.plan.sampling).generate_kwargs(sorted(eos_ids))
        engine = self._engine_for(source)
        if engine is not None:  # a vLLM server samples: the student's rollout server, or a served teacher's
            prompts = prompts_of(batch)
            completions, logprobs = engine.sample(prompts, sorted(eos_ids), sampling)
            new_batch = completion_batch(prompts, completions, tokenizer.pad_token_id)
            if engine is self.engine:  # the student's own log-probs, as the engine computed them: the loss's gap
                add_extras(new_batch, rollout_logprobs=torch.tensor([x for row in logprobs for x in row]))
        else:
            processes = run.num_processes
            if source == STUDENT:
                model, context = run.accelerator.unwrap_model(run.wrapped), contextlib.nullcontext
                plugin = run.deepspeed_plugin  # a ZeRO-3 or FSDP2 student's forward is collective
                synced = processes > 1 and (plugin is not None and plugin.zero_stage == 3 or is_fsdp2(run.accelerator))
            else:
                sampler = required(self.teacher, Samples, SEQ_KD_REFUSAL.format(self.teacher.describe()))
                model, context, synced = sampler.generation(processes)
            with seeded(sampling.seed if sampling is not None else None, batch["input_ids"].device):
                new_batch, completions = sample_completions(model, batch, kwargs, tokenizer.pad_token_id, eos_ids,
                                                            synced, context)
            new_batch = {k: v.to(batch["input_ids"].device) for k, v in new_batch.items()}
        if score and self.scorer is not None:
            self.scorer.score_sampled(new_batch, batch)
        return new_batch, completions

    def _engine_for(self, source: str) -> EngineRollouts | None:
        """The vLLM server that samples `source`'s completions, if one does (else HF `generate`)."""
        if source == STUDENT:
            return self.engine
        sampler = self.teacher.capability(SamplingServer)  # seq_kd from a served teacher: its own server
        server = None if sampler is None else sampler.sampling_server()
        if server is not None and self.teacher_engine is None:
            from .engine_rollouts import EngineRollouts

            self.teacher_engine = EngineRollouts(self.context, server, syncs=False, salt=7919)
        return self.teacher_engine if server is not None else None

    @property
    def in_loss(self) -> bool:
        """Whether a training batch may carry anything of the sampler's for the loss: sampled completions, the rollout
        engine's log-probs, the rows' task columns (an off-policy run's batches carry none)."""
        return self.plan.samples or self.engine is not None or self.task_rewards is not None

    def loss_job(self, inputs: dict, training: bool) -> tuple[RolloutCorrection | None, SampledTokenJob | None]:
        """What one micro-batch's loss takes of the sampler, off the batch: the engine's log-probs of its sampled
        tokens (`pop_correction`) and the sampled-token objective's job (`objective_job`)."""
        return self.pop_correction(inputs), self.objective_job(inputs, training)

    def pop_correction(self, inputs: dict) -> RolloutCorrection | None:
        """The engine's log-probs of a sampled batch, for the loss to measure (and, if asked, correct) the gap."""
        logprobs = pop_extra(inputs, "rollout_logprobs")
        if logprobs is None:
            return None
        args = self.context.args  # (the sampled-token objective then takes ρ against the trainer: `ratio_reference`)
        corrected = args.vllm_importance_sampling_correction
        return RolloutCorrection(logprobs, args.vllm_importance_sampling_clip_max if corrected else None)

    def objective_job(self, inputs: dict, training: bool) -> SampledTokenJob | None:
        """The sampled-token objective of this micro-batch (with its samples' task rewards), when it trains on the
        student's own samples under it; else None (the divergence). Takes the rows' columns off the batch."""
        pop_extra(inputs, "task_columns")
        rewards = pop_extra(inputs, "task_rewards")
        if self.plan.objective != "sampled_token" or not (training and self.on_policy):
            return None
        return SampledTokenJob(self.plan.sampled_token, rewards)

    def observe(self, correction: RolloutCorrection | None, sampled: SampledTokenJob | None = None) -> None:
        """After the loss: count the trainer-vs-engine log-prob gaps it recorded, and the objective's counts."""
        if sampled is not None:
            for key, value in sampled.stats.items():
                self.objective[key] += value
        if correction is not None and self.engine is not None:
            self.engine.counts["abs_gap"] += float(correction.gap.abs().sum())
            self.engine.counts["gap"] += float(correction.gap.sum())
            self.engine.counts["scored"] += correction.gap.numel()

    def log_into(self, logs: dict, accelerator, device) -> None:
        """Add the sampled share and length since the last log, summed over ranks (collective)."""
        if not self.active:
            return
        engine = self.engine.take_stats() if self.engine is not None else []
        span, self.since = time.perf_counter() - self.since, time.perf_counter()
        stats = torch.tensor([float(v) for v in self.stats.values()] + list(self.objective.values()) + engine + [span],
                             device=device)
        micro_steps, on_policy, rows, tokens, ended, grams, repeated, *rest = \
            accelerator.reduce(stats, reduction="sum").tolist()
        (advantage, gap, gap_tokens, clipped, scored, reward, rewarded), engine, span = rest[:7], rest[7:-1], rest[-1]
        self.objective = dict.fromkeys(self.objective, 0.0)
        if scored:  # the sampled-token objective (TRL GRPO's clip_ratio)
            logs["sampled_token_advantage"] = advantage / scored
            # mean log p_teacher − log p_student of the sampled tokens the teacher scores (across tokenizers: those
            # in an aligned group)
            logs["sampled_token_teacher_gap"] = gap / max(gap_tokens, 1)
            logs["clip_ratio"] = clipped / scored
        if rewarded:
            logs["task_reward"] = reward / rewarded
        if self.task_rewards is not None:  # what the reward functions logged (TRL's log_metric)
            self.task_rewards.log_into(logs, accelerator, device)
        logs["on_policy_fraction"] = on_policy / max(micro_steps, 1)
        logs["generated_length"] = tokens / max(rows, 1)
        if rows:
            logs["generated_eos_rate"] = ended / rows
            logs["generated_repetition_rate"] = repeated / max(grams, 1)
        self.stats = dict.fromkeys(self.stats, 0)
        if engine:  # summed over ranks: the shares are of every rank's time together
            generate, sync, rows, tokens, ended, logprob, abs_gap, gap, scored = engine
            logs["rollout_generate_share"] = generate / max(span, 1e-9)
            logs["rollout_sync_share"] = sync / max(span, 1e-9)
            logs["rollout_tokens"] = tokens
            logs["rollout_eos_rate"] = ended / max(rows, 1)
            logs["rollout_engine_logprob"] = logprob / max(tokens, 1)
            logs["rollout_logprob_abs_diff"] = abs_gap / max(scored, 1)  # mean |log π_train − log π_engine|
            logs["rollout_kl_engine_trainer"] = -gap / max(scored, 1)  # KL(π_engine ‖ π_train), sampled

    def close(self) -> None:
        for engine in (self.engine, self.teacher_engine):
            if engine is not None:
                engine.close()
