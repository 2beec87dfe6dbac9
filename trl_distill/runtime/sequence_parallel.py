"""Sequence parallelism (DeepSpeed Ulysses, through accelerate's ``ParallelismConfig(sp_backend="deepspeed")``):
the checks that refuse what cannot combine with it before anything loads.

With ``sequence_parallel_size=N`` each group of N ranks trains on one sequence at a time, each rank holding 1/N of
its positions; attention exchanges heads for positions (all-to-all) so it still sees the whole sequence. The
student's side is the stock one (accelerate registers the attention and shards the batches,
`UlyssesSPDataLoaderAdapter`); the teacher's attention goes through the same exchange on the same shard
(`model.sharded_attention`), and the loss runs on each rank's positions, normalised by the tokens of all of them.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from .. import compat

if TYPE_CHECKING:
    from ..run_plan import Parallelism

logger = logging.getLogger(__name__)

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
"""What Ulysses can wrap (`UlyssesSPAttentionHF.register_with_transformers`, deepspeed 0.19.8): not ``eager``."""


def sequence_parallel_size(args) -> int:
    """The run's sequence-parallel size: `parallelism_config` (Python or `accelerate launch
    --parallelism_config_sp_size`), else `sequence_parallel_size`."""
    config = getattr(args, "parallelism_config", None)
    if config is not None:
        return int(getattr(config, "sp_size", None) or 1)
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        return int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1") or 1)
    return int(getattr(args, "sequence_parallel_size", 1) or 1)


def attention_implementation(args) -> str:
    """The attention the models run under sequence parallelism."""
    handler = getattr(getattr(args, "parallelism_config", None), "sp_handler", None)
    chosen = getattr(handler, "sp_attn_implementation", None) or os.environ.get(
        "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION")
    return chosen or args.sequence_parallel_attn_implementation


def check_sequence_parallel_args(args) -> None:
    """In `run_plan.resolve`: refuse what cannot combine with sequence parallelism (one line naming the fix), then
    give the Trainer accelerate's `ParallelismConfig` and the student the attention it wraps (the teacher gets it
    from the plan, `Parallelism.attn_implementation`)."""
    size = sequence_parallel_size(args)
    if size < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {size}.")
    if size == 1:
        return
    given = getattr(args, "parallelism_config", None)
    if given is not None and args.sequence_parallel_size not in (1, size):
        raise ValueError(f"sequence_parallel_size={args.sequence_parallel_size} and parallelism_config.sp_size="
                         f"{size} disagree: give one of them.")
    if given is not None and getattr(given, "sp_backend", "deepspeed") != "deepspeed":
        raise ValueError("Sequence parallelism here is DeepSpeed's (Ulysses): set sp_backend='deepspeed'.")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % size:
        raise ValueError(f"sequence_parallel_size={size} must divide the number of processes ({world}): launch a "
                         f"multiple of {size} processes (torchrun --nproc_per_node / accelerate launch "
                         "--num_processes), or pick a size that divides it.")
    implementation = attention_implementation(args)
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"Sequence parallelism cannot wrap attn_implementation={implementation!r}: it needs one of "
                         f"{', '.join(SUPPORTED_ATTENTION)} (--sequence_parallel_attn_implementation).")
    for why, fix in _refusals(args, implementation):
        if why:
            raise ValueError(f"Sequence parallelism (sequence_parallel_size={size}) {fix}")
    # The only fields written here, as the libraries read them from the config itself (the plan has the size and
    # the attention, and the teacher loads with the plan's): the Trainer hands `parallelism_config` to accelerate,
    # whose Ulysses wrapper registers its handler's attention, and SFTTrainer loads a student path with
    # `model_init_kwargs`.
    if given is None:
        from accelerate import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                  sp_attn_implementation=implementation)
        args.parallelism_config = ParallelismConfig(sp_backend="deepspeed", sp_size=size, sp_handler=handler)
    elif getattr(given.sp_handler, "sp_attn_implementation", None) is None:
        given.sp_handler.sp_attn_implementation = implementation  # accelerate would register None
    kwargs = args.model_init_kwargs
    kwargs = dict(kwargs) if isinstance(kwargs, dict) else {} if kwargs is None else kwargs
    if isinstance(kwargs, dict):
        kwargs.setdefault("attn_implementation", implementation)
        args.model_init_kwargs = kwargs


def _refusals(args, implementation: str):
    """``(refused?, what to do)`` for each setting sequence parallelism does not combine with."""
    flash = implementation.startswith("flash_attention")
    return [
        (not args.deepspeed, "needs a DeepSpeed student (accelerate's Ulysses path is DeepSpeed's): pass --deepspeed "
         "with a ZeRO config, e.g. configs/deepspeed/zero2_student.json."),
        (args.lmbda > 0 or args.seq_kd, "does not sample completions: on-policy (lmbda > 0) and seq_kd generate "
         "whole sequences on one rank. Set lmbda=0 and seq_kd=False."),
        (args.teachers is not None, "takes one teacher: drop `teachers` or set sequence_parallel_size=1."),
        (bool(args.cross_tokenizer) or args.teacher_tokenizer_name_or_path is not None, "needs the teacher to "
         "share the student's tokenizer (its positions are split the same way): drop the cross-tokenizer settings."),
        ((args.packing or args.padding_free) and not flash, f"with {implementation} cannot keep packed documents "
         "apart (the split sequence loses its mask; only flash attention reads document boundaries from "
         "position_ids): set packing=False and padding_free=False, or use flash_attention_2."),
        (args.auto_find_batch_size, "needs a fixed batch size: set auto_find_batch_size=False."),
    ]


def check_sequence_parallel_models(size: int, named_configs: dict) -> None:
    """Before loading: each model (`named_configs`: name -> its config) has attention heads that `size` (the
    sequence-parallel size) divides and an attention transformers can swap (the attention interface). One line
    naming the fix."""
    if size == 1:
        return
    for name, config in named_configs.items():
        if config is None:
            continue
        text = config.get_text_config()
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        if heads is None or heads % size:
            raise ValueError(f"The {name}'s {heads} attention heads are not divisible by sequence_parallel_size="
                             f"{size}: Ulysses gives each rank 1/{size} of the heads. Pick a size that divides "
                             "them.")
        if kv_heads % size and size % kv_heads:
            raise ValueError(f"The {name}'s {kv_heads} key/value heads and sequence_parallel_size={size}: one must "
                             "divide the other (Ulysses splits or replicates them). Pick another size.")
        model_class = compat.causal_lm_class(config)
        if model_class is not None and not compat.uses_attention_interface(model_class):
            raise ValueError(f"The {name} ({model_class.__name__}) does not route its attention through "
                             "transformers' attention interface, so sequence parallelism cannot swap it: use a model "
                             "that does (Llama, Qwen2, Mistral, ...) or sequence_parallel_size=1.")


def check_models_before_loading(size: int, student, teacher) -> None:
    """`check_sequence_parallel_models` on the student and the teacher as given (a path's config is read, nothing is
    loaded), under sequence parallelism of `size` (the plan's)."""
    if size == 1:
        return
    from transformers import AutoConfig

    def config_of(model):
        if model is None:
            return None
        if hasattr(model, "config"):
            return model.config
        try:
            return AutoConfig.from_pretrained(model)
        except (OSError, ValueError):
            return None  # "self", or a model the loader names as missing or broken itself

    check_sequence_parallel_models(size, {"student": config_of(student), "teacher": config_of(teacher)})


def collator(base, parallelism: Parallelism):
    """`base` wrapped so that every batch carries position ids, padded to a multiple of the size (the outermost
    collator: a teacher signal of whole rows learns its labels, to be split per rank); `base` without sequence
    parallelism."""
    if parallelism.sequence_parallel_size == 1:
        return base
    from ..data.batch import PositionIdsCollator

    return PositionIdsCollator(base, parallelism.sequence_parallel_size)


class SequenceParallelScope:
    """What a sequence-parallel run changes in its process beyond its trainer, put back as its training ends (`end`):
    the attention function registered for its implementation (accelerate has DeepSpeed put its Ulysses wrapper there
    as the student is prepared, and `start` puts ours over it) and DeepSpeed's sequence-parallel groups. A later
    trainer in the same process (data-parallel, another size) starts from what this one found."""

    def __init__(self, parallelism: Parallelism):
        from ..compat import attention_override, deepspeed_sequence_groups

        self.size, self.implementation = parallelism.sequence_parallel_size, parallelism.attn_implementation
        self.found = attention_override(self.implementation), deepspeed_sequence_groups()
        self.attention = None  # the installed `ShardedAttention`, from the first step to the end of training

    def start(self, context, batch_samples: list[dict]) -> None:
        """As the run's first optimizer step starts (accelerate has built the groups by then): both models' attention
        exchanged across the group while the student trains (`model.sharded_attention`)."""
        if self.attention is not None:
            return
        from ..model.sharded_attention import install_sharded_attention

        self.attention = install_sharded_attention(self.implementation, lambda: context.training)
        if batch_samples and context.accelerator.is_main_process:
            size, width = self.size, batch_samples[0]["input_ids"].shape[1]
            logger.info(f"trl_distill: sequence parallelism {size} (DeepSpeed Ulysses, {self.implementation} "
                        f"attention): each rank holds {width} of every {width * size}-token row's positions, student "
                        "and teacher alike.")

    def end(self) -> None:
        """Training is over: transformers' attention registry and DeepSpeed's groups as this run found them."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from ..compat import attention_override, restore_deepspeed_sequence_groups

        if self.attention is not None:
            self.attention.uninstall()
            self.attention = None
        attention, groups = self.found
        if attention is not None:
            ALL_ATTENTION_FUNCTIONS[self.implementation] = attention
        elif attention_override(self.implementation) is not None:
            del ALL_ATTENTION_FUNCTIONS[self.implementation]
        restore_deepspeed_sequence_groups(groups)


def sharded_token_count(context, batch_samples: list[dict], device, counted):
    """The loss tokens of the step over every rank, for the loss's denominator. The Trainer counts them from
    `labels`, which the Ulysses loader replaces by each shard's `shift_labels` (transformers 5.24): counted here from
    those. `counted` as it is without sequence parallelism."""
    if counted is not None or not batch_samples:
        return counted
    import torch

    mine = sum(int((b["shift_labels"] != -100).sum()) for b in batch_samples if "shift_labels" in b)
    return context.accelerator.gather(torch.tensor(mine, device=device)).sum()


def gradient_scaled(loss, parallelism: Parallelism):
    """`loss` with its gradient divided by the sequence-parallel size, its value unchanged. Each rank's loss is its
    positions' share of the all-rank mean (times the process count, as without sequence parallelism), and DeepSpeed
    sums the gradients of a sequence group's ranks before averaging over the data-parallel ones
    (`DeepSpeedZeroOptimizer.average_tensor`: divides by ``world / sp``, deepspeed 0.19.8)."""
    size = parallelism.sequence_parallel_size
    if size == 1:
        return loss
    return loss / size + (loss - loss / size).detach()


def check_sharded_attention(model, parallelism: Parallelism, name: str) -> None:
    """Under sequence parallelism, `model` must run the attention that is exchanged across ranks; a model that runs
    another one (a teacher passed loaded, with eager attention) would attend over its shard alone: refused."""
    if parallelism.sequence_parallel_size == 1:
        return
    wanted, runs = parallelism.attn_implementation, getattr(model.config, "_attn_implementation", None)
    if runs != wanted:
        raise ValueError(f"Under sequence parallelism the {name} must run attn_implementation={wanted!r} (the one "
                         f"split across ranks), but it runs {runs!r}: load it with attn_implementation={wanted!r} "
                         "or pass its path and let the trainer load it.")
