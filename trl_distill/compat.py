"""Every private API of torch, transformers, TRL, accelerate and DeepSpeed that trl_distill relies on, in one place.

Each is checked against the versions of `CHECKED_AGAINST` (what the suite runs on: tested-versions.txt); another
version in pyproject.toml's ranges is said at import, in one line; `tests/test_compat.py` runs
each function and checks each hook we override still exists, so an upgrade that moves one fails there, not as a
silently wrong run. Modules call these functions instead of reaching into the libraries themselves.
"""

from __future__ import annotations

import contextlib

import torch

CHECKED_AGAINST = {"torch": "2.13", "transformers": "5.24", "trl": "1.16", "accelerate": "1.15", "deepspeed": "0.19.8"}


def other_versions() -> dict[str, str]:
    """The libraries of `CHECKED_AGAINST` installed at another version than the one checked: ``{name: found}``."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name, checked in CHECKED_AGAINST.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        if installed.split("+")[0] != checked and not installed.startswith(checked + "."):
            found[name] = installed
    return found


def note_other_versions() -> str | None:
    """At import, one warning line when a library is installed at another version than the one its private APIs
    were checked against (pyproject.toml allows it: the run may work; this says where to look if it does not)."""
    found = other_versions()
    if not found:
        return None
    line = ("trl_distill.compat was checked against " + ", ".join(f"{n} {CHECKED_AGAINST[n]}" for n in found)
            + "; found " + ", ".join(f"{n} {v}" for n, v in found.items()) + ". The private APIs it wraps may "
            "have moved: tests/test_compat.py checks each one.")
    import logging

    logging.getLogger("trl_distill").warning(line)
    return line


note_other_versions()

# Private methods we override (a rename upstream would leave our override unused, silently)
OVERRIDDEN_HOOKS = {
    "transformers.Trainer": ("_build_accelerator_args", "_save_checkpoint", "_set_signature_columns_if_needed"),
    "transformers.TrainingArguments": ("_setup_devices",),
    "trl.SFTTrainer": ("_prepare_dataset",),
    "deepspeed.runtime.zero.partition_parameters.Init": ("_zero_init_param", "_convert_to_deepspeed_param"),
}
# Public methods whose behaviour we rely on beyond their signature: `get_batch_samples` returns all micro-batches of
# an optimizer step before the first is trained on (`teacher_step`; transformers 5.24)
RELIED_ON = {"transformers.Trainer": ("get_batch_samples",)}


# ---- accelerate 1.15 ----

def prepared_models(accelerator) -> list:
    """The models `accelerator.prepare` registered (what `save_state` saves): `Accelerator._models`."""
    return accelerator._models


@contextlib.contextmanager
def accelerator_state_kept(accelerator):
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


@contextlib.contextmanager
def sequence_parallelism_hidden(accelerator):
    """Prepare a model other than the student (the teacher's own ZeRO-3 engine) without accelerate's Ulysses set-up,
    which builds the sequence-parallel groups once and registers the student's attention:
    `Accelerator._prepare_deepspeed` reads `AcceleratorState.parallelism_config` (accelerate 1.15)."""
    state = accelerator.state
    config = state.parallelism_config
    state.parallelism_config = None
    try:
        yield
    finally:
        state.parallelism_config = config


def partial_state_fields() -> dict:
    """accelerate's shared process state (empty before any `PartialState`): `PartialState._shared_state`."""
    from accelerate import PartialState

    return PartialState._shared_state


def reset_accelerate_state() -> None:
    """Forget accelerate's process and accelerator state: `AcceleratorState._reset_state(reset_partial_state=True)`."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def earlier_deepspeed_plugins() -> dict | None:
    """The DeepSpeed plugins an earlier `Accelerator` of this process registered (accelerate refuses a new
    Accelerator's own while they are held), None if none: `AcceleratorState._shared_state["deepspeed_plugins"]`."""
    from accelerate.state import AcceleratorState

    return AcceleratorState._shared_state.get("deepspeed_plugins")


def forget_accelerator_state() -> None:
    """Forget the accelerator state (its plugins, its distributed type), keeping the process state:
    `AcceleratorState._reset_state(reset_partial_state=False)`."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)


def fsdp_on_cpu_processes(accelerator, plugin) -> bool:
    """Turn FSDP on for CPU processes as accelerate turns it on for GPU ones; True when it did.

    accelerate 1.15's `AcceleratorState` takes the FSDP plugin only on accelerator devices: on CPU processes it leaves
    the distributed type `MULTI_CPU` and drops the plugin (silently), though torch's FSDP2 runs there over gloo. Here
    the state gets what it would have had: `distributed_type = FSDP`, the plugin, and its mixed precision; and, as
    accelerate's own init ends, `PartialState._shared_state["distributed_type"]` (which every later
    `AcceleratorState()` copies back)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    if plugin is None or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True

# ---- transformers 5.24 / TRL 1.16 ----

def core_attention(implementation: str):
    """transformers' own attention function for `implementation`, not what was registered over it since (accelerate's
    Ulysses wrapper): the registry's class-level `AttentionInterface._global_mapping` (transformers 5.24)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return type(ALL_ATTENTION_FUNCTIONS)._global_mapping[implementation]


def attention_override(implementation: str):
    """What was registered over `implementation` in transformers' attention registry (accelerate's Ulysses wrapper,
    ours), None when it runs transformers' own: the instance's `AttentionInterface._local_mapping` (transformers
    5.24)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS._local_mapping.get(implementation)


def causal_lm_class(config):
    """The `AutoModelForCausalLM` class of `config`, None when unknown: `_BaseAutoModelClass._model_mapping`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping.get(type(config), None)


def uses_attention_interface(model_class) -> bool:
    """Whether the model class calls its attention through transformers' attention registry (which sequence
    parallelism swaps): `PreTrainedModel._supports_attention_backend` (transformers 5.24)."""
    return bool(getattr(model_class, "_supports_attention_backend", False))


def valid_dict_fields(config_class) -> list[str]:
    """The `TrainingArguments` fields a JSON string may fill on the CLI: the class attribute `_VALID_DICT_FIELDS`."""
    return list(config_class._VALID_DICT_FIELDS)


class TrainerInternals:
    """The HF Trainer's and SFTTrainer's private members that `DistillationTrainer` uses, each behind one named method
    (transformers 5.24 / TRL 1.16). A base class of the trainer itself: ``self`` is the trainer."""

    def output_dir_for(self, trial) -> str:
        """The directory the Trainer saves this run's checkpoints in (a trial's own): `Trainer._get_output_dir`."""
        return self._get_output_dir(trial)

    def prepared_inputs(self, batch: dict) -> dict:
        """A collated batch moved to the trainer's device as its training step would: `Trainer._prepare_inputs`."""
        return self._prepare_inputs(batch)

    def count_items_over_shifted_labels(self) -> None:
        """Make the Trainer's `num_items_in_batch` count the shifted labels' loss tokens:
        `Trainer._loss_shifts_labels`."""
        self._loss_shifts_labels = True

    def keep_dataset_column(self, column: str) -> None:
        """Keep `column` when the Trainer drops the columns the model's forward does not take
        (`Trainer._signature_columns`; call after `_set_signature_columns_if_needed`)."""
        if column not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, column]

    def model_columns(self, dataset):
        """`dataset` with only the columns the Trainer's DataLoader keeps for the collator (the model's signature
        columns and those `keep_dataset_column` kept): `Trainer._remove_unused_columns`."""
        return self._remove_unused_columns(dataset)

    def eval_metric_values(self, name: str) -> list:
        """SFTTrainer's per-sample eval metric list, averaged and cleared by its `log()`: `SFTTrainer._metrics`."""
        return self._metrics["eval"][name]

    @contextlib.contextmanager
    def deepspeed_hidden(self):
        """Let the Trainer's evaluation loop treat a DeepSpeed student as a plain module (it reads
        `Trainer.is_deepspeed_enabled` only to decide whether to build a ZeRO-3 inference engine)."""
        self.is_deepspeed_enabled = False
        try:
            yield
        finally:
            self.is_deepspeed_enabled = True


def partitioned_construction():
    """What transformers' ZeRO-3 `from_config` enters, without the random initialisation it runs afterwards
    (`initialize_weights_zero3` gathers every module whole to initialise it; the checkpoint overwrites it anyway):
    `no_init_weights`, `prevent_arange_dtype_change`, `zero.Init` with the selected plugin's config (less its
    broadcast, see `_unbroadcast_init`), and `set_zero3_state` (inside which `from_config` enters no `zero.Init` of
    its own and initialises nothing). Only for weights that are all overwritten afterwards, on every rank."""
    from transformers.initialization import no_init_weights
    from transformers.integrations.deepspeed import deepspeed_config, prevent_arange_dtype_change
    from transformers.modeling_utils import set_zero3_state

    stack = contextlib.ExitStack()
    for context in (no_init_weights(), prevent_arange_dtype_change(),
                    _unbroadcast_init()(config_dict_or_path=deepspeed_config()), set_zero3_state()):
        stack.enter_context(context)
    return stack


def _unbroadcast_init():
    """`deepspeed.zero.Init` whose `_zero_init_param` (DeepSpeed 0.19.8: make the parameter a ZeRO one, broadcast it
    whole from rank 0, keep this rank's partition) skips the broadcast. The broadcast writes every module's whole
    tensor on every other rank; without it the whole tensor is allocated but never written (its pages are never
    touched), and a rank's memory grows by its partitions only. The partitions hold garbage until
    `zero3_loading.load_partitioned` fills each from the checkpoint."""
    import deepspeed

    class UnbroadcastInit(deepspeed.zero.Init):
        def _zero_init_param(self, param):
            self._convert_to_deepspeed_param(param)
            param.partition()

    return UnbroadcastInit


# ---- DeepSpeed 0.19.8: the ZeRO-3 attributes of a parameter ----

def deepspeed_sequence_groups() -> tuple:
    """DeepSpeed's sequence-parallel state that outlives a run in its process: the groups object its engine registers
    (`deepspeed.utils.groups.mpu`, read by ZeRO's gradient averaging) and `parallel_state_sp`'s two process groups
    (`_SEQUENCE_PARALLEL_GROUP`, `_SEQUENCE_DATA_PARALLEL_GROUP`; initialising them again asserts they are None)."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp
    from deepspeed.utils import groups

    return groups.mpu, sp._SEQUENCE_PARALLEL_GROUP, sp._SEQUENCE_DATA_PARALLEL_GROUP


def restore_deepspeed_sequence_groups(found: tuple) -> None:
    """Put back what `deepspeed_sequence_groups` returned."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp
    from deepspeed.utils import groups

    groups.mpu, sp._SEQUENCE_PARALLEL_GROUP, sp._SEQUENCE_DATA_PARALLEL_GROUP = found


def is_zero3_partitioned(param: torch.Tensor | None) -> bool:
    """A ZeRO-3 parameter not gathered right now (`ds_id`, `ds_status`)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param is not None and hasattr(param, "ds_id") and param.ds_status != ZeroParamStatus.AVAILABLE


def zero3_partition(param) -> tuple[torch.Tensor, int, int] | None:
    """``(flat partition tensor, first element it holds, element count)`` of this rank's share of a ZeRO-3
    parameter (`ds_tensor`, `ds_numel`, `ds_process_group`: rank r holds flat elements ``[r·p, (r+1)·p)``,
    zero-padded past the end); None when it is not partitioned here."""
    from deepspeed import comm as dist

    part = getattr(param, "ds_tensor", None)
    if part is None or part.numel() == 0:
        return None
    size = part.numel()
    first = dist.get_rank(group=param.ds_process_group) * size
    return part, first, max(0, min(size, param.ds_numel - first))


# ---- torch 2.13 ----

def cpu_has_bf16_units() -> bool:
    """An x86 CPU with AVX512-BF16 or AMX tiles (`torch.cpu._is_avx512_bf16_supported`, `_is_amx_tile_supported`);
    False when this torch lacks the probes."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if callable(probe))


def gloo_group(store, rank: int, world_size: int, timeout_s: float):
    """A gloo process group of its own over `store`, outside `torch.distributed`'s default group and its world
    (`torch.distributed.ProcessGroupGloo`, undocumented but exported; its ``(store, rank, size, timeout)``
    constructor checked on torch 2.13): the trainer's rank 0 with the rollout server's workers."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore("trl_distill_gloo", store), rank, world_size,
                                 timedelta(seconds=timeout_s))


def checkpoint_conversions(model_type: str) -> list[tuple[str, list[str], list[str], list[tuple[str, int]]]] | None:
    """transformers' own renaming of a model type's checkpoint tensors into its parameters, as plain data: one
    ``(kind, source patterns, target patterns, operations)`` per transform, ``kind`` "rename" or "convert", each
    operation ``(class name, dim)``; None when the model type has none. Read from
    `conversion_mapping.get_checkpoint_conversion_mapping` and each transform's `_original_source_patterns` /
    `_original_target_patterns` / `operations` (transformers 5.24)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    mapping = get_checkpoint_conversion_mapping(model_type)
    if mapping is None:
        return None
    return [("convert" if isinstance(t, WeightConverter) else "rename", list(t._original_source_patterns),
             list(t._original_target_patterns),
             [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(t, "operations", [])])
            for t in mapping]


# ---- liger-kernel 0.8.5: the GPU benchmark's comparison (benchmarks/gpu; not a dependency) ----

LIGER_CHECKED = "0.8.5"
# `LigerFusedLinearJSD.forward`'s parameters after ``self`` in liger-kernel 0.8.5
# (liger_kernel/transformers/fused_linear_jsd.py): all positional, none with a default, so `shift_labels` is required
LIGER_JSD_FORWARD = ("student_input", "student_weight", "teacher_input", "teacher_weight", "shift_labels")
LIGER_JSD_INIT = ("jsd_beta", "temperature")  # the keywords of its constructor we pass


def liger_jsd_signature_problem(module_class) -> str | None:
    """Why `module_class` (`LigerFusedLinearJSD`, or a class of its shape) is not the one checked, in one line; None
    when its forward takes exactly `LIGER_JSD_FORWARD` and its constructor `LIGER_JSD_INIT`."""
    import inspect

    forward = [p.name for p in inspect.signature(module_class.forward).parameters.values()][1:]  # after self
    init = inspect.signature(module_class.__init__).parameters
    if tuple(forward) == LIGER_JSD_FORWARD and all(name in init for name in LIGER_JSD_INIT):
        return None
    return (f"{module_class.__name__}.forward takes ({', '.join(forward)}) and its constructor "
            f"({', '.join(list(init)[1:])}); trl_distill.compat.liger_fused_linear_jsd was checked against "
            f"liger-kernel {LIGER_CHECKED}'s ({', '.join(LIGER_JSD_FORWARD)}) with {' and '.join(LIGER_JSD_INIT)}: "
            "re-check it against the installed liger-kernel.")


def liger_fused_linear_jsd(jsd_beta: float, temperature: float = 1.0, module_class=None):
    """Liger's fused linear generalised JSD as ``loss(hs [N, H_s], ws [V, H_s], ht [N, H_t], wt [V, H_t])`` -> a
    scalar (`jsd_beta` 0: forward KL, 1: reverse KL), every row a loss row (``shift_labels=None``, which 0.8.5
    requires passed). `module_class`: `liger_kernel.transformers.fused_linear_jsd.LigerFusedLinearJSD` unless given.
    Raises `RuntimeError` with one line when its signature is not the one checked (`liger_jsd_signature_problem`)."""
    if module_class is None:
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD as module_class
    problem = liger_jsd_signature_problem(module_class)
    if problem:
        raise RuntimeError(problem)
    module = module_class(jsd_beta=jsd_beta, temperature=temperature)

    def loss(hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        return module(hs, ws, ht, wt, shift_labels=None)

    return loss
