"""A teacher model run here, frozen: its DeepSpeed plugin, load (partitioned from the start), prepare once, the
once-per-step pass, features for the loss, a model to sample from, the top-k for a cache; never saved.

With DeepSpeed the teacher has its own plugin ("teacher", ZeRO-3 inference) beside the student's ("student").
It is loaded while its plugin is selected, so `from_pretrained` runs under `zero.Init` and no rank ever holds
the whole teacher; it is prepared into its own engine without disturbing what the Trainer relies on (the
engine that receives `backward`, the config `save_model` reads; `compat.accelerator_state_kept`); the student's
plugin is selected again in every case.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import TYPE_CHECKING

import torch
from accelerate.utils import DeepSpeedPlugin
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.integrations import is_deepspeed_zero3_enabled

from ..compat import accelerator_state_kept, sequence_parallelism_hidden
from ..data.batch import EXTRAS, loss_tokens
from ..loss.sparse import top_k_teacher_signal
from ..model.fused_forward import LossFeatures, add_fused_distillation_forward, features_only, gathered, hidden_size
from ..model.logit_check import announce, probe_inputs, settle_logit_paths
from ..runtime.deepspeed_config import build_teacher_config
from ..runtime.fsdp2 import TeacherShardSettings, is_fsdp2, world_mesh
from ..runtime.guards import check_teacher_finite
from ..runtime.sequence_parallel import check_sharded_attention
from ..runtime.validation import check_model_path, check_tokenizers_match, check_weights_complete
from .base import TeacherSource
from .capabilities import (
    LogitChecked,
    OwnEngine,
    OwnRows,
    OwnVocabulary,
    Samples,
    ScoresSamples,
    StepHooks,
    WritesCache,
)
from .fsdp2_loading import load_sharded, release_root, shard, teacher_bytes
from .rows import DenseRows
from .step_pass import TeacherStepPass
from .zero3_loading import load_partitioned, loadable

if TYPE_CHECKING:
    from ..run_plan import TeacherEngine

logger = logging.getLogger(__name__)

STUDENT, TEACHER = "student", "teacher"
# Loss tokens projected through the teacher's lm_head at a time when writing a cache (bounds the [rows, V] logits)
_ROWS_PER_PROJECTION = 256


def uses_two_plugins(accelerator, name: str = TEACHER) -> bool:
    """Whether the accelerator holds the teacher plugin `name` beside the student's."""
    plugins = getattr(accelerator.state, "deepspeed_plugins", None)
    return isinstance(plugins, dict) and name in plugins


@contextlib.contextmanager
def teacher_plugin_selected(accelerator, name: str = TEACHER):
    """Select the teacher's DeepSpeed plugin `name` for the block; always select the student's again after it."""
    accelerator.state.select_deepspeed_plugin(name)
    try:
        yield accelerator.state.get_deepspeed_plugin(name)
    finally:
        accelerator.state.select_deepspeed_plugin(STUDENT)


class LiveTeacher(TeacherSource, OwnEngine, OwnVocabulary, StepHooks, LogitChecked, ScoresSamples, Samples,
                  WritesCache, OwnRows):
    """A frozen teacher model, loaded lazily and prepared exactly once (ZeRO-3 under DeepSpeed).

    Args:
        source: a `PreTrainedModel`, or a path / hub id to load with `from_pretrained`.
        init_kwargs: keyword arguments for `from_pretrained` (ignored for a model instance).
        tokenizer: the teacher's own tokenizer, when it has one (checked against the student's as it attaches).
    """

    plugin_name = TEACHER
    """Its DeepSpeed plugin's name beside the student's (one per teacher when several teach: `panel`)."""
    label = "teacher"
    """What the logit-path check calls it."""
    deepspeed_config = None
    """Its own DeepSpeed config (path, JSON string or dict); None: `teacher_deepspeed`, else derived."""
    fsdp_config = None
    """Its own FSDP2 settings beside an FSDP2 student (as `teacher_fsdp_config`); None: `teacher_fsdp_config`."""
    routes_own_rows = True  # routed among several: its forward runs on its own rows only

    def __init__(self, source: str | os.PathLike | PreTrainedModel, init_kwargs: dict | None = None, tokenizer=None):
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
        self.tokenizer = tokenizer
        self.module: nn.Module | None = None  # the unwrapped model
        self.engine: nn.Module | None = None  # what runs the forward: a DeepSpeed engine or the module
        self.step_pass: TeacherStepPass | None = None
        self.config_notes: list[str] = []
        self.held_whole = False  # beside a one-process DeepSpeed student: no ZeRO-3 engine
        self.sharded = False  # beside an FSDP2 student: sharded with FSDP2 on its own (`fsdp2_loading`)
        self.whole_dtype: torch.dtype | None = None  # then: the dtype its engine would have cast it to

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

    @property
    def revision(self) -> str | None:
        return self.init_kwargs.get("revision")

    def describe(self) -> str:
        return f"the model {self.name}"

    def plugins(self, engine: TeacherEngine, student_plugin) -> dict[str, DeepSpeedPlugin]:
        """Its plugin (`plugin`) by its name beside the student's; none without one."""
        plugin = self.plugin(engine, student_plugin)
        return {} if plugin is None else {self.plugin_name: plugin}

    def plugin(self, engine: TeacherEngine, student_plugin) -> DeepSpeedPlugin | None:
        """The teacher's own DeepSpeed plugin beside `student_plugin`: ZeRO-3 inference unless the plan's `engine`
        (`teacher_deepspeed`) says otherwise (see `deepspeed_config.build_teacher_config`). `config_notes` says what
        was filled. None for a student without DeepSpeed (the teacher then runs on the training device)."""
        if student_plugin is None:
            if engine.deepspeed is not None or self.deepspeed_config is not None:
                what = "`teacher_deepspeed`" if self.deepspeed_config is None else f"{self.label}'s `deepspeed`"
                if engine.fsdp_student:
                    own = "`teacher_fsdp_config`" if self.deepspeed_config is None else f"{self.label}'s `fsdp`"
                    raise ValueError(f"{what} is set beside an FSDP student, whose teachers are sharded with FSDP2: "
                                     f"give its settings as {own} instead.")
                raise ValueError(
                    f"{what} is set but the student does not use DeepSpeed. Pass `deepspeed=` (e.g. a "
                    "ZeRO-2 config) or launch with `accelerate launch --use_deepspeed`."
                )
            return None
        self.config_notes = []
        given = self.deepspeed_config if self.deepspeed_config is not None else engine.deepspeed
        if given is None and engine.world_size == 1:  # nothing to partition over: held whole, no per-module hooks
            self.held_whole = True
            self.whole_dtype = torch.bfloat16 if engine.bf16 else torch.float16 if engine.fp16 else None
            return None
        config = build_teacher_config(given, student_plugin.deepspeed_config, engine,
                                      hidden_size(self.config), notes=self.config_notes)
        stage = config["zero_optimization"].get("stage", 0)
        if engine.seq_kd and stage == 3:
            # Sampling runs the teacher's own lm_head, which our loss gathers itself; DeepSpeed's prefetcher would
            # then have it in flight when the loss gathers it (deepspeed 0.19.8). Fetch on demand instead.
            config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        return DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=stage == 3)

    def generation(self, num_processes: int) -> tuple[nn.Module, object, bool]:
        """``(model, context, synced_gpus)`` for sampling from the teacher: a partitioned teacher samples with every
        rank stepping until all ranks are done."""
        partitioned = self.engine is not self.module or self.sharded
        return self.module, contextlib.nullcontext, num_processes > 1 and partitioned

    def _load(self) -> PreTrainedModel:
        from ..errors import ExternalError
        from ..runtime.validation import expected_parameters, missing_tensors_message, unfilled, weights_file

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
        model, info = AutoModelForCausalLM.from_pretrained(self.source, output_loading_info=True, **kwargs)
        # A parameter the checkpoint lacks is left randomly initialised (transformers only logs it): refuse. Tied
        # weights are filled by either of their names; the model's own ignore patterns are honoured.
        loaded = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(info["missing_keys"])
        missing = unfilled(expected_parameters(model), loaded, getattr(model, "_keys_to_ignore_on_load_missing", None))
        if missing:
            raise ExternalError(missing_tensors_message("teacher_model", weights_file(self.source), missing))
        return model

    def prepare(self, accelerator, device: torch.device) -> None:
        """Load (if needed) and prepare the teacher. Collective under DeepSpeed: call on every rank, once."""
        if self.prepared:
            return
        if is_fsdp2(accelerator):
            model = engine = self._load_sharded(accelerator, device)
        elif uses_two_plugins(accelerator, self.plugin_name):
            with teacher_plugin_selected(accelerator, self.plugin_name):
                model = self._load()
                freeze(model)
                add_fused_distillation_forward(model)
                if self.context is not None:  # (a teacher prepared on its own has no run settings to check)
                    check_sharded_attention(model, self.context.plan.parallelism, "teacher")
                with accelerator_state_kept(accelerator), sequence_parallelism_hidden(accelerator):
                    engine = accelerator.prepare(model)  # its own engine: the student's alone sets up Ulysses
            engine.eval()
        else:
            model = self._load()
            freeze(model)
            add_fused_distillation_forward(model)
            engine = model.to(device)
            if self.held_whole:
                logger.info("trl_distill: one process: the %s is held whole on %s (%.2f GiB, %s), without ZeRO-3's "
                            "partitioning and its per-module hooks; on several processes, or with teacher_deepspeed, "
                            "it is partitioned with ZeRO-3.", self.label, device,
                            sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, model.dtype)
        self.module, self.engine = model, engine
        if isinstance(self.source, PreTrainedModel):
            self.source = model

    def _load_sharded(self, accelerator, device: torch.device) -> nn.Module:
        """Beside an FSDP2 student: the teacher sharded with FSDP2 over its own mesh, each rank reading its rows of a
        local safetensors checkpoint; anything else is loaded whole on each rank, then sharded."""
        settings = self.shard_settings()
        mesh = world_mesh(accelerator)
        kwargs = {"trust_remote_code": False, **self.init_kwargs}
        kwargs.pop("device_map", None)
        model = None
        if isinstance(self.source, str) and loadable(self.source, kwargs):
            model = load_sharded(self.source, kwargs, mesh, device, settings.reshard_after_forward)
        if model is None:
            logger.info("trl_distill: the %s is loaded whole on each rank, then sharded with FSDP2 (partitioned "
                        "loading reads a local safetensors directory).", self.label)
            model = shard(self._load(), mesh, settings.reshard_after_forward).to(device)
        freeze(model)
        add_fused_distillation_forward(model)
        if self.context is not None:
            check_sharded_attention(model, self.context.plan.parallelism, "teacher")
        self.sharded = True
        held, total = teacher_bytes(model)
        logger.info("trl_distill: the %s is sharded with FSDP2 over %d ranks: this rank holds %.2f of its %.2f MiB "
                    "(%s).", self.label, accelerator.num_processes, held / 2**20, total / 2**20,
                    next(model.parameters()).dtype)
        return model

    def shard_settings(self) -> TeacherShardSettings:
        """Its FSDP2 settings beside an FSDP2 student: its own (`fsdp_config`), else `teacher_fsdp_config`."""
        given = self.context.plan.teacher_settings.fsdp_config if self.context is not None else None
        return TeacherShardSettings.parse(self.fsdp_config if self.fsdp_config is not None else given)

    def vocab_config(self, student_config):
        return self.config

    def attach(self, context) -> None:
        """Its dtype follows the student's unless `teacher_model_init_kwargs` names one; its tokenizer must map tokens
        to the student's ids; the once-per-step pass gets the run."""
        super().attach(context)
        given = context.plan.teacher_settings.fsdp_config
        if not is_fsdp2(context.accelerator) and (self.fsdp_config or given) is not None:
            what = "`teacher_fsdp_config`" if self.fsdp_config is None else f"{self.label}'s `fsdp`"
            raise ValueError(f"{what} is set but the student does not use FSDP2. Launch with an FSDP2 config (e.g. "
                             "configs/accelerate/fsdp2_student_fsdp2_teacher.yaml, or fsdp_config={'fsdp_version': 2}) "
                             "or drop it.")
        if not {"dtype", "torch_dtype"} & set(self.init_kwargs):  # (held whole beside a DeepSpeed student: the
            # dtype its ZeRO-3 engine would have cast it to; sharded beside an FSDP2 student: its own, else the
            # student's mixed precision)
            precision = context.plan.precision
            dtype = (self.shard_settings().torch_dtype(context.student.dtype, precision.bf16, precision.fp16)
                     if is_fsdp2(context.accelerator) else self.whole_dtype or context.student.dtype)
            self.init_kwargs["dtype"] = dtype
        check_tokenizers_match(context.processing_class, self.tokenizer)
        self.step_pass = TeacherStepPass(context, self)

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
        return self.engine(**model_inputs, fused_distillation=features_only, loss_positions=positions)

    # ---- In training: the step pass, the logit check, the loss's teacher rows ----

    def logit_candidates(self, model_inputs: dict, extras) -> list[tuple[str, object, object, dict]]:
        return [(self.label, self.engine, self.module, model_inputs)]

    def before_step(self, batch_samples: list[dict]) -> None:
        self.step_pass.before_step(batch_samples)

    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> DenseRows:
        run = self.context
        rows = self.step_pass.take(model_inputs) if run.training else None  # computed ahead for the step
        if rows is not None:
            return rows
        # Every rank runs every teacher forward, even with no loss token: ZeRO-3 gathers are collective.
        features = self.features(model_inputs, keep)
        check_teacher_finite(features.states, run.accelerator, f"step {run.step + 1}",
                             run.deferred if run.training else None)
        return DenseRows(features.states, features.head)

    def after_loss(self) -> None:
        self.step_pass.after_loss()
        if self.sharded and self.step_pass.idle:  # the step's last loss has read the lm_head
            release_root(self.module)

    def score_sampled(self, batch: dict, source: dict | None = None) -> None:
        """Nothing to add: it runs on the sampled batch itself."""

    def release(self) -> None:
        """Nothing computed ahead outlives training (nor the held lm_head)."""
        if self.step_pass is not None:
            self.step_pass.release()
        if self.sharded:
            release_root(self.module)

    # ---- cache-teacher ----

    def open_for_cache(self, columns, top_k: int) -> None:
        """Prepare the teacher (collective) and check its fused logits against its own on the first row."""
        run = self.context
        self.prepare(run.accelerator, run.device)
        batch = _model_inputs(run.prepare_inputs(run.collate([columns[0]])))
        (path,) = settle_logit_paths([("teacher", self.engine, self.module)], probe_inputs(batch), run.accelerator)
        announce([path], run.accelerator, run.vocab_size, batch["input_ids"].numel())

    def cache_records(self, columns, mine: list[range], steps: int, filler: range, top_k: int,
                      temperature: float) -> list[dict]:
        records = []
        for step in range(steps):
            # A rank with no batch left runs `filler` again and drops it: every forward is collective.
            rows = mine[step] if step < len(mine) else filler
            out = self._top_k_rows(columns, rows, top_k, temperature, f"cache row {rows.start}")
            records += out if step < len(mine) else []
        if self.sharded:  # the forwards left its root group (embeddings, norm, lm_head) gathered
            release_root(self.module)
        return records

    @torch.no_grad()
    def _top_k_rows(self, columns, rows: range, top_k: int, temperature: float, where: str) -> list[dict]:
        """The sparse teacher signal of the prepared rows `rows`, one record per row."""
        run = self.context
        examples = [columns[i] for i in rows]
        batch = run.prepare_inputs(run.collate(examples))
        _, mask = loss_tokens(batch)  # position t predicts labels[t + 1], as in training
        batch = _model_inputs(batch)
        keep = mask.any(0).nonzero().squeeze(1)
        features, vocab = self.features(batch, keep), run.vocab_size
        check_teacher_finite(features.states, run.accelerator, where)  # what a cache holds persists: check it
        records = []
        with gathered(*(features.head.params if features.head is not None else ())):
            for b, row in enumerate(rows):
                kept = mask[b, keep].nonzero().squeeze(1)
                parts = []
                for start in range(0, kept.numel(), _ROWS_PER_PROJECTION):
                    states = features.states[b, kept[start : start + _ROWS_PER_PROJECTION]]
                    logits = states.float() if features.head is None else features.head.logits(states)
                    parts.append(top_k_teacher_signal(logits[:, :vocab], top_k, temperature))
                if parts:
                    ids, log_probs, tail = (torch.cat(x) for x in zip(*parts, strict=True))
                else:
                    ids, log_probs, tail = torch.empty(0, top_k), torch.empty(0, top_k), torch.empty(0)
                records.append({"row": row, "input_ids": examples[b]["input_ids"],
                                "positions": keep[kept].cpu().numpy(), "top_k_ids": ids.cpu().numpy(),
                                "top_k_log_probs": log_probs.cpu().numpy(), "tail_log_prob": tail.cpu().numpy()})
        return records


def _model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in ("labels", "shift_labels", EXTRAS)}


def freeze(model: nn.Module) -> None:
    model.eval()
    model.requires_grad_(False)
