"""`DistillationTrainer`: `trl.SFTTrainer` with a frozen teacher, which DeepSpeed can partition (ZeRO-3) beside
a student trained with any ZeRO stage (or without DeepSpeed)."""

from __future__ import annotations

import logging
import os
from functools import partial

import torch
from transformers import PreTrainedModel, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import SFTTrainer

from . import compat  # the private library APIs we use, each in one named function
from .cache.reader import ROW, TeacherCache, train_from_cache
from .checkpoints import mark_complete, resume_point, run_record
from .config import DistillationConfig, as_distillation_config
from .cross_tokenizer.training import COLUMNS as CROSS_COLUMNS
from .cross_tokenizer.training import (
    CrossRows,
    CrossTokenizer,
    load_teacher_tokenizer,
    pop_cross_batch,
    teacher_inputs,
    wants_cross_tokenizer,
)
from .data import (
    drop_unanswered_conversations,
    log_skipped_rows,
    resolve_assistant_only_loss,
    student_tokenizer,
    tokenizer_of,
)
from .deepspeed_config import print_engine_configs
from .logit_check import probe_inputs, settle_logit_paths
from .losses import DenseTeacherSignal, LossSettings, fused_loss, select_loss_rows
from .modeling import LossFeatures, add_fused_distillation_forward, gathered
from .on_policy import CompletionSampler, refuse_zero3_student_sampling
from .served_signal import ServedTeacherSignal, train_from_server
from .signal_batch import pop_signal
from .sparse_losses import SparseSignalChunks
from .teacher import SELF, STUDENT, TEACHER, SelfTeacher, Teacher, resolve_teacher
from .teacher_step import TeacherRows, TeacherStepPass, loss_tokens
from .validation import (
    check_dataset_not_empty,
    check_output_dir,
    check_teacher_finite,
    check_tokenizers_match,
    shared_vocab_size,
)

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
    this trainer distils on the dataset's completions and, with `lmbda` / `seq_kd`, on sampled ones.

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
        args = DistillationConfig(output_dir="distilled-model") if args is None else as_distillation_config(args)
        check_output_dir(args.output_dir)
        check_dataset_not_empty(train_dataset, "train", "given")
        self.teacher, source = resolve_teacher(teacher_model, args, eval_dataset, model, peft_config)
        self.teacher_cache = source if isinstance(source, TeacherCache) else None
        self.served_teacher = source if isinstance(source, ServedTeacherSignal) else None
        self.cross = None  # a teacher with another tokenizer (`cross_tokenizer.training`), decided before the data
        teacher_tokenizer = None
        if isinstance(self.teacher, Teacher):
            teacher_tokenizer = load_teacher_tokenizer(args, self.teacher)
            mine = processing_class or tokenizer_of(model) if teacher_tokenizer is not None else None
            if mine is not None and wants_cross_tokenizer(args, mine, teacher_tokenizer):
                processing_class = mine
                self.cross = CrossTokenizer(processing_class, teacher_tokenizer, args)
        if args.assistant_only_loss is None:
            processing_class = processing_class or student_tokenizer(model, train_dataset)
            args.assistant_only_loss = resolve_assistant_only_loss(None, train_dataset, processing_class)
        train_dataset = drop_unanswered_conversations(train_dataset, args.assistant_only_loss)
        output_dir_existed = os.path.exists(args.output_dir)
        super().__init__(  # SFTTrainer's own arguments, as given
            model, args=args, data_collator=data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics, peft_config=peft_config,
            formatting_func=formatting_func,
        )
        if self.accelerator.is_main_process:
            log_skipped_rows(train_dataset, self.train_dataset, args)
        if self.aux_loss_enabled:
            raise ValueError(
                "A Mixture-of-Experts student with a router load-balancing loss is not supported yet: the "
                "distillation loss would silently drop it. Set `router_aux_loss_coef=0.0` to train without it."
            )
        student = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_fused_distillation_forward(student)
        if self.teacher == SELF:
            if not hasattr(self.model, "disable_adapter"):
                raise ValueError("teacher 'self' needs a PEFT student; the student is not a PeftModel.")
            self.teacher = SelfTeacher(self.model)
        elif self.teacher is not None and not {"dtype", "torch_dtype"} & set(self.teacher.init_kwargs):
            self.teacher.init_kwargs["dtype"] = student.dtype
        teacher_config = student.config if self.teacher is None or self.cross else self.teacher.config
        try:
            self.vocab_size = shared_vocab_size(student.config, teacher_config, self.processing_class)
            if self.cross is not None:
                self.cross.build_loss(self.vocab_size, self.teacher.config.get_text_config().vocab_size,
                                      self.loss_settings, announce=self.accelerator.is_main_process)
                self.data_collator = self.cross.collator(self.data_collator)
            elif self.teacher_cache is not None:
                train_from_cache(self, self.teacher_cache)
            elif self.served_teacher is not None:
                train_from_server(self, self.served_teacher)
            elif isinstance(self.teacher, Teacher):
                check_tokenizers_match(self.processing_class, teacher_tokenizer)  # loaded once, above
            check_dataset_not_empty(self.train_dataset, "train", "prepared", args.max_length)
            evaluation = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
            for name, dataset in evaluation.items():
                check_dataset_not_empty(dataset, name, "prepared", args.max_length)
        except ValueError:
            if not output_dir_existed and os.path.isdir(args.output_dir) and not os.listdir(args.output_dir):
                os.rmdir(args.output_dir)  # the Trainer created it empty; leave nothing behind
            raise
        # Our loss sums over completion tokens and divides by their count over the accumulated, all-rank batch:
        # ask the Trainer for that count (`num_items_in_batch`), taken over the shifted labels.
        self.model_accepts_loss_kwargs = True
        compat.count_items_over_shifted_labels(self)
        self._distill_sums = {"kd_loss": 0.0, "ce_loss": 0.0}
        self.sampler = CompletionSampler(self)  # on-policy / sequence-level completions (lmbda, seq_kd)
        self.teacher_step = TeacherStepPass(self)  # the teacher once per optimizer step (`teacher_step_pass`)
        self._distill_last_logged_step = 0
        self._logit_paths = None  # settled on the first batch (`_settle_logit_paths`)
        self.add_callback(_LogStepSync(self))

    # ---- Setup: two DeepSpeed plugins, teacher prepared once after the Trainer's `free_memory()` ----

    def _build_accelerator_args(self, **kwargs):
        """Give the Accelerator two plugins, {"student": the Trainer's, "teacher": the teacher's own (ZeRO-3)}."""
        accelerator_args = super()._build_accelerator_args(**kwargs)
        student_plugin = accelerator_args.get("deepspeed_plugin")
        refuse_zero3_student_sampling(self.args, student_plugin)
        if not isinstance(self.teacher, Teacher):
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
        accelerator_args["deepspeed_plugin"] = {STUDENT: student_plugin, TEACHER: self.teacher.plugin(self.args,
                                                                                                    student_plugin)}
        return accelerator_args

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`, resuming only from complete checkpoints (see `trl_distill.checkpoints`)."""
        if self.is_deepspeed_enabled and self.model_wrapped is not self.model:
            # An engine from evaluate() or an earlier train(): the Trainer's free_memory() is about to destroy it,
            # and the stock Trainer would then skip preparing the student (no engine for `backward`).
            self.model_wrapped, self.deepspeed = self.model, None
        return super().train(self.resume_point(resume_from_checkpoint), *args, **kwargs)

    def resume_point(self, resume_from_checkpoint: str | bool | None) -> str | bool | None:
        """The checkpoint to resume (the newest complete one for True), refused when another distillation set-up
        or process count wrote it (`checkpoints.check_resume`)."""
        return resume_point(resume_from_checkpoint, self.args.output_dir, self._run_record(),
                            self.args.resume_allow_changes)

    def _run_record(self) -> dict:
        teacher = getattr(self.teacher or self.served_teacher, "name", None)
        return run_record(self.args, teacher, self.accelerator.num_processes, self.is_deepspeed_enabled)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()  # every rank's optimizer shard and RNG state is on disk
        if self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            mark_complete(os.path.join(self._get_output_dir(trial), name), self._run_record())

    @property
    def loss_settings(self) -> LossSettings:
        """The loss's settings, from the arguments as they are now (a callback may change them between steps)."""
        args = self.args
        return LossSettings(args.divergence, args.beta, args.skew_alpha, args.temperature, args.loss_chunk_size,
                            self.vocab_size, kd_grad=args.alpha > 0, ce_grad=args.alpha < 1)  # weight 0: logged only

    def prepare_teacher(self) -> None:
        """Load and prepare the teacher once (collective under DeepSpeed); the dataloader getters call it."""
        if self.teacher is not None:  # None: training from a teacher cache or a served teacher
            self.teacher.prepare(self.accelerator, self.args.device)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self.teacher_cache is not None:
            compat.keep_dataset_column(self, ROW)  # each row's index into the cache
        for column in CROSS_COLUMNS if self.cross is not None else ():
            compat.keep_dataset_column(self, column)  # the teacher's ids and the aligned groups

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        dataset = super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        if self.cross is not None:  # each row, rendered and tokenized the teacher's way too, and aligned
            dataset = self.cross.add_columns(dataset, dataset_name)
        return dataset

    def get_train_dataloader(self):
        return self._with_teacher(super().get_train_dataloader())  # after `train()`'s free_memory(), on every rank

    def get_eval_dataloader(self, eval_dataset=None):
        return self._with_teacher(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._with_teacher(super().get_test_dataloader(test_dataset))  # predict()

    def _with_teacher(self, dataloader):
        self.prepare_teacher()
        return dataloader

    def evaluation_loop(self, *args, **kwargs):
        student_plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        if student_plugin is None or self.deepspeed is not None or student_plugin.zero_stage == 3:
            return super().evaluation_loop(*args, **kwargs)
        # Before `train()` the stock loop would build a ZeRO-3 inference engine for the student, which refuses a
        # ZeRO-0/1/2 config. Such a student holds all its weights on every rank: evaluate the module as it is.
        with compat.deepspeed_hidden_from(self):
            return super().evaluation_loop(*args, **kwargs)

    # ---- The teacher once per optimizer step, over all its micro-batches (`trl_distill.teacher_step`) ----

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.teacher_step.applies(batch_samples):  # (the training loop is the only caller, in transformers 5.24)
            self.teacher_step.run(batch_samples)
        return batch_samples, num_items_in_batch

    # ---- On-policy / sequence-level KD: completions sampled by the student or the teacher ----

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs, sampled = self.sampler.maybe_resample(inputs)
        if sampled:  # generated lengths differ from the dataset's: a per-micro-batch token mean
            num_items_in_batch = None
        return super().training_step(model, inputs, num_items_in_batch)

    # ---- Loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``alpha * KD + (1 - alpha) * CE`` over completion tokens, normalised like the HF Trainer's loss."""
        args = self.args
        cached, cross = pop_signal(inputs), pop_cross_batch(inputs)
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        target, mask = loss_tokens(inputs)
        # Sequence positions with a loss token in some row: the only ones either model projects (position t
        # predicts target t); the selected rows keep the (row, position) order on every path.
        keep = mask.any(0).nonzero().squeeze(1)
        mask, target = mask[:, keep], target[:, keep]
        if self._logit_paths is None:
            self._settle_logit_paths(model, model_inputs, mask, None if cross is None else teacher_inputs(cross))
        teacher = self.teacher_step.take(inputs) if self.model.training else None  # computed ahead for the step
        if cross is not None:  # the teacher reads its own ids; its states at the aligned groups
            teacher = self.cross.teacher_rows(self.teacher, cross, mask, keep)
            check_teacher_finite(teacher.states, self.accelerator, self.state.global_step + 1)
        elif cached is None and teacher is None:  # (a cache or a server: the teacher's top-k comes with the batch)
            # Every rank runs every teacher forward, even with no loss token: ZeRO-3 gathers are collective.
            teacher = self.teacher.features(model_inputs, keep)
            check_teacher_finite(teacher.states, self.accelerator, self.state.global_step + 1)
        loss_fn = partial(self._fused_loss, teacher=teacher, cached=cached, target=target, mask=mask,
                          num_items_in_batch=num_items_in_batch)
        kd, ce = model(**model_inputs, fused_distillation=loss_fn, loss_positions=keep)
        self.teacher_step.after_loss()
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

    def _settle_logit_paths(self, model, model_inputs: dict, mask: torch.Tensor,
                            teacher_inputs: dict | None = None) -> None:
        """Once, on the first batch: check each model's fused logits against its own and pick its path (see
        `trl_distill.logit_check`); rank 0 says which path each model takes. A teacher with another tokenizer is
        checked on its own ids (`teacher_inputs`)."""
        student = self.accelerator.unwrap_model(model)
        student = student.get_base_model() if hasattr(student, "get_base_model") else student
        candidates = [("student", model, student, model_inputs)]
        if self.teacher is not None and not isinstance(self.teacher, SelfTeacher):  # self: the student's own base
            candidates.append(("teacher", self.teacher.engine, self.teacher.module, teacher_inputs or model_inputs))
        mixed = self.args.bf16 or self.args.fp16
        if teacher_inputs is None:
            self._logit_paths = settle_logit_paths([c[:3] for c in candidates], probe_inputs(model_inputs),
                                                   self.accelerator, mixed_precision=mixed)
        else:  # each model on its own tokens
            self._logit_paths = [path for *candidate, inputs in candidates for path in settle_logit_paths(
                [tuple(candidate)], probe_inputs(inputs), self.accelerator, mixed_precision=mixed)]
        if self.accelerator.is_main_process:
            for path in self._logit_paths:
                print(path.describe(self.vocab_size, int(mask.shape[0] * mask.shape[1])), flush=True)

    def _fused_loss(self, student: LossFeatures, *, teacher, cached, target, mask, num_items_in_batch):
        """Runs inside the student's forward: both lm_heads (or the student's and the cached teacher signal), a
        chunk of completion rows at a time; a model on the exact path hands its own logits instead."""
        s_flat, rows, labels = select_loss_rows(student.states, mask, target.clamp(min=0))
        heads = [h for h in (student.head, None if teacher is None else teacher.head) if h is not None]
        settings = self.loss_settings
        with gathered(*(p for head in heads for p in head.params)):
            if cached is not None:
                signal = SparseSignalChunks(cached, len(labels), settings.vocab_size)
            elif isinstance(teacher, CrossRows):  # another tokenizer: the per-group loss, 0 off the groups
                signal = self.cross.signal(teacher, settings)
            else:
                if isinstance(teacher, TeacherRows):  # computed ahead, at exactly these rows
                    t_rows = teacher.states
                else:
                    t_rows = teacher.states.reshape(-1, teacher.states.shape[-1]).index_select(0, rows)
                if t_rows.shape[0] != len(labels):
                    raise RuntimeError(f"The teacher has {t_rows.shape[0]} loss rows, the student {len(labels)}.")
                signal = DenseTeacherSignal(t_rows.detach(), teacher.head, settings.vocab_size, settings.temperature)
            return fused_loss(s_flat, student.head, signal, settings, rows, labels, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = compat.prepare_inputs(self, inputs)
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
        # Like `eval_loss`: one value per sample, duplicates of an uneven last batch dropped.
        for name, value in (("kd_loss", kd), ("ce_loss", ce)):
            values = self.accelerator.gather_for_metrics(value.detach().reshape(1).repeat(batch_size))
            compat.eval_metric_values(self, name).extend(values.tolist())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:
            steps = max(self.state.global_step - self._distill_last_logged_step, 1)
            for name, total in self._distill_sums.items():
                total = torch.as_tensor(total, device=self.args.device, dtype=torch.float32)
                logs[name] = self.accelerator.gather(total.reshape(1)).mean().item() / steps
                self._distill_sums[name] = 0.0
            self._distill_last_logged_step = self.state.global_step
            self.sampler.log_into(logs, self.accelerator, self.args.device)
        super().log(logs, start_time)


class _LogStepSync(TrainerCallback):
    """As `train()` starts: rank 0 prints both engines' DeepSpeed configs (once), and the `kd_loss`/`ce_loss` step
    count starts where training does (after a resume, at the checkpoint)."""

    def __init__(self, trainer: DistillationTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        if not getattr(trainer, "_engine_configs_printed", False) and trainer.accelerator.is_main_process:
            print_engine_configs(trainer.accelerator, getattr(trainer.teacher, "config_notes", []))
        trainer._engine_configs_printed = True
        trainer._distill_last_logged_step = state.global_step
        trainer._distill_sums = dict.fromkeys(trainer._distill_sums, 0.0)

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.teacher_step.release()  # nothing computed ahead outlives training (nor the held lm_head)
        if self.trainer.served_teacher is not None:
            self.trainer.served_teacher.close()  # requests for batches collated ahead and never trained on
