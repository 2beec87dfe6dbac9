"""`DistillationTrainer`: `trl.SFTTrainer` with a frozen teacher, which DeepSpeed can partition (ZeRO-3) beside
a student trained with any ZeRO stage (or without DeepSpeed)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from functools import partial

import torch
from accelerate.utils import DeepSpeedPlugin
from transformers import PreTrainedModel, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import SFTConfig, SFTTrainer

from .cache.reader import ROW, TeacherCache, pop_signal, train_from_cache
from .checkpoints import mark_complete, resolve_resume
from .config import DistillationConfig
from .data import resolve_assistant_only_loss
from .deepspeed_config import build_teacher_config
from .logit_check import probe_inputs, settle_logit_paths
from .losses import chunked_distillation_loss
from .modeling import LossFeatures, add_fused_distillation_forward, gathered, hidden_size
from .on_policy import DATASET, completion_source, sample_completions
from .on_policy import STUDENT as STUDENT_SOURCE
from .sparse_losses import sparse_distillation_loss
from .teacher import SELF, STUDENT, TEACHER, SelfTeacher, Teacher
from .validation import check_dataset_not_empty, check_teacher_finite, check_tokenizers_match

logger = logging.getLogger(__name__)


class DistillationTrainer(SFTTrainer):
    """Distil `teacher_model` into `model` on an SFT dataset (language modeling, prompt–completion or messages).

    A drop-in for `trl.SFTTrainer` with one more argument. The loss is
    ``alpha * KD + (1 - alpha) * CE`` on completion tokens (see [`DistillationConfig`]); `kd_loss` and `ce_loss`
    are logged beside `loss`.

    With DeepSpeed (``args.deepspeed``, or ``accelerate launch --use_deepspeed``) the student keeps its own config
    (ZeRO-2 is the usual choice) and the teacher gets a separate ZeRO-3 inference engine (``args.teacher_deepspeed``
    or a derived one): each of N ranks holds 1/N of the teacher, loaded that way from the start. Unlike
    `trl.DistillationTrainer`, which replicates the teacher unless the student is ZeRO-3 and is on-policy only,
    this trainer distils off-policy on the dataset's completions.

    Args:
        model: the student, a `PreTrainedModel` or a path / hub id.
        teacher_model: the teacher, a `PreTrainedModel` or a path / hub id; defaults to
            ``args.teacher_model_name_or_path``. Passing a path lets DeepSpeed load it already partitioned.
        args: a [`DistillationConfig`]; a stock `TrainingArguments` or `SFTConfig` is converted (distillation
            fields at their defaults).
        The other arguments are `trl.SFTTrainer`'s.
    """

    _tag_names = ["trl", "sft", "distillation", "trl-distill"]
    _name = "Distillation"

    def __init__(
        self,
        model: str | PreTrainedModel,
        teacher_model: str | PreTrainedModel | None = None,
        args: DistillationConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        peft_config=None,
        formatting_func=None,
    ):
        if isinstance(teacher_model, TrainingArguments):
            raise TypeError(
                "DistillationTrainer(model, teacher_model, args, ...): the second positional argument is the teacher. "
                "Pass the training arguments by keyword, `args=...`."
            )
        if args is None:
            args = DistillationConfig(output_dir="distilled-model")
        elif not isinstance(args, DistillationConfig):
            args = _as_distillation_config(args)
        teacher_model = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        self.teacher_cache = TeacherCache(args.teacher_cache) if args.teacher_cache is not None else None
        if self.teacher_cache is not None:
            if teacher_model is not None:
                logger.warning("Training from the teacher cache %s: the teacher %s is not loaded.",
                               args.teacher_cache, teacher_model if isinstance(teacher_model, str) else "model")
            if eval_dataset is not None:
                raise ValueError("Evaluation needs the teacher's distribution on the eval split, which the teacher "
                                 "cache does not hold: pass no eval_dataset (--eval_strategy no) with teacher_cache.")
            teacher_model = None
        elif teacher_model is None:
            raise ValueError("No teacher: pass `teacher_model=` or set `teacher_model_name_or_path` in the config.")
        check_dataset_not_empty(train_dataset, "train", "given")
        self._self_distillation = isinstance(teacher_model, str) and teacher_model == SELF
        if self._self_distillation and peft_config is None and not hasattr(model, "disable_adapter"):
            raise ValueError(
                "teacher 'self' (self-distillation) uses the student's base model with its LoRA adapters disabled, so "
                "it needs a PEFT student: pass `peft_config=` (CLI: --use_peft)."
            )
        self.teacher = None if self._self_distillation or teacher_model is None else Teacher(
            teacher_model, args.teacher_model_init_kwargs
        )
        if args.assistant_only_loss is None:
            processing_class = processing_class or _student_tokenizer(model, train_dataset)
            args.assistant_only_loss = resolve_assistant_only_loss(None, train_dataset, processing_class)
        output_dir_existed = os.path.exists(args.output_dir)
        super().__init__(
            model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config,
            formatting_func=formatting_func,
        )
        if self.aux_loss_enabled:
            raise ValueError(
                "A Mixture-of-Experts student with a router load-balancing loss is not supported yet: the "
                "distillation loss would silently drop it. Set `router_aux_loss_coef=0.0` to train without it."
            )
        student = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_fused_distillation_forward(student)
        if self._self_distillation:
            if not hasattr(self.model, "disable_adapter"):
                raise ValueError("teacher 'self' needs a PEFT student; the student is not a PeftModel.")
            self.teacher = SelfTeacher(self.model)
        elif self.teacher is not None and not {"dtype", "torch_dtype"} & set(self.teacher.init_kwargs):
            self.teacher.init_kwargs["dtype"] = student.dtype
        teacher_config = student.config if self.teacher is None else self.teacher.config
        try:
            self.vocab_size = self._shared_vocab_size(student.config, teacher_config, self.processing_class)
            if self.teacher_cache is not None:
                train_from_cache(self, self.teacher_cache)
            elif not self._self_distillation:
                check_tokenizers_match(self.processing_class, self.teacher.source)
            check_dataset_not_empty(self.train_dataset, "train", "prepared", args.max_length)
            evaluation = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
            for name, dataset in evaluation.items():
                check_dataset_not_empty(dataset, name, "prepared", args.max_length)
        except ValueError:
            if not output_dir_existed and os.path.isdir(args.output_dir) and not os.listdir(args.output_dir):
                os.rmdir(args.output_dir)  # the Trainer created it empty; leave nothing behind
            raise
        # Our loss sums over completion tokens and divides by their count over the accumulated, all-rank batch:
        # ask the Trainer for that count (`num_items_in_batch`), taken over the shifted labels. Both attributes
        # are the Trainer's own (`_loss_shifts_labels` is private; checked against transformers 5.24).
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = True
        self._distill_sums = {"kd_loss": 0.0, "ce_loss": 0.0}
        self._generation_stats = dict.fromkeys(("micro_steps", "on_policy", "rows", "tokens"), 0)
        self.last_completions = None
        self._distill_last_logged_step = 0
        self._logit_paths = None  # settled on the first batch (`_settle_logit_paths`)
        self.add_callback(_LogStepSync(self))

    # ---- Setup: two DeepSpeed plugins, teacher prepared once after the Trainer's `free_memory()` ----

    def _build_accelerator_args(self, **kwargs):
        """Give the Accelerator two plugins, {"student": the Trainer's, "teacher": ZeRO-3 inference}."""
        accelerator_args = super()._build_accelerator_args(**kwargs)
        student_plugin = accelerator_args.get("deepspeed_plugin")
        if self._self_distillation or self.teacher is None:
            if self.args.teacher_deepspeed is not None:
                logger.warning("Ignoring `teacher_deepspeed`: the teacher is 'self' or a cache; it has no engine.")
            return accelerator_args
        if student_plugin is None:
            if self.args.teacher_deepspeed is not None:
                raise ValueError(
                    "`teacher_deepspeed` is set but the student does not use DeepSpeed. Pass `deepspeed=` (e.g. a "
                    "ZeRO-2 config) or launch with `accelerate launch --use_deepspeed`."
                )
            return accelerator_args
        self._teacher_config_notes = []
        config = build_teacher_config(self.args.teacher_deepspeed, student_plugin.deepspeed_config, self.args,
                                      hidden_size(self.teacher.config), notes=self._teacher_config_notes)
        stage = config["zero_optimization"].get("stage", 0)
        if self.args.seq_kd and stage == 3:
            # Sampling runs the teacher's own lm_head, which our loss gathers itself; DeepSpeed's prefetcher would
            # then have it in flight when the loss gathers it (deepspeed 0.19.8). Fetch on demand instead.
            config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        if self.args.lmbda > 0 and student_plugin.zero_stage == 3:
            raise ValueError(
                "On-policy distillation (lmbda > 0) with a ZeRO-3 student is not supported yet: sample from a ZeRO-2 "
                "(or ZeRO-0/1) student, or set lmbda=0."
            )
        teacher_plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=stage == 3)
        accelerator_args["deepspeed_plugin"] = {STUDENT: student_plugin, TEACHER: teacher_plugin}
        return accelerator_args

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`, resuming only from complete checkpoints (see `trl_distill.checkpoints`)."""
        if self.is_deepspeed_enabled and self.model_wrapped is not self.model:
            # An engine from evaluate() or an earlier train(): the Trainer's free_memory() is about to destroy it,
            # and the stock Trainer would then skip preparing the student (no engine for `backward`).
            self.model_wrapped, self.deepspeed = self.model, None
        resume_from_checkpoint = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()  # every rank's optimizer shard and RNG state is on disk
        if self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            mark_complete(os.path.join(self._get_output_dir(trial), name))

    def _print_engine_configs(self) -> None:
        """Rank 0 prints the effective DeepSpeed config of both engines, once, as training starts."""
        plugins = getattr(self.accelerator.state, "deepspeed_plugins", None)
        if not isinstance(plugins, dict) or getattr(self, "_engine_configs_printed", False):
            return
        self._engine_configs_printed = True
        if self.accelerator.is_main_process:  # global rank 0 (accelerator.print prints once per node)
            for name, plugin in plugins.items():
                notes = getattr(self, "_teacher_config_notes", []) if name == TEACHER else []
                note = f" ({'; '.join(notes)})" if notes else ""
                print(f"trl_distill: {name} DeepSpeed config{note}: {json.dumps(plugin.deepspeed_config)}", flush=True)

    def _prepare_teacher(self) -> None:
        if self.teacher is not None:  # None: training from a teacher cache
            self.teacher.prepare(self.accelerator, self.args.device)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self.teacher_cache is not None and ROW not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, ROW]  # keep each row's index into the cache

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        self._prepare_teacher()  # after `train()`'s free_memory(), on every rank
        return dataloader

    def get_eval_dataloader(self, eval_dataset=None):
        dataloader = super().get_eval_dataloader(eval_dataset)
        self._prepare_teacher()
        return dataloader

    def get_test_dataloader(self, test_dataset):
        dataloader = super().get_test_dataloader(test_dataset)
        self._prepare_teacher()  # predict()
        return dataloader

    def evaluation_loop(self, *args, **kwargs):
        student_plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        if student_plugin is None or self.deepspeed is not None or student_plugin.zero_stage == 3:
            return super().evaluation_loop(*args, **kwargs)
        # Before `train()` the stock loop would build a ZeRO-3 inference engine for the student, which refuses a
        # ZeRO-0/1/2 config. Such a student holds all its weights on every rank: evaluate the module as it is.
        # (The loop reads `is_deepspeed_enabled` only to decide that; checked against transformers 5.24.)
        self.is_deepspeed_enabled = False
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.is_deepspeed_enabled = True

    @staticmethod
    def _shared_vocab_size(student_config, teacher_config, tokenizer) -> int:
        """Compare distributions on the tokenizer's length: padded embedding rows beyond it are ignored."""
        student_vocab = student_config.get_text_config().vocab_size
        teacher_vocab = teacher_config.get_text_config().vocab_size
        shared = min(student_vocab, teacher_vocab)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
        if tokenizer is not None and hasattr(tokenizer, "__len__"):
            if len(tokenizer) > shared:
                raise ValueError(
                    f"Student and teacher vocabularies differ: the student's lm_head has {student_vocab} rows, the "
                    f"teacher's {teacher_vocab}, and the tokenizer has {len(tokenizer)} tokens. Distillation needs "
                    "one tokenizer shared by both models."
                )
            return len(tokenizer)
        if student_vocab != teacher_vocab:
            raise ValueError(
                f"Student and teacher vocabularies differ ({student_vocab} vs {teacher_vocab}) and no tokenizer says "
                "which rows they share. Pass `processing_class=` (the tokenizer both models use)."
            )
        return shared

    # ---- On-policy / sequence-level KD: completions sampled by the student or the teacher ----

    def training_step(self, model, inputs, num_items_in_batch=None):
        args = self.args
        source = completion_source(args.lmbda, args.seq_kd, args.seed, self.state.global_step)
        self._generation_stats["micro_steps"] += 1
        if source != DATASET:
            inputs, completions = self._sample_completions(source, self._prepare_inputs(inputs))
            self.last_completions = (source, completions)
            self._generation_stats["on_policy"] += source == STUDENT_SOURCE
            self._generation_stats["rows"] += len(completions)
            self._generation_stats["tokens"] += sum(len(c) for c in completions)
            num_items_in_batch = None  # generated lengths differ from the dataset's: a per-micro-batch token mean
        return super().training_step(model, inputs, num_items_in_batch)

    def _sample_completions(self, source: str, batch: dict) -> tuple[dict, list[torch.Tensor]]:
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        eos_ids = {tokenizer.eos_token_id}
        kwargs = dict(max_new_tokens=self.args.max_new_tokens, do_sample=True,
                      temperature=self.args.generation_temperature, top_p=self.args.generation_top_p,
                      top_k=self.args.generation_top_k, eos_token_id=sorted(eos_ids))
        several = self.accelerator.num_processes > 1
        if source == STUDENT_SOURCE:
            model, context = self.accelerator.unwrap_model(self.model_wrapped), contextlib.nullcontext
            student_plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
            synced = several and student_plugin is not None and student_plugin.zero_stage == 3
        elif isinstance(self.teacher, SelfTeacher):
            model, context, synced = self.teacher.peft_model, self.teacher.peft_model.disable_adapter, False
        else:  # a partitioned teacher: every rank steps until all ranks are done
            model, context, synced = self.teacher.module, contextlib.nullcontext, several and self.teacher.engine \
                is not self.teacher.module
        new_batch, completions = sample_completions(model, batch, kwargs, tokenizer.pad_token_id, eos_ids,
                                                    synced, context)
        return {k: v.to(batch["input_ids"].device) for k, v in new_batch.items()}, completions

    # ---- Loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``alpha * KD + (1 - alpha) * CE`` over completion tokens, normalised like the HF Trainer's loss."""
        args = self.args
        labels = inputs["labels"]
        cached = pop_signal(inputs)
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        target = inputs["shift_labels"] if "shift_labels" in inputs else labels[:, 1:]
        mask = target != -100
        # Sequence positions with a loss token in some row: the only ones either model projects (position t
        # predicts target t); the selected rows keep the (row, position) order on every path.
        keep = mask.any(0).nonzero().squeeze(1)
        mask, target = mask[:, keep], target[:, keep]
        if self._logit_paths is None:
            self._settle_logit_paths(model, model_inputs, mask)
        teacher = None
        if cached is None:  # else the teacher's top-k comes from the cache; no teacher runs
            # Every rank runs every teacher forward, even with no loss token: ZeRO-3 gathers are collective.
            teacher = self.teacher.features(model_inputs, keep)
            check_teacher_finite(teacher.states, self.accelerator, self.state.global_step + 1)
        loss_fn = partial(self._fused_loss, teacher=teacher, cached=cached, target=target, mask=mask,
                          num_items_in_batch=num_items_in_batch)
        kd, ce = model(**model_inputs, fused_distillation=loss_fn, loss_positions=keep)
        if args.kd_temperature_scaling:
            kd = kd * args.temperature**2
        loss = args.alpha * kd + (1.0 - args.alpha) * ce
        if args.average_tokens_across_devices and num_items_in_batch is not None:
            # `num_items_in_batch` counts every rank's tokens and DeepSpeed/DDP average gradients across ranks
            scale = self.accelerator.num_processes // self.get_tp_size()
            loss, kd, ce = loss * scale, kd * scale, ce * scale
        if num_items_in_batch is None and self.model.training:
            # a per-micro-batch mean: the Trainer divides the loss by the accumulation steps; log alike
            kd, ce = kd / self.current_gradient_accumulation_steps, ce / self.current_gradient_accumulation_steps
        self._record(kd, ce, batch_size=target.shape[0])
        if return_outputs:
            return loss, {"kd_loss": kd.detach(), "ce_loss": ce.detach()}
        return loss

    def _settle_logit_paths(self, model, model_inputs: dict, mask: torch.Tensor) -> None:
        """Once, on the first batch: check each model's fused logits against its own and pick its path (see
        `trl_distill.logit_check`); rank 0 says which path each model takes."""
        student = self.accelerator.unwrap_model(model)
        student = student.get_base_model() if hasattr(student, "get_base_model") else student
        candidates = [("student", model, student)]
        if self.teacher is not None and not isinstance(self.teacher, SelfTeacher):  # self: the student's own base
            candidates.append(("teacher", self.teacher.engine, self.teacher.module))
        self._logit_paths = settle_logit_paths(candidates, probe_inputs(model_inputs), self.accelerator)
        if self.accelerator.is_main_process:
            for path in self._logit_paths:
                print(path.describe(self.vocab_size, int(mask.shape[0] * mask.shape[1])), flush=True)

    def _fused_loss(self, student: LossFeatures, *, teacher, cached, target, mask, num_items_in_batch):
        """Runs inside the student's forward: both lm_heads (or the student's and the cached teacher signal), a
        chunk of completion rows at a time; a model on the exact path hands its own logits instead."""
        args = self.args
        s_head, t_head = student.head, None if teacher is None else teacher.head
        settings = dict(labels=target.clamp(min=0), student_lm_head_bias=_part(s_head, "bias"), beta=args.beta,
                        skew_alpha=args.skew_alpha, temperature=args.temperature,
                        num_items_in_batch=num_items_in_batch, chunk_size=args.loss_chunk_size,
                        vocab_size=self.vocab_size, student_logit_scale=_part(s_head, "logit_scale"),
                        student_softcap=_part(s_head, "softcap"),
                        kd_grad=args.alpha > 0, ce_grad=args.alpha < 1)  # a term weighted 0 is only logged
        with gathered(*_params(s_head), *_params(t_head)):
            if cached is not None:
                return sparse_distillation_loss(student.states, _part(s_head, "weight"), cached, mask,
                                                args.divergence, **settings)
            return chunked_distillation_loss(
                student.states, _part(s_head, "weight"), teacher.states, _part(t_head, "weight"), mask,
                args.divergence, teacher_lm_head_bias=_part(t_head, "bias"),
                teacher_logit_scale=_part(t_head, "logit_scale"), teacher_softcap=_part(t_head, "softcap"), **settings,
            )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs).detach()
            if prediction_loss_only:
                return loss, None, None
            model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
            logits = model(**model_inputs, use_cache=False).logits  # packed rows: no cache, or documents mix
        return loss, logits, inputs["labels"]

    # ---- Logging: `kd_loss` and `ce_loss` reduced exactly like the Trainer's `loss` ----

    def _record(self, kd: torch.Tensor, ce: torch.Tensor, batch_size: int) -> None:
        if self.model.training:
            self._distill_sums["kd_loss"] += kd.detach()
            self._distill_sums["ce_loss"] += ce.detach()
            return
        # Like `eval_loss`: one value per sample, duplicates of an uneven last batch dropped. `_metrics` is
        # SFTTrainer's (trl 1.16), averaged and cleared by its `log()`.
        for name, value in (("kd_loss", kd), ("ce_loss", ce)):
            values = self.accelerator.gather_for_metrics(value.detach().reshape(1).repeat(batch_size))
            self._metrics["eval"][name].extend(values.tolist())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:
            steps = max(self.state.global_step - self._distill_last_logged_step, 1)
            for name, total in self._distill_sums.items():
                total = torch.as_tensor(total, device=self.args.device, dtype=torch.float32)
                logs[name] = self.accelerator.gather(total.reshape(1)).mean().item() / steps
                self._distill_sums[name] = 0.0
            self._distill_last_logged_step = self.state.global_step
            if self.args.lmbda > 0 or self.args.seq_kd:
                stats = torch.tensor([float(v) for v in self._generation_stats.values()], device=self.args.device)
                micro_steps, on_policy, rows, tokens = self.accelerator.reduce(stats, reduction="sum").tolist()
                logs["on_policy_fraction"] = on_policy / max(micro_steps, 1)
                logs["generated_length"] = tokens / max(rows, 1)
                self._generation_stats = dict.fromkeys(self._generation_stats, 0)
        super().log(logs, start_time)


def _part(head, name: str):
    """A field of an `LMHead`, or None for a model on the exact path (no head: its states are logits)."""
    return None if head is None else getattr(head, name)


def _params(head) -> tuple:
    return () if head is None else head.params


def _student_tokenizer(model, dataset):
    """The student's tokenizer, loaded only when a conversational dataset needs its chat template early."""
    if dataset is None or isinstance(dataset, dict) or "messages" not in (dataset.column_names or []):
        return None
    from transformers import AutoTokenizer

    source = model if isinstance(model, str) else getattr(model.config, "_name_or_path", None)
    return AutoTokenizer.from_pretrained(source) if source else None


def _as_distillation_config(args) -> DistillationConfig:
    """A `DistillationConfig` with every value of a stock `TrainingArguments` (or `SFTConfig`), the distillation
    fields at their defaults: what makes the trainer a drop-in for `Trainer` and `SFTTrainer` scripts.

    A `Trainer` script tokenizes its own data and brings its own collator, so SFT's dataset preparation is skipped
    for plain `TrainingArguments` (as the stock `Trainer` would do)."""
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"args must be a DistillationConfig or TrainingArguments, got {type(args).__name__}.")
    values = args.to_dict()
    for key in values:
        if key.endswith("_token"):  # to_dict masks these (hub_token, and SFT's eos_token / pad_token)
            values[key] = getattr(args, key)
    if not isinstance(args, SFTConfig):
        values["dataset_kwargs"] = {"skip_prepare_dataset": True}
    return DistillationConfig(**values)


class _LogStepSync(TrainerCallback):
    """Starts the `kd_loss`/`ce_loss` step count where `train()` starts (after a resume, at the checkpoint)."""

    def __init__(self, trainer: DistillationTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._print_engine_configs()
        self.trainer._distill_last_logged_step = state.global_step
        self.trainer._distill_sums = {name: 0.0 for name in self.trainer._distill_sums}
