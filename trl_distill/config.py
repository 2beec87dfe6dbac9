"""`DistillationConfig`: `trl.SFTConfig` plus the teacher and the distillation loss, every field of ours below in
the order `HfArgumentParser` (`--help`) lists them, each with its help beside it (the class docstring is written
from those helps). Building a config checks each field alone; `trl_distill.run_plan.resolve` checks how they
combine and derives the run's plan."""

from __future__ import annotations

import textwrap
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Any

from transformers import TrainingArguments
from trl import SFTConfig

from . import compat
from .constants import BUILT_IN_VERIFIERS, LOSS_TYPES, OBJECTIVES, TEACHER_COMBINES, VLLM_MODES

INTRODUCTION = r"""
    Configuration for [`DistillationTrainer`]: every [`trl.SFTConfig`] field, then the distillation's own, below in
    the order `HfArgumentParser` (`--help`) lists them. Each entry is its field's help (`trl_distill/config.py`);
    `trl_distill.run_plan.resolve` checks how the fields combine.

    The loss is ``alpha * KD + (1 - alpha) * CE``, where KD is the chosen `divergence` between the teacher's and
    the student's next-token distributions at `temperature` (times ``temperature**2`` unless
    `kd_temperature_scaling` is off) and CE is the student's cross-entropy on the dataset's completion tokens.
    Both are averaged over the completion tokens of the whole (accumulated, all-rank) batch.

    Parameters:"""

# Each section of the docstring, and the field it starts with (the fields below, grouped under the same comments)
SECTIONS = (("Teacher", "teacher_model_name_or_path"), ("Loss", "divergence"),
            ("On-policy and rollouts", "lmbda"), ("On-policy objective", "on_policy_objective"),
            ("Cache", "teacher_cache"), ("Several teachers", "teachers"), ("Long rows", "sequence_parallel_size"),
            ("Metrics and guards", "log_distill_metrics"), ("Generation-based evaluation", "eval_reward_funcs"),
            ("Reliability", "resume_allow_changes"))


def docstring(config_class) -> str:
    """The class docstring: `INTRODUCTION`, then each field the class itself declares, in its section, as
    ``name (`type`, *optional*, defaults to `value`):`` and its help."""
    starts = dict((first, name) for name, first in SECTIONS)
    declared = config_class.__annotations__
    by_name = {f.name: f for f in fields(config_class)}
    lines = [INTRODUCTION]
    for name, annotation in declared.items():
        if name not in by_name:
            continue  # a class attribute, not a field
        if name in starts:
            lines += [""] * (len(lines) > 1) + [f"        > {starts[name]}", ""]
        item = by_name[name]
        default = "" if item.default in (None, MISSING) else \
            f", defaults to `{item.default!r}`".replace("'", '"') if isinstance(item.default, str) else \
            f", defaults to `{item.default!r}`"
        lines.append(f"        {name} (`{annotation.removesuffix(' | None')}`, *optional*{default}):")
        lines += textwrap.wrap(item.metadata["help"], 120, initial_indent=" " * 12, subsequent_indent=" " * 12,
                               break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines) + "\n    "


@dataclass
class DistillationConfig(SFTConfig):
    # Fields a JSON string may fill on the CLI (a TrainingArguments class attribute; transformers 5.24)
    _VALID_DICT_FIELDS = compat.valid_dict_fields(SFTConfig) + ["teacher_model_init_kwargs", "teacher_deepspeed",
                                                                "teacher_fsdp_config"]

    # Teacher

    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Path or hub id of the teacher model, used when no `teacher_model` is passed. 'self' with a "
            "LoRA student (--use_peft): self-distillation from the student's own base with its adapters disabled."
        },
    )
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for the teacher's `AutoModelForCausalLM.from_pretrained` (e.g. `dtype`, "
            "`revision`, `attn_implementation`). The teacher's dtype follows the student's unless set here."
        },
    )
    teacher_deepspeed: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "The teacher's own DeepSpeed config: a JSON file, a JSON string or a dict. Its 'auto' values are "
            "filled from these arguments, its ZeRO-3 bucket sizes from the teacher's hidden size, and optimizer or "
            "scheduler blocks are dropped. When absent and the student uses DeepSpeed, a ZeRO-3 inference config "
            "is derived, so each rank holds 1/N of the teacher; on one process there is nothing to partition over, "
            "so the teacher is held whole on the device, without ZeRO-3's per-module hooks (set this to keep ZeRO-3 "
            "there, e.g. to offload its parameters)."
        },
    )
    teacher_fsdp_config: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Beside an FSDP2 student (`fsdp_version: 2`), the teacher's own FSDP2 settings: a JSON file, a "
            'JSON string or a dict, e.g. {"reshard_after_forward": true, "dtype": "bf16"}. By default the teacher is '
            "sharded over every rank on its own (each rank reads and holds 1/N of it), frees each layer after its "
            "forward, and is held in the student's mixed precision, else the student's dtype."
        },
    )
    teacher_step_pass: bool = field(
        default=True,
        metadata={
            "help": "Run the teacher once per optimizer step over all its micro-batches (rows batched, padding "
            "changes no value), keeping only its hidden states at the loss tokens and its lm_head gathered until the "
            "step's last micro-batch: a ZeRO-3 teacher then gathers each layer once per step, not once per "
            "micro-batch. False: once per micro-batch. Sampled steps (lmbda, seq_kd) always run per micro-batch."
        },
    )
    teacher_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "At most this many rows per teacher forward in the once-per-step pass (each forward gathers the "
            "teacher once more). None: all rows of the optimizer step (micro batch x gradient accumulation) at once."
        },
    )
    teacher_tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The teacher's tokenizer (default: the one saved with the teacher). When it maps tokens to "
                  "other ids than the student's, training switches to cross-tokenizer distillation by itself."},
    )
    cross_tokenizer: bool | None = field(
        default=None,
        metadata={"help": "Cross-tokenizer distillation: each model reads its own tokens of the same text, the loss "
                  "compares them on aligned groups (the divergence on the tokens both vocabularies hold, Universal "
                  "Logit Distillation on the rest). None: on when the tokenizers differ; True forces it."},
    )
    cross_tokenizer_matched_weight: float | None = field(
        default=None,
        metadata={"help": "Weight of the divergence on the shared tokens. None (with the ULD weight None): the shared "
                  "fraction of the teacher's vocabulary, as TRL's GOLD does."},
    )
    cross_tokenizer_uld_weight: float | None = field(
        default=None, metadata={"help": "Weight of the ULD term on the tokens only one side has. None: 1 - matched."}
    )
    teacher_server: str | None = field(
        default=None,
        metadata={
            "help": "The URL of an OpenAI-compatible vLLM server serving the teacher (`vllm serve TEACHER "
            "--max-logprobs 64`); --teacher_model_name_or_path then names the served model (default: the one it "
            "serves). No teacher is loaded here: each batch's loss tokens get the teacher's top-k log-probs from "
            "the server, requested ahead while the student computes, and the loss runs as from a teacher cache. "
            "Temperature 1 only. For `cache-teacher`: write the cache from the server."
        },
    )
    teacher_server_top_k: int = field(
        default=64,
        metadata={"help": "Teacher token ids per loss token from the server (it needs --max-logprobs >= this)."},
    )
    teacher_server_timeout: float = field(
        default=120.0,
        metadata={"help": "Seconds per teacher-server request; each is retried 3 times with backoff before the run "
                  "stops with the error."},
    )
    teacher_server_concurrency: int = field(
        default=4, metadata={"help": "Teacher-server requests in flight per process."}
    )
    teacher_prompt: str | None = field(
        default=None,
        metadata={"help": "A teacher that sees more than the student: the dataset column the teacher reads in place of "
                  "each row's prompt (e.g. the prompt with its golden answer), or a template of the row's columns "
                  "('{prompt} (answer: {answer})'); the loss is on the completion, which both read. Live or served "
                  "teacher, on and off the policy."},
    )

    # Loss

    divergence: str = field(
        default="forward_kl",
        metadata={
            "help": "Divergence between teacher (p) and student (q) distributions.",
            "choices": list(LOSS_TYPES),
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "Softmax temperature applied to both the teacher's and the student's logits in the KD term."},
    )
    alpha: float = field(
        default=0.5,
        metadata={"help": "Weight of the KD term: loss = alpha * KD + (1 - alpha) * CE. 1.0 is pure distillation."},
    )
    beta: float = field(
        default=0.5,
        metadata={"help": "Teacher weight in the mixture of the generalized JSD (`divergence='jsd'`), in [0, 1]."},
    )
    skew_alpha: float = field(
        default=0.1,
        metadata={"help": "Skew of `skew_forward_kl` / `skew_reverse_kl` (DistiLLM), in [0, 1]."},
    )
    kd_temperature_scaling: bool = field(
        default=True,
        metadata={"help": "Multiply the KD term by temperature**2 (Hinton et al.), keeping its gradient scale."},
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Completion tokens projected through the lm_heads at a time in the chunked loss. None picks a "
            "size from the vocabulary so one chunk of fp32 logits stays near 128 MiB."
        },
    )
    assistant_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Compute KD and CE on assistant tokens only (conversational `messages` datasets). Unset: on when "
            "the chat template has generation markers or TRL can add them, off (with a warning) otherwise."
        },
    )

    # On-policy and rollouts

    lmbda: float = field(
        default=0.0,
        metadata={
            "help": "On-policy fraction (GKD): per optimizer step, with this probability the batch's completions are "
            "sampled from the student for the same prompts. The draw is seeded by (seed, step): equal on every rank "
            "and on resume. 0 is off-policy distillation on the dataset's completions."
        },
    )
    seq_kd: bool = field(
        default=False,
        metadata={"help": "Sequence-level KD: on the steps not drawn on-policy, completions are sampled from the "
                  "teacher instead of taken from the dataset."},
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Tokens sampled per completion (lmbda > 0 or seq_kd)."})
    generation_temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature of generated completions (not the loss temperature)."}
    )
    generation_top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling of generated completions."})
    generation_top_k: int = field(default=0, metadata={"help": "Top-k sampling of generated completions (0: off)."})
    use_vllm: bool = field(default=False, metadata={
        "help": "Sample the student's completions (lmbda > 0) from a vLLM server of the student (`trl-distill "
        "vllm-serve --model STUDENT`) whose weights are synced from the trainer, instead of the student's HF "
        "generate. Any teacher kind but a cache scores them."})
    vllm_mode: str = field(default="server", metadata={
        "help": "'server' (a vLLM server of the student, started with `trl-distill vllm-serve`) or 'colocate' "
        "(vLLM inside the training processes; not available yet).", "choices": list(VLLM_MODES)})
    vllm_server_base_url: str | None = field(default=None, metadata={
        "help": "Base URL of the rollout server (e.g. http://localhost:8000); when set, host and port are ignored."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Host of the rollout server."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Port of the rollout server."})
    vllm_server_timeout: float = field(default=240.0, metadata={
        "help": "Seconds the rollout server may take to answer a request or a weight sync before training stops "
        "with one line (the last complete checkpoint kept)."})
    vllm_group_port: int = field(default=51216, metadata={
        "help": "Port on the trainer's rank 0 for the weight-sync group with the server's workers (gloo on CPU)."})
    vllm_sync_steps: int = field(default=1, metadata={
        "help": "Sync the student's weights to the rollout server every this many optimizer steps (and before the "
        "first rollout). A resumed run samples what the uninterrupted one did when it resumes at a multiple of it."})
    vllm_importance_sampling_correction: bool = field(default=False, metadata={
        "help": "Weight each sampled token's KD and CE by min(π_trainer / π_engine, vllm_importance_sampling_clip_max) "
        "(detached, at temperature 1): corrects for rollouts sampled by an engine whose numerics differ from the "
        "trainer's (bf16 kernels). The sampled-token objective's surrogate is weighted so too, its ratio then taken "
        "against the trainer's own log-probs (as TRL's GRPO). The gap is logged either way "
        "(rollout_logprob_abs_diff)."})
    vllm_importance_sampling_clip_max: float = field(default=3.0, metadata={
        "help": "Upper bound of the importance-sampling weights (TRL's GRPO name)."})

    # On-policy objective

    on_policy_objective: str = field(default="divergence", metadata={
        "help": "On the student's own samples: 'divergence' (the `divergence` over the whole vocabulary, as off the "
        "policy) or 'sampled_token' (a policy gradient on the sampled tokens, reward log p_teacher - log p_student "
        "per token, plus task_reward_funcs; lmbda=1; reads only the teacher's log-prob of each sampled token).",
        "choices": list(OBJECTIVES)})
    sampled_token_kl_coef: float = field(default=1.0, metadata={
        "help": "sampled_token: the coefficient of the per-token reward log p_teacher(y_t) - log p_student(y_t)."})
    sampled_token_discount: float = field(default=0.0, metadata={
        "help": "sampled_token: each token's advantage also sums the later tokens' rewards of its completion, "
        "discounted by this factor per token (0: its own reward only)."})
    epsilon: float = field(default=0.2, metadata={
        "help": "sampled_token: the importance ratio against the engine that sampled is clipped to [1 - epsilon, "
        "1 + epsilon_high] (TRL GRPO's names; 1 when HF generate sampled)."})
    epsilon_high: float | None = field(default=None, metadata={
        "help": "sampled_token: the upper clip of the importance ratio (default: epsilon)."})
    task_reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "sampled_token: reward functions of each sampled completion, added to its tokens' advantages "
        "(minus the micro-batch's mean): the verifiers eval_reward_funcs takes (built-ins, or module:function with "
        "TRL's reward signature), given the train row's columns."})
    task_reward_weight: float = field(default=1.0, metadata={
        "help": "sampled_token: the weight of the task reward beside the teacher's per-token reward."})

    # Cache

    teacher_cache: str | None = field(
        default=None,
        metadata={
            "help": "A teacher cache directory written by `trl-distill cache-teacher` (the teacher's top-k "
            "log-probabilities per loss token). Training then loads no teacher at all; the divergence is computed on "
            "the top-k tokens plus the tail mass (see `trl_distill.loss.sparse`). For `cache-teacher` itself: "
            "where the cache is written."
        },
    )

    # Several teachers

    teachers: list[str] | None = field(
        default=None,
        metadata={
            "help": "Several teachers, each NAME=SOURCE: SOURCE a path or hub id (a live teacher, its own ZeRO-3 "
            "plugin), cache:DIR (a teacher cache) or an http(s):// URL (a vLLM server). A recipe may give dicts "
            "(name, model/cache/server, deepspeed, init_kwargs, served_model). --teacher_combine says how they teach."
        },
    )
    teacher_combine: str = field(
        default="route",
        metadata={
            "help": "With several teachers: 'route' (each row learns from the teacher its teacher_column names; "
            "rows naming none, from the first listed), 'mixture' (the divergence against the mixture of their "
            "distributions, weights summing to 1; live teachers) or 'sum' (the weighted sum of each teacher's "
            "divergence; any kind).",
            "choices": list(TEACHER_COMBINES),
        },
    )
    teacher_weights: list[float] | None = field(
        default=None, metadata={"help": "The teachers' weights for mixture / sum, in the order of --teachers "
                                "(default: equal)."}
    )
    teacher_column: str = field(
        default="teacher", metadata={"help": "The dataset column naming each row's teacher (teacher_combine=route); "
                                     "a dataset without it may name them in `teacher_id` (TRL's name)."}
    )

    # Long rows

    sequence_parallel_size: int = field(default=1, metadata={
        "help": "Split each sequence over this many ranks (DeepSpeed Ulysses sequence parallelism), student and "
        "teacher alike. Must divide the number of processes and each model's attention heads; needs DeepSpeed."})
    sequence_parallel_attn_implementation: str = field(default="sdpa", metadata={
        "help": "The attention both models run under sequence parallelism: sdpa, flash_attention_2, "
        "flash_attention_3 or flex_attention (not eager: it needs the whole 4D mask)."})

    # Metrics and guards

    log_distill_metrics: bool = field(default=True, metadata={
        "help": "Log top1_agreement, kl_teacher_student, teacher_ce, the entropies (and, per teacher kind, its tail "
        "mass or aligned share) at every logging step and in evaluate(), measured inside the fused loss on the "
        "logged step's micro-batches (see distill_metrics_every_step)."})
    distill_metrics_every_step: bool = field(default=False, metadata={
        "help": "Measure the diagnostics on every optimizer step and log their mean since the last log (like "
        "kd_loss), instead of on the logged steps only (every micro-batch of them). Costs a few percent of step time "
        "where the hidden size is small (docs/benchmarks.md)."})
    stop_on_nonfinite_loss: bool = field(default=True, metadata={
        "help": "Stop every rank, before the backward, when the student's loss is NaN or inf on any rank (the last "
        "complete checkpoint is kept)."})
    collapse_max_repetition: float = field(default=0.9, metadata={
        "help": "On-policy: stop when the share of repeated 4-grams in the student's samples (generated_"
        "repetition_rate) is above this for collapse_patience logging steps in a row. 1 turns it off."})
    collapse_min_entropy: float = field(default=0.02, metadata={
        "help": "On-policy: stop when the student's mean entropy (nats) on its own samples "
        "(on_policy_student_entropy) is below this for collapse_patience logging steps in a row. 0 turns it off."})
    collapse_patience: int = field(default=3, metadata={
        "help": "Consecutive logging steps past a collapse bound before the run stops."})
    teacher_ce_margin: float = field(default=0.0, metadata={
        "help": "Warn at the first step when the teacher's cross-entropy on the data exceeds the untrained "
        "student's by more than this (nats): a wrong teacher, or data it does not know (not with alpha=0)."})

    # Generation-based evaluation

    eval_reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Judge the student by what it generates: in evaluate() (every eval_steps, at the end, and called "
        f"directly) it completes the eval split's prompts and these verifiers score each completion: built-ins "
        f"({', '.join(BUILT_IN_VERIFIERS)}) or functions with TRL's reward signature as module:function (or "
        "module.function). "
        "The first one decides pass@k (a completion passes at score >= 1). Logs eval_pass@1, "
        "eval_rewards/NAME/mean, eval_generated_length, eval_eos_rate and eval_teacher_nll."})
    num_generations_eval: int = field(default=1, metadata={
        "help": "Completions per eval prompt (TRL's name): n > 1 also logs eval_pass@n (the unbiased estimator of "
        "Chen et al. 2021) and samples at eval_temperature."})
    eval_temperature: float | None = field(default=None, metadata={
        "help": "Sampling temperature of the eval completions; 0 is greedy. Default: greedy with one generation per "
        "prompt, generation_temperature with several."})
    eval_max_new_tokens: int | None = field(default=None, metadata={
        "help": "Tokens generated per eval completion at most (default: max_new_tokens)."})
    eval_generation_prompts: int | None = field(default=None, metadata={
        "help": "Generate for the eval split's first N prompts only (default: all); the loss is still taken on all."})
    eval_answer_column: str | None = field(default=None, metadata={
        "help": "The eval column the built-in verifiers compare with (default: 'answer', else 'solution')."})
    eval_answer_pattern: str | None = field(default=None, metadata={
        "help": "The regular expression regex_match extracts the answer with (its first group, if any)."})

    # Reliability

    resume_allow_changes: bool = field(
        default=False,
        metadata={"help": "Resume a checkpoint even though the teacher or the distillation settings (divergence, "
                  "temperature, alpha, ...) differ from the run that wrote it. Off: such a resume is refused."},
    )

    def __post_init__(self):
        from .config_checks import check_each_field, settle_for_transformers, student_deepspeed

        check_each_field(self)  # a value no run can take, named as the config is built
        self.deepspeed = student_deepspeed(self.deepspeed)
        settle_for_transformers(self)  # what `TrainingArguments.__post_init__` reads, in the form it needs
        super().__post_init__()

    def to_dict(self) -> dict:
        """`TrainingArguments.to_dict`, several teachers as plain dicts with the weights they mix with
        (`specs.written_teachers`): what `to_json_string`, which TensorBoard's and W&B's callbacks call as training
        starts, writes, the same before and after `run_plan.resolve`."""
        values = super().to_dict()
        if self.teachers:
            from .teacher.specs import written_teachers

            values["teachers"], values["teacher_weights"] = written_teachers(
                self.teachers, self.teacher_weights, self.teacher_combine)
        return values

    @cached_property
    def _setup_devices(self):
        """Where transformers sets up the process (`TrainingArguments._setup_devices`, a private hook checked against
        transformers 5.24): on a machine without GPU, DeepSpeed first gets the gloo state it needs there
        (`distributed.prepare_cpu_distributed_state`). Building the config does nothing else to the process."""
        from .runtime.distributed import prepare_cpu_distributed_state
        from .runtime.process_setup import prepare_process

        prepare_process()  # before DeepSpeed is imported and its process group builds its CPU op
        prepare_cpu_distributed_state(self)
        return super()._setup_devices


DistillationConfig.__doc__ = docstring(DistillationConfig)


def as_distillation_config(args) -> DistillationConfig:
    """A `DistillationConfig` with every value of a stock `TrainingArguments` (or `SFTConfig`), the distillation
    fields at their defaults: what makes the trainer a drop-in for `Trainer` and `SFTTrainer` scripts.

    A `Trainer` script tokenizes its own data and brings its own collator, so SFT's dataset preparation is skipped
    for plain `TrainingArguments` (as the stock `Trainer` would do)."""
    if isinstance(args, DistillationConfig):
        return args
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"args must be a DistillationConfig or TrainingArguments, got {type(args).__name__}.")
    values = args.to_dict()
    for key in values:
        if key.endswith("_token"):  # to_dict masks these (hub_token, and SFT's eos_token / pad_token)
            values[key] = getattr(args, key)
    if not isinstance(args, SFTConfig):
        values["dataset_kwargs"] = {"skip_prepare_dataset": True}
    return DistillationConfig(**values)
