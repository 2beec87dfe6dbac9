"""The one teacher interface: what `DistillationTrainer` and `trl-distill cache-teacher` ask of any kind of teacher.

A kind of teacher (`live.LiveTeacher`, `self_distill.SelfTeacher`, `cached.CachedTeacher`, `served.ServedTeacher`,
`cross_tokenizer.CrossTokenizerTeacher`) owns everything that differs between kinds: the run settings it refuses
(`refused`, checked by `refuse`), how it attaches to the run (dataset columns, collator, fit checks), its
preparation (a collective load, or nothing), its once-per-step pass, its logit-path check and NaN/inf check, the
signal it hands the fused loss (`for_batch`), the top-k it writes for a cache, and its release. The trainer holds
one `TeacherSource` and asks it; it never branches on the kind.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from .support import Mode, active_modes

if TYPE_CHECKING:
    from accelerate.utils import DeepSpeedPlugin

    from ..loss.settings import LossSettings
    from ..loss.signal import TeacherSignal
    from ..model.fused_forward import LMHead
    from ..runtime.context import RunContext

logger = logging.getLogger(__name__)


class TeacherBatch(ABC):
    """A kind's teacher over one micro-batch's loss rows, made before the student's forward (`for_batch`)."""

    head: LMHead | None = None
    """The teacher's lm_head to gather around the loss (None: nothing to gather)."""

    @property
    def heads(self) -> tuple[LMHead | None, ...]:
        """Every lm_head to gather around the loss (several teachers: each one's)."""
        return (self.head,)

    @abstractmethod
    def signal(self, rows: torch.Tensor | None, n: int, settings: LossSettings) -> TeacherSignal:
        """The `loss.signal.TeacherSignal` over the `n` loss rows the student selected (`rows`: their row-major
        indices into the ``[B·K]`` kept positions)."""


class TeacherSource(ABC):
    """One kind of teacher. Subclasses fill `for_batch` and override the hooks their kind needs."""

    refused: dict[Mode, str] = {}
    """Run settings this kind cannot serve, each with the one-line message that names the fix."""
    columns: tuple[str, ...] = ()
    """Prepared-dataset columns its collator reads (kept when the Trainer drops unused columns)."""
    name: str = ""
    """What a checkpoint's run record and a cache's manifest record as the teacher."""
    revision: str | None = None
    student_tokenizer = None
    """A tokenizer this kind loaded for the student (cross-tokenizer), else None."""
    config_notes: list[str] = []
    """What was filled into its DeepSpeed config (printed as training starts)."""
    context: RunContext | None = None
    """The run it is attached to (`attach`); None before, and for a teacher prepared on its own."""
    routes_own_rows: bool = False
    """Several teachers routed: whether it runs on its own rows only (`before_step` and `for_batch` get those rows;
    a model run here), or hands a signal over every row, of which the loss picks its own (a cache, a server)."""

    # ---- Before the data is prepared ----

    @classmethod
    def refuse(cls, args, *, eval_dataset=None, peft: bool = False) -> None:
        """One `ValueError` naming the fix when the run uses a setting this kind refuses (see `support`); asked
        before the kind is built, so nothing is loaded or opened first."""
        for mode in active_modes(args, eval_dataset=eval_dataset, peft=peft):
            if mode in cls.refused:
                raise ValueError(cls.refused[mode])

    @staticmethod
    def check_args(args) -> None:
        """The settings this kind cannot take whatever the mode, refused as the config is built (none here)."""
        return None

    def plugin(self, args, student_plugin) -> DeepSpeedPlugin | None:
        """Its own DeepSpeed plugin beside the student's; None: no engine of its own."""
        if args.teacher_deepspeed is not None:
            logger.warning("Ignoring `teacher_deepspeed`: the teacher is %s; it has no engine.", self.describe())
        return None

    def plugins(self, args, student_plugin) -> dict[str, DeepSpeedPlugin]:
        """Every DeepSpeed plugin of this teacher beside the student's, by name (`plugin`'s under "teacher")."""
        plugin = self.plugin(args, student_plugin)
        return {} if plugin is None else {getattr(self, "plugin_name", "teacher"): plugin}

    def route_rows(self, train_dataset, eval_dataset):
        """The train dataset, its rows checked to fit this teacher before anything loads (several teachers: each
        row's teacher; a dict of datasets named after the teachers becomes one, each row naming its own)."""
        if isinstance(train_dataset, dict):
            raise ValueError("A dict of train datasets routes each one to the teacher of its name: list the teachers "
                             f"({', '.join(map(str, train_dataset))}) with `teachers=`, or pass one dataset.")
        return train_dataset

    def kd_parts(self) -> dict | None:
        """Several teachers: each one's part of the last micro-batch's KD sum (and its loss tokens); else None."""
        return None

    def own_metrics(self) -> dict | None:
        """Several teachers: each one's diagnostics of the last micro-batch (when measured); else None."""
        return None

    def prepare_dataset(self, dataset, name: str):
        """The prepared `dataset` with the columns this kind needs (called for every split SFT prepares)."""
        return dataset

    def vocab_config(self, student_config):
        """The config whose vocabulary the student's is compared with (`validation.shared_vocab_size`)."""
        return student_config

    # ---- Once the trainer exists ----

    def attach(self, context: RunContext) -> None:
        """Bind to the run (`runtime.context.RunContext`: its arguments, student, tokenizer, vocabulary, collator):
        check it fits this teacher (`train_rows` and `collator` come after). Called once, at the end of the trainer's
        set-up."""
        self.context = context

    def train_rows(self, dataset):
        """The prepared train dataset with what this kind's collator reads of each row (a cache's row numbers);
        `dataset` itself when nothing. The trainer trains on what it returns."""
        return dataset

    def collator(self, base):
        """`base` wrapped with what this kind adds to each batch (its signal, its own ids); `base` itself when
        nothing. The trainer composes the collators once, after `attach`, in a stated order."""
        return base

    def prepare(self, accelerator, device: torch.device) -> None:
        """Load and prepare the teacher (collective under DeepSpeed: every rank, once). Nothing for most kinds."""
        return None

    def logit_candidates(self, model_inputs: dict, extras) -> list[tuple[str, object, object, dict]]:
        """``(name, call, module, inputs)`` of each teacher model whose fused logits are checked against its own on
        the first batch (`model.logit_check`); none for a teacher without a model here."""
        return []

    def before_step(self, batch_samples: list[dict]) -> None:
        """All micro-batches of an optimizer step, before the first is trained on (the once-per-step pass)."""
        return None

    def pop_batch(self, inputs: dict):
        """Remove what this kind's collator put in the batch (the student must not see it); None if nothing."""
        return None

    @abstractmethod
    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> TeacherBatch:
        """The teacher over this micro-batch's loss tokens: `mask` ``[B, K]`` over the kept positions `keep`
        ``[K]``. Every rank calls it for every micro-batch (a partitioned teacher's gathers are collective)."""

    def after_loss(self) -> None:
        """After each micro-batch's loss."""
        return None

    def score_sampled(self, batch: dict, source: dict | None = None) -> None:
        """A batch whose completions were just sampled (on-policy, `seq_kd`) replaces the collated one, `source`
        (its prompts): add what this kind's collator would have added (a live teacher adds nothing: it runs on the
        batch itself)."""
        return None

    @property
    def scores_samples(self) -> bool:
        """Whether it can score rows the student sampled (`score_sampled`, then `for_batch`): a kind that serves
        on-policy distillation can. The generation eval asks it for its NLL of the student's completions."""
        return "on-policy" not in self.refused

    def sampling_server(self):
        """A vLLM server that samples in this teacher's stead (`seq_kd`; an `engine_client.RolloutServerClient`), or
        None: it samples with HF `generate` (`generation`)."""
        return None

    def generation(self, num_processes: int) -> tuple[object, object, bool]:
        """``(model, context, synced_gpus)`` to sample completions from (`seq_kd`)."""
        raise ValueError(f"seq_kd samples completions from the teacher, and the teacher is {self.describe()}.")

    # ---- cache-teacher ----

    cache_refusal: str | None = ("`trl-distill cache-teacher` writes the top-k of a teacher model or a teacher "
                                 "server: pass --teacher_model_name_or_path or --teacher_server.")
    """Why this kind cannot write a cache (checked before anything runs); None: it can."""

    def open_for_cache(self, columns, top_k: int) -> None:
        """Get ready to write the top-k of the prepared rows `columns` (collective)."""
        raise ValueError(self.cache_refusal)

    def cache_records(self, columns, mine: list[range], steps: int, filler: range, top_k: int,
                      temperature: float) -> list[dict]:
        """This rank's records of its batches `mine` (one per row: ids, positions, top-k, tail); `steps` is the
        batch count every rank runs (a collective kind runs `filler` when it has run out, and drops it)."""
        raise NotImplementedError


    # ---- The end ----

    def release(self) -> None:
        """Drop anything held for training (at train end)."""
        return None

    def describe(self) -> str:
        return type(self).__name__
