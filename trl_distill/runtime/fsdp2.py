"""The student under FSDP2 as accelerate configures it (`fsdp_version: 2`), and the settings of a teacher sharded with
FSDP2 on its own beside it (`teacher_fsdp_config`).

accelerate prepares every model with the one FSDP plugin of its Accelerator; the teacher is therefore never given to
`accelerator.prepare`: `teacher.fsdp2_loading` shards it over its own mesh, frozen, with its own settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import torch

from .. import compat

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class TeacherShardSettings:
    """How the teacher is sharded with FSDP2 (`teacher_fsdp_config`, a dict, JSON string or JSON file path).

    reshard_after_forward: free each layer's gathered weights after its forward (ZeRO-3-like, the default); False
        keeps them gathered after the first forward (fast, the whole teacher on every rank: replication).
    dtype: the dtype its weights are held and computed in (``bf16``, ``fp16``, ``fp32``); default: the student's
        mixed precision (bf16 / fp16), else the student's dtype.
    """

    reshard_after_forward: bool = True
    dtype: str | None = None

    @classmethod
    def parse(cls, given) -> TeacherShardSettings:
        if given is None:
            return cls()
        if isinstance(given, str):
            text = given.strip()
            if not text.startswith("{"):
                if not os.path.isfile(text):
                    raise ValueError(f"teacher_fsdp_config={given!r} is neither a JSON object nor an existing file; "
                                     'pass e.g. \'{"reshard_after_forward": true, "dtype": "bf16"}\' or a JSON file.')
                with open(text) as f:
                    text = f.read()
            try:
                given = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"teacher_fsdp_config is not valid JSON ({error}).") from None
        if not isinstance(given, dict):
            raise ValueError(f"teacher_fsdp_config must be a JSON object, got {type(given).__name__}.")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"teacher_fsdp_config: unknown key(s) {', '.join(unknown)}; the keys are "
                             f"{', '.join(sorted(known))}.")
        if given.get("dtype") is not None and given["dtype"] not in _DTYPES:
            raise ValueError(f"teacher_fsdp_config: dtype must be one of {', '.join(_DTYPES)}, got {given['dtype']!r}.")
        if not isinstance(given.get("reshard_after_forward", True), bool):
            raise ValueError("teacher_fsdp_config: reshard_after_forward must be true or false.")
        return cls(**given)

    def torch_dtype(self, student_dtype: torch.dtype, bf16: bool, fp16: bool) -> torch.dtype:
        """The teacher's dtype: its own when set, else the student's mixed precision, else the student's dtype."""
        if self.dtype is not None:
            return _DTYPES[self.dtype]
        return torch.bfloat16 if bf16 else torch.float16 if fp16 else student_dtype


def is_fsdp2(accelerator) -> bool:
    """Whether the student is prepared with FSDP2 (`fsdp_version: 2`)."""
    return bool(getattr(accelerator, "is_fsdp2", False))


def fsdp_requested(plugin_args: dict | None) -> bool:
    """Whether this run asks for FSDP: the Trainer's `fsdp_plugin_args` (from `fsdp` / `fsdp_config`), or `accelerate
    launch`'s environment (``ACCELERATE_USE_FSDP``)."""
    return plugin_args is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def requested_plugin(plugin_args: dict | None):
    """The FSDP plugin this run asks for (`fsdp_requested`) from the Trainer's `fsdp_plugin_args`, else accelerate's
    defaults (its environment); None without FSDP."""
    if not fsdp_requested(plugin_args):
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**(plugin_args or {}))


def turn_on_for_cpu(accelerator, plugin_args: dict | None) -> bool:
    """On CPU processes (gloo), give the accelerator the FSDP2 plugin accelerate left out (`compat`); True when it
    did. FSDP1 is not turned on there: it does not run on CPU. `plugin_args`: the Trainer's `fsdp_plugin_args`."""
    plugin = requested_plugin(plugin_args)
    if plugin is None or plugin.fsdp_version != 2 or accelerator.device.type != "cpu":
        return False
    return compat.fsdp_on_cpu_processes(accelerator, plugin)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` whole: an FSDP2 DTensor's `full_tensor()` (collective: every rank calls it), any other as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def world_mesh(accelerator):
    """A 1-D device mesh over every process (the teacher's own: it shards over all ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(accelerator.device.type, (accelerator.num_processes,))


def refuse_evaluation_before_training(accelerator) -> None:
    """One line for `evaluate()` before `train()` under FSDP2: accelerate 1.15 prepares an FSDP2 model only together
    with its optimizer (which `train()` creates), and the stock evaluation loop would prepare the student alone."""
    if is_fsdp2(accelerator) and not compat.prepared_models(accelerator):
        raise ValueError("evaluate() before train() with an FSDP2 student: accelerate prepares an FSDP2 model only "
                         "together with its optimizer, which train() creates. Evaluate during training "
                         "(eval_strategy='steps') or after train(), or evaluate first with a DeepSpeed student.")


@contextlib.contextmanager
def whole_state_dict_for_save_model(accelerator, internal: bool):
    """`save_model` writes the student whole (`model.safetensors`, what `from_pretrained` loads) also when the FSDP2
    plugin's `state_dict_type` is `SHARDED_STATE_DICT`, with which the stock Trainer's `save_model` writes nothing
    (TRL's scripts switch to `FULL_STATE_DICT` before it, as here). Checkpoints (`internal`) keep the plugin's type."""
    plugin = accelerator.state.fsdp_plugin if is_fsdp2(accelerator) else None
    given = getattr(plugin, "state_dict_type", None)
    if internal or plugin is None or "FULL_STATE_DICT" in str(given):
        yield
        return
    plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        yield
    finally:
        plugin.set_state_dict_type(given)
