"""The teacher's whole lifecycle: its DeepSpeed plugin, load (partitioned from the start), prepare once, run frozen
(features for the loss, a model to sample from), never save.

With DeepSpeed the teacher has its own plugin ("teacher", ZeRO-3 inference) beside the student's ("student").
It is loaded while its plugin is selected, so `from_pretrained` runs under `zero.Init` and no rank ever holds
the whole teacher; it is prepared into its own engine without disturbing what the Trainer relies on (the
engine that receives `backward`, the config `save_model` reads); the student's plugin is selected again in
every case.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
from accelerate.utils import DeepSpeedPlugin
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, TrainingArguments
from transformers.integrations import is_deepspeed_zero3_enabled

from .compat import prepared_models
from .deepspeed_config import build_teacher_config
from .modeling import LossFeatures, add_fused_distillation_forward, hidden_size
from .validation import check_model_path, check_weights_complete
from .zero3_loading import load_partitioned, loadable

logger = logging.getLogger(__name__)

STUDENT, TEACHER = "student", "teacher"


def uses_two_plugins(accelerator) -> bool:
    plugins = getattr(accelerator.state, "deepspeed_plugins", None)
    return isinstance(plugins, dict) and TEACHER in plugins


@contextlib.contextmanager
def teacher_plugin_selected(accelerator):
    """Select the teacher's DeepSpeed plugin for the block; always select the student's again after it."""
    accelerator.state.select_deepspeed_plugin(TEACHER)
    try:
        yield accelerator.state.get_deepspeed_plugin(TEACHER)
    finally:
        accelerator.state.select_deepspeed_plugin(STUDENT)


@contextlib.contextmanager
def _accelerator_state_kept(accelerator):
    """Undo what `accelerator.prepare(teacher)` changes on the accelerator (checked against accelerate 1.15):

    - `deepspeed_engine_wrapped`: the engine `accelerator.backward` runs on, and the one `free_memory()`
      destroys at the start of `train()`. It must stay the student's (or empty), never the teacher's.
    - `deepspeed_config`: `save_model` reads it to decide how to save; it must stay the student's.
    - `_models`: the prepared models that `save_state` saves; the teacher is never saved.
    """
    wrapped = accelerator.deepspeed_engine_wrapped
    config = getattr(accelerator, "deepspeed_config", None)
    models = list(prepared_models(accelerator))
    accelerator.deepspeed_engine_wrapped = None  # else accelerate warns that an engine is already tied
    try:
        yield
    finally:
        accelerator.deepspeed_engine_wrapped = wrapped
        if config is not None:
            accelerator.deepspeed_config = config
        prepared_models(accelerator)[:] = models


class Teacher:
    """A frozen teacher model, loaded lazily and prepared exactly once.

    Args:
        source: a `PreTrainedModel`, or a path / hub id to load with `from_pretrained`.
        init_kwargs: keyword arguments for `from_pretrained` (ignored for a model instance).
    """

    def __init__(self, source: str | os.PathLike | PreTrainedModel, init_kwargs: dict | None = None):
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        if not isinstance(source, (str, PreTrainedModel)):
            raise TypeError(
                f"teacher_model must be a transformers PreTrainedModel or a path / hub id, got "
                f"{type(source).__name__}. (A PEFT model as teacher: merge it first with `merge_and_unload()`.)"
            )
        if isinstance(source, str):
            check_model_path(source, "teacher_model")
            check_weights_complete(source, "teacher_model")
        self.source = source
        self.init_kwargs = dict(init_kwargs or {})
        self.module: nn.Module | None = None  # the unwrapped model
        self.engine: nn.Module | None = None  # what runs the forward: a DeepSpeed engine or the module

    @functools.cached_property
    def config(self):
        """The teacher's config, read without loading its weights."""
        if isinstance(self.source, PreTrainedModel):
            return self.source.config
        from transformers import AutoConfig

        kwargs = {k: self.init_kwargs[k] for k in ("revision", "trust_remote_code") if k in self.init_kwargs}
        return AutoConfig.from_pretrained(self.source, **kwargs)

    @property
    def prepared(self) -> bool:
        return self.engine is not None

    @property
    def name(self) -> str:
        """The path or hub id it was loaded from (what a checkpoint records)."""
        return self.source if isinstance(self.source, str) else self.config.name_or_path

    def plugin(self, args, student_plugin) -> DeepSpeedPlugin:
        """The teacher's own DeepSpeed plugin beside `student_plugin`: ZeRO-3 inference unless `args.teacher_deepspeed`
        says otherwise (see `deepspeed_config.build_teacher_config`). `config_notes` says what was filled."""
        self.config_notes: list[str] = []
        config = build_teacher_config(args.teacher_deepspeed, student_plugin.deepspeed_config, args,
                                      hidden_size(self.config), notes=self.config_notes)
        stage = config["zero_optimization"].get("stage", 0)
        if args.seq_kd and stage == 3:
            # Sampling runs the teacher's own lm_head, which our loss gathers itself; DeepSpeed's prefetcher would
            # then have it in flight when the loss gathers it (deepspeed 0.19.8). Fetch on demand instead.
            config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        return DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=stage == 3)

    def generation(self, num_processes: int) -> tuple[nn.Module, object, bool]:
        """``(model, context, synced_gpus)`` for sampling from the teacher: a partitioned teacher samples with every
        rank stepping until all ranks are done."""
        return self.module, contextlib.nullcontext, num_processes > 1 and self.engine is not self.module

    def _load(self) -> PreTrainedModel:
        if isinstance(self.source, PreTrainedModel):
            return self.source
        kwargs = {"trust_remote_code": False, **self.init_kwargs}
        if kwargs.pop("device_map", None) is not None:
            logger.warning("Ignoring the teacher's `device_map`: the teacher is placed by DeepSpeed or on the "
                           "training device.")
        if is_deepspeed_zero3_enabled() and loadable(self.source, kwargs):
            model = load_partitioned(self.source, kwargs)  # each rank reads only its partition's bytes
            if model is not None:
                return model
        return AutoModelForCausalLM.from_pretrained(self.source, **kwargs)

    def prepare(self, accelerator, device: torch.device) -> None:
        """Load (if needed) and prepare the teacher. Collective under DeepSpeed: call on every rank, once."""
        if self.prepared:
            return
        if uses_two_plugins(accelerator):
            with teacher_plugin_selected(accelerator):
                model = self._load()
                _freeze(model)
                add_fused_distillation_forward(model)
                with _accelerator_state_kept(accelerator):
                    engine = accelerator.prepare(model)
            engine.eval()
        else:
            model = self._load()
            _freeze(model)
            add_fused_distillation_forward(model)
            engine = model.to(device)
        self.module, self.engine = model, engine
        if isinstance(self.source, PreTrainedModel):
            self.source = model

    @torch.no_grad()
    def features(self, model_inputs: dict, positions: torch.Tensor | None = None) -> LossFeatures:
        """What the loss needs of the teacher at sequence `positions` (all if None): its last hidden states
        ``[B, K, H_t]`` and lm_head, or its own logits ``[B, K, V_t]`` on the exact path. Every rank must call it:
        ZeRO-3 gathers are collective."""
        if not self.prepared:
            raise RuntimeError(
                "The teacher is not prepared. DistillationTrainer prepares it in get_train_dataloader(), "
                "get_eval_dataloader() and get_test_dataloader(); call one of them (or train/evaluate/predict) "
                "before computing a loss."
            )
        return self.engine(**model_inputs, fused_distillation=_as_is, loss_positions=positions)


SELF = "self"


class SelfTeacher:
    """Self-distillation of a LoRA student: the teacher is the student's own frozen base model with its adapters
    disabled, so no second copy of the base weights exists. Same interface as `Teacher`."""

    def __init__(self, peft_model: nn.Module):
        self.peft_model = peft_model
        self.module = peft_model.get_base_model()
        self.config = self.module.config
        self.engine = None

    prepared = True
    name = SELF

    def prepare(self, accelerator, device: torch.device) -> None:
        """Nothing to load or prepare: the student's engine already holds the weights."""

    def generation(self, num_processes: int) -> tuple[nn.Module, object, bool]:
        """Sampling from the base: the PEFT model with its adapters disabled."""
        return self.peft_model, self.peft_model.disable_adapter, False

    @torch.no_grad()
    def features(self, model_inputs: dict, positions: torch.Tensor | None = None) -> LossFeatures:
        was_training = self.module.training
        self.module.eval()  # the frozen base, without dropout
        try:
            # adapters off: a trained `modules_to_save` lm_head falls back to the original too
            with self.peft_model.disable_adapter():
                return self.module(**model_inputs, fused_distillation=_as_is, loss_positions=positions)
        finally:
            self.module.train(was_training)


def _as_is(features: LossFeatures) -> LossFeatures:
    return features


def _freeze(model: nn.Module) -> None:
    model.eval()
    model.requires_grad_(False)


def resolve_teacher(teacher_model, args, eval_dataset, student, peft_config):
    """What the student learns from: ``(teacher, source)``, one of them None.

    `teacher_model` (else ``args.teacher_model_name_or_path``) becomes a `Teacher`, ``"self"`` the marker `SELF`
    (a `SelfTeacher` once the PEFT student exists); ``args.teacher_cache`` replaces the teacher by a `TeacherCache`,
    ``args.teacher_server`` by a `ServedTeacherSignal` (`teacher_model` then names the served model).
    """
    from .cache.reader import TeacherCache
    from .served_signal import ServedTeacherSignal

    if isinstance(teacher_model, TrainingArguments):
        raise TypeError("DistillationTrainer(model, teacher_model, args, ...): "
                        "the second positional argument is the teacher. Pass the training arguments by keyword, "
                        "`args=...`.")
    teacher_model = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
    if args.teacher_server is not None:
        if args.teacher_cache is not None:
            raise ValueError("Pass either --teacher_server (a served teacher) or --teacher_cache (a cache of it) for "
                             "training, not both; `cache-teacher --teacher_server URL --teacher_cache DIR` writes the "
                             "cache from the server.")
        if teacher_model is not None and not isinstance(teacher_model, str):
            raise ValueError("With teacher_server the teacher runs on the server: pass its served name (a string) or "
                             "nothing as the teacher, not a model.")
        return None, ServedTeacherSignal(args.teacher_server, teacher_model, args.teacher_server_top_k,
                                         args.teacher_server_timeout, args.teacher_server_concurrency)
    if args.teacher_cache is not None:
        if teacher_model is not None:
            logger.warning("Training from the teacher cache %s: the teacher %s is not loaded.", args.teacher_cache,
                           teacher_model if isinstance(teacher_model, str) else "model")
        if eval_dataset is not None:
            raise ValueError("Evaluation needs the teacher's distribution on the eval split, which the teacher cache "
                             "does not hold: pass no eval_dataset (--eval_strategy no) with teacher_cache.")
        return None, TeacherCache(args.teacher_cache)
    if teacher_model is None:
        raise ValueError("No teacher: pass `teacher_model=` or set `teacher_model_name_or_path` in the config.")
    if isinstance(teacher_model, str) and teacher_model == SELF:
        if peft_config is None and not hasattr(student, "disable_adapter"):
            raise ValueError(
                "teacher 'self' (self-distillation) uses the student's base model with its LoRA adapters disabled, so "
                "it needs a PEFT student: pass `peft_config=` (CLI: --use_peft)."
            )
        return SELF, None
    return Teacher(teacher_model, args.teacher_model_init_kwargs), None
