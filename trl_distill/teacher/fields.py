"""The `DistillationConfig` fields that say which teacher, or teachers, teach: a model (live, self, another
tokenizer's, served by vLLM), a cache of one, or several at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TeacherFields:
    """The teacher: where it comes from, how it is loaded and partitioned, how often it runs, which tokenizer it
    reads, or the vLLM server that serves it."""

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


@dataclass
class CacheFields:
    """A teacher cache in place of a teacher (`trl-distill cache-teacher` writes it)."""

    teacher_cache: str | None = field(
        default=None,
        metadata={
            "help": "A teacher cache directory written by `trl-distill cache-teacher` (the teacher's top-k "
            "log-probabilities per loss token). Training then loads no teacher at all; the divergence is computed on "
            "the top-k tokens plus the tail mass (see `trl_distill.loss.sparse`). For `cache-teacher` itself: "
            "where the cache is written."
        },
    )


@dataclass
class SeveralTeachersFields:
    """Several teachers at once, each of any kind (`trl_distill.teacher.panel`)."""

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
            "choices": ["route", "mixture", "sum"],
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
