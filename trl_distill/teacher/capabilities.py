"""What a kind of teacher may do beyond the core (`base.TeacherSource`), each declared on its own.

A kind declares a capability by subclassing its protocol (``class ServedTeacher(TeacherSource, OwnBatch, ...)``);
a caller asks for it with ``teacher.capability(OwnBatch)``, which gives the object that has it (the teacher, or
what a wrapper delegates to) or None, and does without it when it is None: no base-class default is called in its
stead. A wrapper (`privileged.PrivilegedTeacher`, `panel.TeacherPanel`) answers `capability` itself: what it
changes it declares and implements, everything else of what it wraps is handed through untouched.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from accelerate.utils import DeepSpeedPlugin

    from ..run_plan import TeacherEngine
    from .base import TeacherSource

logger = logging.getLogger(__name__)

C = TypeVar("C")


class OwnEngine(Protocol):
    """Its own DeepSpeed engines beside the student's (a live model: ZeRO-3 inference)."""

    config_notes: list[str]
    """What was filled into its DeepSpeed config (printed as training starts)."""

    @abstractmethod
    def plugins(self, engine: TeacherEngine, student_plugin) -> dict[str, DeepSpeedPlugin]:
        """Every DeepSpeed plugin of this teacher beside the student's, by name (``teacher``, ``teacher:NAME``), built
        as the plan's `engine` says."""


class RoutesRows(Protocol):
    """Reads the raw datasets before anything loads: routes each row to a teacher, or checks the rows fit it."""

    @abstractmethod
    def route_rows(self, train_dataset, eval_dataset):
        """The train dataset, its rows checked to fit this teacher (several teachers: each row's teacher; a dict of
        datasets named after the teachers becomes one, each row naming its own)."""


class PreparesDataset(Protocol):
    """Adds columns of its own to every split SFT prepares (a teacher's own ids, its prompts, the routing index)."""

    @abstractmethod
    def prepare_dataset(self, dataset, name: str):
        """The prepared `dataset` with the columns this kind needs."""


class TrainRows(Protocol):
    """Checks or numbers the prepared train rows once it is attached (a cache's row numbers)."""

    @abstractmethod
    def train_rows(self, dataset):
        """The prepared train dataset the trainer trains on."""


class OwnBatch(Protocol):
    """Its own collator: adds to each batch what it reads (its signal, its own ids) and takes it out again before
    the student sees the batch."""

    columns: tuple[str, ...]
    """Prepared-dataset columns its collator reads (kept when the Trainer drops unused columns)."""

    @abstractmethod
    def collator(self, base):
        """`base` wrapped with what this kind adds to each batch."""

    @abstractmethod
    def pop_batch(self, inputs: dict):
        """Remove what its collator put in the batch (the student must not see it): the `for_batch` extras."""


class OwnVocabulary(Protocol):
    """A vocabulary of its own that the student's is compared with (`validation.shared_vocab_size`)."""

    @abstractmethod
    def vocab_config(self, student_config):
        """The config whose vocabulary the student's is compared with."""


class StepHooks(Protocol):
    """Work around the micro-batches: a pass over all of an optimizer step's before the first, a release after
    each loss (`step_pass`)."""

    @abstractmethod
    def before_step(self, batch_samples: list[dict]) -> None:
        """All micro-batches of an optimizer step, before the first is trained on."""

    @abstractmethod
    def after_loss(self) -> None:
        """After each micro-batch's loss."""


class LogitChecked(Protocol):
    """Teacher models here whose fused logits are checked against their own on the first batch."""

    @abstractmethod
    def logit_candidates(self, model_inputs: dict, extras) -> list[tuple[str, object, object, dict]]:
        """``(name, call, module, inputs)`` of each teacher model (`model.logit_check`)."""


class ScoresSamples(Protocol):
    """Scores rows the student sampled (on-policy, the generation eval's teacher NLL)."""

    @abstractmethod
    def score_sampled(self, batch: dict, source: dict | None = None) -> None:
        """A batch of sampled completions replaces the collated one, `source` (its prompts): add what this kind's
        collator would have added (nothing for a teacher that runs on the batch itself)."""


class Samples(Protocol):
    """Samples completions itself with HF `generate` (`seq_kd`)."""

    @abstractmethod
    def generation(self, num_processes: int) -> tuple[object, object, bool]:
        """``(model, context, synced_gpus)`` to sample completions from."""


class SamplingServer(Protocol):
    """A vLLM server samples in this teacher's stead (`seq_kd` from a served teacher)."""

    @abstractmethod
    def sampling_server(self):
        """Its `rollout.engine_client.RolloutServerClient`."""


class WritesCache(Protocol):
    """Writes its top-k for `trl-distill cache-teacher`."""

    revision: str | None
    """The revision a cache's manifest records."""

    @abstractmethod
    def open_for_cache(self, columns, top_k: int) -> None:
        """Get ready to write the top-k of the prepared rows `columns` (collective)."""

    @abstractmethod
    def cache_records(self, columns, mine: list[range], steps: int, filler: range, top_k: int,
                      temperature: float) -> list[dict]:
        """This rank's records of its batches `mine` (one per row); `steps` is the batch count every rank runs (a
        collective kind runs `filler` when it has run out, and drops it)."""


class OwnMetrics(Protocol):
    """Metrics of its own each micro-batch (several teachers: each one's part)."""

    @abstractmethod
    def kd_parts(self) -> dict | None:
        """Each teacher's part of the last micro-batch's KD sum (and its loss tokens), or None."""

    @abstractmethod
    def own_metrics(self) -> dict | None:
        """Each teacher's diagnostics of the last micro-batch (when measured), or None."""


class StudentTokenizer(Protocol):
    """Loaded a tokenizer for the student (a teacher with another tokenizer needs the student's)."""

    student_tokenizer: object


class OwnRows(Protocol):
    """Routed among several teachers, whether it runs on its own rows only (`before_step` and `for_batch` get those
    rows: a model here), or hands a signal over every row, of which the loss picks its own."""

    routes_own_rows: bool


class ChecksArgs(Protocol):
    """Settings it refuses whatever the mode, checked as the config is built (on the class: nothing is built)."""

    @staticmethod
    @abstractmethod
    def check_args(args) -> None:
        """One `ValueError` naming the fix."""


CAPABILITIES: tuple[type, ...] = (OwnEngine, RoutesRows, PreparesDataset, TrainRows, OwnBatch, OwnVocabulary,
                                  StepHooks, LogitChecked, ScoresSamples, Samples, SamplingServer, WritesCache,
                                  OwnMetrics, StudentTokenizer, OwnRows, ChecksArgs)
"""Every capability a teacher may declare."""

CACHE_REFUSAL = ("`trl-distill cache-teacher` writes the top-k of a teacher model or a teacher server: pass "
                 "--teacher_model_name_or_path or --teacher_server.")
"""Why a teacher that does not write a cache cannot, unless its `refused` names `WritesCache` with its own line."""


SEQ_KD_REFUSAL = "seq_kd samples completions from the teacher, and the teacher is {}."
"""Why a teacher that does not sample itself (`Samples`) cannot sample for `seq_kd`."""


def declares(cls: type, capability: type) -> bool:
    """Whether the class `cls` declares `capability` (subclasses its protocol)."""
    return capability in cls.__mro__


def required(teacher: TeacherSource, capability: type[C], refusal: str) -> C:
    """`teacher` as `capability`, or one `ValueError`: the teacher's own line for it (in its `refused`), else
    `refusal`."""
    found = teacher.capability(capability)
    if found is None:
        raise ValueError(teacher.refused.get(capability, refusal))
    return found


def plugins_of(teacher: TeacherSource, engine: TeacherEngine, student_plugin) -> dict:
    """The DeepSpeed plugins of `teacher` beside the student's, built as the plan's `engine` says; none for a teacher
    without an engine (a `teacher_deepspeed` given for it is ignored, with a warning)."""
    own = teacher.capability(OwnEngine)
    if own is not None:
        return own.plugins(engine, student_plugin)
    if engine.deepspeed is not None:
        logger.warning("Ignoring `teacher_deepspeed`: the teacher is %s; it has no engine.", teacher.describe())
    return {}


def columns_of(teacher: TeacherSource) -> tuple[str, ...]:
    """The prepared-dataset columns `teacher`'s collator reads (none without a collator of its own)."""
    own = teacher.capability(OwnBatch)
    return () if own is None else tuple(own.columns)


@dataclass(frozen=True)
class StepCapabilities:
    """What a training step asks of the teacher, asked once as the trainer is set up (a kind's capabilities are its
    type's, fixed): its hooks around the micro-batches, its own batch, its own metrics (each None without)."""

    hooks: StepHooks | None
    batch: OwnBatch | None
    metrics: OwnMetrics | None

    @classmethod
    def of(cls, teacher: TeacherSource) -> StepCapabilities:
        return cls(teacher.capability(StepHooks), teacher.capability(OwnBatch), teacher.capability(OwnMetrics))


def popped(teacher: TeacherSource, inputs: dict):
    """What `teacher`'s collator put in the batch `inputs`, taken out (None without a collator of its own)."""
    own = teacher.capability(OwnBatch)
    return None if own is None else own.pop_batch(inputs)


def routed_rows(teacher: TeacherSource, train_dataset, eval_dataset):
    """The train dataset as `teacher` routes or checks it; a dict of datasets without a teacher that routes them is
    one line."""
    router = teacher.capability(RoutesRows)
    return unrouted(train_dataset) if router is None else router.route_rows(train_dataset, eval_dataset)


def unrouted(train_dataset):
    """The train dataset of one teacher as given: a dict of datasets (one per teacher) is one line."""
    if isinstance(train_dataset, dict):
        raise ValueError("A dict of train datasets routes each one to the teacher of its name: list the teachers "
                         f"({', '.join(map(str, train_dataset))}) with `teachers=`, or pass one dataset.")
    return train_dataset


def vocab_config_of(teacher: TeacherSource, student_config):
    """The config whose vocabulary the student's is compared with: the teacher's own, else the student's."""
    own = teacher.capability(OwnVocabulary)
    return student_config if own is None else own.vocab_config(student_config)


def logit_candidates_of(teacher: TeacherSource):
    """``candidates(model_inputs, extras)``: the teacher models whose fused logits are checked (none without)."""
    checked = teacher.capability(LogitChecked)
    return (lambda model_inputs, extras: []) if checked is None else checked.logit_candidates


def student_tokenizer_of(teacher: TeacherSource):
    """The tokenizer `teacher` loaded for the student (a teacher of another tokenizer), else None."""
    own = teacher.capability(StudentTokenizer)
    return None if own is None else own.student_tokenizer


def collator_of(teacher: TeacherSource, base):
    """`base` wrapped with what `teacher` adds to each batch (`base` itself without a collator of its own)."""
    own = teacher.capability(OwnBatch)
    return base if own is None else own.collator(base)


def train_rows_of(teacher: TeacherSource, dataset):
    """The prepared train dataset as `teacher` checks or numbers it (`dataset` itself when it does neither)."""
    own = teacher.capability(TrainRows)
    return dataset if own is None else own.train_rows(dataset)


def prepared_for(teacher: TeacherSource, dataset, name: str):
    """A prepared split with `teacher`'s own columns (`dataset` itself when it adds none)."""
    own = teacher.capability(PreparesDataset)
    return dataset if own is None else own.prepare_dataset(dataset, name)
