"""`DistillationTrainer`: `trl.SFTTrainer` with a frozen teacher, which DeepSpeed can partition (ZeRO-3) beside
a student trained with any ZeRO stage (or without DeepSpeed)."""

from __future__ import annotations

import contextlib
import logging
import os
from functools import partial

import torch
from transformers import PreTrainedModel
from trl import SFTTrainer

from . import compat  # the private library APIs we use, each in one named function
from .compat import TrainerInternals  # the Trainer's private members we use, each in one named method
from .config import DistillationConfig, as_distillation_config
from .data import prepare
from .data.batch import loss_tokens, pop_extra
from .data.loss_layout import LayoutMemo, LossTokensCollator, streamed
from .evaluation.checks import check_eval_splits
from .evaluation.generation import GenerationEvaluation, eval_settings
from .loss.fused import features_loss
from .loss.settings import LossSettings
from .model.fused_forward import add_fused_distillation_forward
from .model.logit_check import LogitPaths
from .rollout.learning_rate import warn_learning_rate
from .rollout.on_policy import CompletionSampler, check_sampling_prompts, refuse_zero3_student_sampling
from .rollout.sampling import DATASET, completion_source
from .rollout.sampling import STUDENT as STUDENT_SAMPLES
from .rollout.task_rewards import TaskColumnsCollator, check_task_rewards, reward_columns, row_columns
from .run_plan import resolve
from .runtime import fsdp2, sequence_parallel, validation
from .runtime.checkpoints import resume_point, run_record, save_complete_checkpoint, student_identity
from .runtime.context import RunContext
from .runtime.guards import Guards, StepFlags
from .runtime.log_setup import setup_logging
from .runtime.metrics import DistillMetrics, TrainingBounds
from .runtime.process_setup import prepare_process
from .runtime.run_lock import refuse_if_locked, take_run_lock
from .runtime.validation import check_dataset_not_empty, check_output_dir, run_inputs, shared_vocab_size
from .teacher import capabilities as can
from .teacher import resolve_teacher
from .teacher.live import STUDENT

logger = logging.getLogger(__name__)
prepare_process()  # before DeepSpeed is imported or builds an op (a stale build lock removed)


class DistillationTrainer(TrainerInternals, SFTTrainer):
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
        plan = self.run_plan = resolve(args)  # how the fields combine, checked once before anything loads
        setup_logging(args)  # rank 0 says what it does (log_level), the others stay quiet (log_level_replica)
        check_output_dir(args.output_dir, run_inputs(plan.teacher_settings.paths, model, teacher_model,
                                                     (train_dataset, eval_dataset), plan.teachers))
        refuse_if_locked(args)  # another live run holds output_dir: one line on every rank before anything loads
        check_dataset_not_empty(train_dataset, "train", "given")
        self.teacher = resolve_teacher(teacher_model, plan, student=model, processing_class=processing_class,
                                       eval_dataset=eval_dataset, peft_config=peft_config)  # the one teacher source
        train_dataset = can.routed_rows(self.teacher, train_dataset, eval_dataset)  # several teachers: each row's
        processing_class = processing_class or can.student_tokenizer_of(self.teacher)
        if args.assistant_only_loss is None:
            processing_class = processing_class or prepare.student_tokenizer(model, train_dataset)
            args.assistant_only_loss = prepare.resolve_assistant_only_loss(None, train_dataset, processing_class)
        train_dataset = prepare.drop_unanswered_conversations(train_dataset, args.assistant_only_loss)
        output_dir_existed = os.path.exists(args.output_dir)
        super().__init__(  # SFTTrainer's own arguments, as given
            model, args=args, data_collator=data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics, peft_config=peft_config,
            formatting_func=formatting_func,
        )
        if self.accelerator.is_main_process:
            prepare.log_skipped_rows(train_dataset, self.train_dataset, args.packing, args.max_length)
        self.run_lock = take_run_lock(args)  # one run per output_dir (released at train end or exit)
        self.student_identity = student_identity(self.model)  # what a checkpoint records of the student
        add_fused_distillation_forward(self.student)
        try:
            split_over = plan.parallelism.sequence_parallel_size  # an MoE student's router loss cannot be split
            validation.check_router_aux_loss(self.student, self.aux_loss_enabled, split_over)
            teacher_vocab = can.vocab_config_of(self.teacher, self.student.config)  # its own, else the student's
            self.vocab_size = shared_vocab_size(self.student.config, teacher_vocab, self.processing_class)
            self.logit_paths = LogitPaths(self.accelerator, can.logit_candidates_of(self.teacher),
                                          args.bf16 or args.fp16, self.vocab_size)  # each model's, on the first batch
            # what collaborators receive instead of the trainer (calls go down: none calls back, none changes it)
            self.layouts = LayoutMemo()  # where each micro-batch's loss tokens are: one host read per step
            self.context = RunContext(
                args, self.accelerator, lambda: self.state, lambda: self.model, lambda: self.model_wrapped,
                lambda examples: self.data_collator(examples), self.prepared_inputs, lambda: self.processing_class,
                self.vocab_size, self.logit_paths, layouts=self.layouts, deferred=StepFlags(), plan=plan)
            self.teacher.attach(self.context)  # its fit checks
            self.teacher_asks = can.StepCapabilities.of(self.teacher)  # what each step asks of it, asked once
            self.train_dataset = can.train_rows_of(self.teacher, self.train_dataset)  # e.g. a cache's row numbers
            sequence_parallel.check_sharded_attention(self.student, plan.parallelism, "student")  # rows split on ranks
            # the collators, composed once: SFT's (or the caller's) innermost, then the teacher kind's, then
            # sequence parallelism's position ids outermost
            self.data_collator = sequence_parallel.collator(can.collator_of(self.teacher, self.data_collator),
                                                            plan.parallelism)
            task_columns = reward_columns(plan.on_policy.task_rewards, self.train_dataset, can.columns_of(self.teacher),
                                          warn=args.process_index == 0)  # None: no task reward
            if task_columns is not None:  # the rows' own columns travel with the batch, for the reward functions
                self.data_collator = TaskColumnsCollator(self.data_collator, task_columns)
            if not streamed(self.train_dataset, self.eval_dataset):  # (accelerate dispatches a stream's batches
                # from rank 0 and can only concatenate tensors)
                self.data_collator = LossTokensCollator(self.data_collator)  # where the loss tokens are, on the host
            check_dataset_not_empty(self.train_dataset, "train", "prepared", args.max_length)
            check_sampling_prompts(self.train_dataset, plan.on_policy)  # lmbda / seq_kd: every row needs a prompt
            if task_columns is not None:  # each task reward tried on the first rows' reference completions
                check_task_rewards(plan.on_policy.task_rewards, self.train_dataset, task_columns,
                                   self.processing_class, self.state)
            evaluation = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
            for name, dataset in evaluation.items():
                check_dataset_not_empty(dataset, name, "prepared", args.max_length)
            if plan.evaluation.reward_funcs:
                check_eval_splits(evaluation, self.generation_evaluation, self.state)
        except ValueError:
            self.run_lock.release()
            if not output_dir_existed and os.path.isdir(args.output_dir) and not os.listdir(args.output_dir):
                os.rmdir(args.output_dir)  # the Trainer created it empty; leave nothing behind
            raise
        # Our loss sums over completion tokens and divides by their count over the accumulated, all-rank batch:
        # ask the Trainer for that count (`num_items_in_batch`), taken over the shifted labels.
        self.model_accepts_loss_kwargs = True
        self.count_items_over_shifted_labels()
        self.guards = Guards(self.context)  # a non-finite loss, on-policy collapse, a teacher worse than the student
        self.metrics = DistillMetrics(self.context, self.guards, self.eval_metric_values)
        # on-policy / sequence-level (lmbda, seq_kd), and the task reward of the student's samples
        self.sampler = CompletionSampler(self.context, self.teacher, plan.on_policy, task_columns)
        # sequence parallelism: what it changes in this process (both models' attention), undone as training ends
        self.sequence_parallel_scope = (sequence_parallel.SequenceParallelScope(plan.parallelism)
                                        if plan.parallelism.sequence_parallel_size > 1 else None)
        self.generated: dict[str, float] | None = None  # the generation eval's metrics, for the loop's output
        self.add_callback(TrainingBounds(self.context, self.teacher, self.metrics))
        if self.accelerator.is_main_process:  # on-policy above the learning rate docs/on_policy.md recommends
            warn_learning_rate(plan.on_policy, args.learning_rate, lora=hasattr(self.model, "peft_config"))

    @property
    def student(self) -> PreTrainedModel:
        """The student model itself (the base model of a PEFT student)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    # ---- Setup: two DeepSpeed plugins, teacher prepared once after the Trainer's `free_memory()` ----

    def _build_accelerator_args(self, **kwargs):
        """Give the Accelerator the student's plugin (the Trainer's) and each teacher's own (ZeRO-3), by name:
        {"student": ..., "teacher": ...}, or one "teacher:NAME" per live teacher when several teach."""
        accelerator_args = super()._build_accelerator_args(**kwargs)
        student_plugin = accelerator_args.get("deepspeed_plugin")
        refuse_zero3_student_sampling(self.run_plan.on_policy, student_plugin)
        teacher_plugins = can.plugins_of(self.teacher, self.run_plan.teacher_engine, student_plugin)
        if teacher_plugins:
            accelerator_args["deepspeed_plugin"] = {STUDENT: student_plugin, **teacher_plugins}
        if accelerator_args.get("deepspeed_plugin") is not None and compat.earlier_deepspeed_plugins() is not None:
            # A DeepSpeed trainer built earlier in this process holds accelerate's state, and accelerate refuses new
            # plugins beside its: this run's plugins take over (the earlier trainer is done with)
            logger.info("trl_distill: a DeepSpeed trainer was built earlier in this process; this one's DeepSpeed "
                        "plugins replace its accelerate state (train that one no further).")
            compat.forget_accelerator_state()
        return accelerator_args

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        plugin_args = self.args.fsdp_plugin_args  # (the Trainer's, from `fsdp` / `fsdp_config`)
        self.is_fsdp_enabled = self.is_fsdp_enabled or fsdp2.turn_on_for_cpu(self.accelerator, plugin_args)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`, resuming only from complete checkpoints (see `trl_distill.runtime.checkpoints`)."""
        if self.is_deepspeed_enabled and self.model_wrapped is not self.model:
            # An engine from evaluate() or an earlier train(): the Trainer's free_memory() is about to destroy it,
            # and the stock Trainer would then skip preparing the student (no engine for `backward`).
            self.model_wrapped, self.deepspeed = self.model, None
        try:
            return super().train(self.resume_point(resume_from_checkpoint), *args, **kwargs)
        finally:
            self.sampler.close()  # the rollout server's connections
            if self.sequence_parallel_scope is not None:  # what it changed in this process, as the run found it
                self.sequence_parallel_scope.end()
            self.run_lock.release()  # the run is over (at exit otherwise)

    def resume_point(self, resume_from_checkpoint: str | bool | None) -> str | bool | None:
        """The checkpoint to resume (the newest complete one for True), refused when another distillation set-up
        or process count wrote it (`checkpoints.check_resume`)."""
        return resume_point(resume_from_checkpoint, self.args.output_dir, self.run_record(),
                            self.args.resume_allow_changes)

    def run_record(self) -> dict:
        """What this run records of itself in checkpoints and reports: teacher, settings, processes, student."""
        return run_record(self.run_plan.recorded, self.teacher.name, self.accelerator.num_processes,
                          self.is_deepspeed_enabled, self.student_identity)

    def _save_checkpoint(self, model, trial):
        save_complete_checkpoint(self.context, super()._save_checkpoint, model, trial, self.output_dir_for(trial),
                                 self.run_record())

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        with fsdp2.whole_state_dict_for_save_model(self.accelerator, _internal_call):  # (FSDP2, sharded checkpoints)
            super().save_model(output_dir, _internal_call)

    @property
    def loss_settings(self) -> LossSettings:
        """The loss's settings, from the arguments as they are now (a callback may change them between steps)."""
        return LossSettings.of(self.args, self.vocab_size)

    def prepare_teacher(self) -> None:
        """Load and prepare the teacher once (collective under DeepSpeed); the dataloader getters call it."""
        self.teacher.prepare(self.accelerator, self.args.device)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        for column in can.columns_of(self.teacher):  # what the teacher's collator reads (a cache row, its own ids)
            self.keep_dataset_column(column)
        if self.run_plan.on_policy.task_rewards.funcs:  # the reward functions read the rows' own columns
            for column in row_columns(self.train_dataset, can.columns_of(self.teacher)):
                self.keep_dataset_column(column)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        dataset = super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        return can.prepared_for(self.teacher, dataset, dataset_name)  # e.g. the teacher's own ids, aligned

    def get_train_dataloader(self):
        self.prepare_teacher()  # after `train()`'s free_memory(), on every rank
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        self.prepare_teacher()
        return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):  # predict()
        return self.prepare_teacher() or super().get_test_dataloader(test_dataset)

    def evaluation_loop(self, *args, **kwargs):
        student_plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        # Before `train()` the stock loop would build a ZeRO-3 inference engine for the student, which refuses a
        # ZeRO-0/1/2 config. Such a student holds all its weights on every rank: evaluate the module as it is.
        hide = student_plugin is not None and self.deepspeed is None and student_plugin.zero_stage != 3
        fsdp2.refuse_evaluation_before_training(self.accelerator)
        self.metrics.start_evaluation()
        with self.deepspeed_hidden() if hide else contextlib.nullcontext():
            output = self.metrics.finish_evaluation(super().evaluation_loop(*args, **kwargs))
        if self.generated is not None:  # beside eval_loss: logged, returned, and there for metric_for_best_model
            prefix = kwargs.get("metric_key_prefix", "eval")
            output.metrics.update({f"{prefix}_{name}": value for name, value in self.generated.items()})
            self.generated = None
        return output

    # ---- Generation-based evaluation: what the student generates for the eval prompts, judged ----

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`Trainer.evaluate`; with `eval_reward_funcs`, also the student's completions of the eval prompts, scored by
        the verifiers and by the teacher (`trl_distill.evaluation`)."""
        fsdp2.refuse_evaluation_before_training(self.accelerator)  # before the student generates, unsharded
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        dataset = self.eval_dataset[dataset] if isinstance(dataset, str) else dataset
        if self.run_plan.evaluation.reward_funcs and dataset is not None and not isinstance(dataset, dict):
            self.prepare_teacher()
            training = self.model.training
            self.model.eval()
            try:
                self.generated = self.generation_evaluation(dataset).run(dataset, self.state, self.is_in_train)
            finally:
                self.model.train(training)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def generation_evaluation(self, dataset) -> GenerationEvaluation:
        """The generation eval of a prepared eval split, handed the calls it makes (collate, sample, score, reduce)."""
        from trl.data_utils import is_conversational

        args, accelerator = self.args, self.accelerator
        view = self.model_columns(dataset)  # what the collator gets, as from the eval DataLoader
        scores = self.teacher.capability(can.ScoresSamples)  # (a cache cannot score the student's samples)

        def collate(indices):
            return self.prepared_inputs(self.data_collator([view[i] for i in indices]))

        def sample(batch, settings):
            return self.sampler.sample(STUDENT_SAMPLES, batch, settings, score=scores is not None)

        def reduce(totals):
            if accelerator.num_processes == 1:
                return totals
            return accelerator.reduce(totals.to(args.device), reduction="sum").cpu()

        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        settings = eval_settings(self.run_plan.evaluation, dataset, args.per_device_eval_batch_size, args.seed)
        return GenerationEvaluation(settings, tokenizer,
                                    accelerator.process_index, accelerator.num_processes, collate, sample,
                                    self.score_samples if scores is not None else None, reduce,
                                    len(dataset) > 0 and is_conversational(dataset[0]))

    def score_samples(self, batch: dict):
        """The teacher's diagnostics of rows the student sampled (its CE of them is its NLL): the loss taken on them,
        logged nowhere."""
        self.sampler.pop_correction(batch)  # the engine's log-probs: the training logs' measure only
        with torch.no_grad(), self.metrics.scoring_samples() as window, self.compute_loss_context_manager():
            self.compute_loss(self.model, batch)
        return window

    # ---- The teacher once per optimizer step, over all its micro-batches (`teacher.step_pass`) ----

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.run_plan.parallelism.sequence_parallel_size > 1:
            self.model.train()  # the teacher pass runs before `training_step` sets it (the exchange is on in training)
            self.sequence_parallel_scope.start(self.context, batch_samples)  # both models' attention exchanged
            num_items_in_batch = sequence_parallel.sharded_token_count(self.context, batch_samples, device,
                                                                       num_items_in_batch)
        self.measure_loss_tokens(batch_samples)
        if self.teacher_asks.hooks is not None:  # (the training loop is the only caller)
            self.teacher_asks.hooks.before_step(batch_samples)
        return batch_samples, num_items_in_batch

    def measure_loss_tokens(self, batch_samples: list[dict]) -> None:
        """Where every micro-batch's loss tokens are (`LayoutMemo.measure_step`): not for a sampled step."""
        on_policy = self.run_plan.on_policy
        sampled = on_policy.samples and completion_source(on_policy.lmbda, on_policy.seq_kd, on_policy.seed,
                                                          self.state.global_step) != DATASET
        self.layouts.measure_step(batch_samples, self.prepared_inputs, sampled, self.context.deferred)

    # ---- On-policy / sequence-level KD: completions sampled by the student or the teacher ----

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs, sampled = self.sampler.maybe_resample(inputs) if self.sampler.active else (inputs, False)
        if sampled:  # generated lengths differ from the dataset's: a per-micro-batch token mean
            num_items_in_batch = None
        return super().training_step(model, inputs, num_items_in_batch)

    # ---- Loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``alpha * KD + (1 - alpha) * CE`` over completion tokens, normalised like the HF Trainer's loss; a
        Mixture-of-Experts student's router load-balancing loss added as SFTTrainer adds it
        (``router_aux_loss_coef``)."""
        args = self.args
        pop_extra(inputs, "loss_layout")  # (evaluation: where the loss tokens are is found below)
        own = self.teacher_asks.batch  # what the teacher's collator added; the student must not see it
        extras = None if own is None else own.pop_batch(inputs)
        correction, sampled = (self.sampler.loss_job(inputs, self.model.training) if self.sampler.in_loss
                               else (None, None))  # the rollout engine's log-probs; the sampled-token objective
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        target, mask = loss_tokens(inputs)
        # Sequence positions with a loss token in some row: the only ones either model projects (position t
        # predicts target t); the selected rows keep the (row, position) order on every path.
        layout = self.layouts.layout(inputs, mask)  # measured with the step's batches, or now
        keep = layout.keep
        mask, target = mask[:, keep], target[:, keep]
        if not self.logit_paths.settled:
            self.logit_paths.settle(model, model_inputs, mask, extras)
        teacher = self.teacher.for_batch(model_inputs, extras, mask, keep)  # every rank: gathers are collective
        loss_fn = partial(features_loss, teacher=teacher, target=target, mask=mask, settings=self.loss_settings,
                          num_items_in_batch=num_items_in_batch, correction=correction,
                          diagnostics=self.metrics.diagnostics(), sampled=sampled,
                          rows=layout.rows)  # inside the student's forward
        routed = {"output_router_logits": True} if self.aux_loss_enabled else {}  # the aux loss, same forward
        kd, ce, aux = model(**model_inputs, **routed, fused_distillation=loss_fn, loss_positions=keep)
        if self.teacher_asks.hooks is not None:
            self.teacher_asks.hooks.after_loss()
        if correction is not None or sampled is not None:
            self.sampler.observe(correction, sampled)
        if args.kd_temperature_scaling:
            kd = kd * args.temperature**2
        loss = args.alpha * kd + (1.0 - args.alpha) * ce
        if args.average_tokens_across_devices and num_items_in_batch is not None:
            # `num_items_in_batch` counts every rank's tokens and DeepSpeed/DDP average gradients across ranks
            scale = self.accelerator.num_processes // self.get_tp_size()
            loss, kd, ce = loss * scale, kd * scale, ce * scale
            if self.run_plan.parallelism.sequence_parallel_size > 1:  # DeepSpeed sums a sequence group's gradients
                loss = sequence_parallel.gradient_scaled(loss, self.run_plan.parallelism)
        if aux is not None:  # a per-micro-batch mean, weighted as SFTTrainer weights it (the Trainer averages
            # the micro-batches' loss over accumulation when it does not count the tokens itself)
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device) / steps
        if self.model.training:  # logged as one value per optimizer step: the mean of its micro-batches'
            aux = aux / self.current_gradient_accumulation_steps if aux is not None else None
        if num_items_in_batch is None and self.model.training:
            # a per-micro-batch mean: the Trainer divides the loss by the accumulation steps; log alike
            kd, ce = kd / self.current_gradient_accumulation_steps, ce / self.current_gradient_accumulation_steps
        self.metrics.record(kd, ce, target.shape[0], loss, on_policy=self.model.training and self.sampler.on_policy,
                            aux=aux, teachers=self.teacher_asks.metrics)  # (the guards read the step's checks)
        if return_outputs:
            return loss, {"kd_loss" if sampled is None else "policy_loss": kd.detach(), "ce_loss": ce.detach(),
                          **({} if aux is None else {"aux_loss": aux.detach()})}
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self.prepared_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs).detach()
            if prediction_loss_only:
                return loss, None, None
            model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
            logits = model(**model_inputs, use_cache=False).logits  # packed rows: no cache, or documents mix
        return loss, logits, inputs["labels"]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:  # `kd_loss`, `ce_loss`, the diagnostics, reduced like `loss`
            self.metrics.log_into(logs)
            if self.sampler.active:  # the sampled completions' statistics
                self.sampler.log_into(logs, self.accelerator, self.args.device)
            self.guards.check_collapse(logs)  # on the same numbers on every rank
        super().log(logs, start_time)
