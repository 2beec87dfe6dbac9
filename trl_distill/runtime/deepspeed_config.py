"""The teacher's own DeepSpeed config: load it, derive it, and fill its ``"auto"`` values.

The teacher never trains, so its config is an inference config: ZeRO stage 3 (parameters partitioned across
ranks), no optimizer, no scheduler. Its ``"auto"`` values are filled from the same `TrainingArguments` as the
student's, and its ZeRO-3 bucket sizes from the *teacher's* hidden size (not the student's).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..run_plan import TeacherEngine

logger = logging.getLogger(__name__)

_DROPPED_BLOCKS = ("optimizer", "scheduler")


def load_deepspeed_config(config: str | os.PathLike | dict | None) -> dict | None:
    """Read a DeepSpeed config given as a dict, a path to a JSON file, or a JSON string.

    Parsing is lenient about trailing commas (as in the examples of accelerate's multi-model guide); any other
    syntax error names the file, line and column.
    """
    if config is None or isinstance(config, dict):
        return copy.deepcopy(config)
    text, source = str(config), "<string>"
    if os.path.exists(text):
        source = text
        with open(text, encoding="utf-8") as f:
            text = f.read()
    elif not text.lstrip().startswith("{"):
        raise FileNotFoundError(f"DeepSpeed config file not found: {text!r}. Pass an existing JSON file or a dict.")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(re.sub(r",(\s*[}\]])", r"\1", text))
    except json.JSONDecodeError as e:
        raise ValueError(f"Invalid JSON in DeepSpeed config {source}, line {e.lineno} column {e.colno}: {e.msg}") from e


def derive_teacher_config(student_config: dict | None) -> dict:
    """A ZeRO-3 inference config for the teacher, following the student's precision settings."""
    config: dict[str, Any] = {
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }
    for key in ("bf16", "fp16"):
        if student_config and key in student_config:
            config[key] = {"enabled": student_config[key].get("enabled", "auto")}
        else:
            config[key] = {"enabled": "auto"}
    return config


def _fill(config: dict, dotted_key: str, value: Any) -> None:
    """Replace `config[dotted_key]` by `value` where it is missing-in-a-present-block or ``"auto"``."""
    *parents, leaf = dotted_key.split(".")
    node = config
    for parent in parents:
        node = node.get(parent)
        if not isinstance(node, dict):
            return
    if node.get(leaf, "auto") == "auto":
        node[leaf] = value


def _fill_zero_defaults(config: dict) -> dict[str, int]:
    """Replace ``"auto"`` values left in ``zero_optimization`` by DeepSpeed's defaults for those keys (read from its
    `DeepSpeedZeroConfig` fields, by name or alias; checked against deepspeed 0.19.8). Returns what was filled."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return {}
    fields = {f.alias or name: f for name, f in DeepSpeedZeroConfig.model_fields.items()}
    fields.update(DeepSpeedZeroConfig.model_fields)
    filled = {}
    for key, value in zero.items():
        default = getattr(fields.get(key), "default", None)
        if value == "auto" and isinstance(default, int) and not isinstance(default, bool):
            zero[key] = filled[key] = int(default)
    return filled


def _remaining_auto(config: Any, prefix: str = "") -> list[str]:
    if isinstance(config, dict):
        return [k for key, v in config.items() for k in _remaining_auto(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if config == "auto" else []


def build_teacher_config(
    teacher_config: str | os.PathLike | dict | None,
    student_config: dict | None,
    engine: TeacherEngine,
    teacher_hidden_size: int,
    notes: list[str] | None = None,
) -> dict:
    """The teacher's effective DeepSpeed config.

    Args:
        teacher_config: the user's teacher config (path, JSON string or dict), or None to derive a ZeRO-3
            inference config from `student_config`.
        student_config: the student's DeepSpeed config (only its precision blocks are read).
        engine: the run plan's `TeacherEngine`: the student's values that ``"auto"`` entries take.
        teacher_hidden_size: the teacher's hidden size, for the ZeRO-3 bucket sizes.
        notes: where to append a line saying which values were filled with DeepSpeed's defaults.

    Other ``"auto"`` values of the ZeRO block (e.g. ``stage3_max_live_parameters`` in accelerate's multi-model guide)
    get DeepSpeed's own defaults, as if the key were absent.
    """
    config = load_deepspeed_config(teacher_config) if teacher_config is not None else None
    if config is None:
        config = derive_teacher_config(student_config)
    dropped = [block for block in _DROPPED_BLOCKS if config.pop(block, None) is not None]
    if dropped:
        blocks = " and ".join(dropped)
        logger.warning(f"The teacher never trains: dropped the {blocks} block(s) of its DeepSpeed config.")
    config.setdefault("zero_optimization", {"stage": 3})
    stage = config["zero_optimization"].get("stage", 0)
    if stage != 3:
        logger.warning(
            f"The teacher's DeepSpeed config has ZeRO stage {stage}: every rank will hold the whole teacher. "
            "Use stage 3 to partition it across ranks."
        )
    _fill(config, "train_micro_batch_size_per_gpu", engine.micro_batch_size)
    _fill(config, "gradient_accumulation_steps", engine.gradient_accumulation_steps)
    # DeepSpeed checks train_batch_size == micro batch × accumulation × world size: follow the config's own values
    # (accelerate's guide fixes the teacher's micro batch at 1 whatever the student's is)
    micro_batch = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps")
    if isinstance(micro_batch, int) and isinstance(accumulation or 1, int):
        _fill(config, "train_batch_size", micro_batch * (accumulation or 1) * engine.world_size)
    _fill(config, "gradient_clipping", engine.max_grad_norm)
    _fill(config, "bf16.enabled", engine.bf16 or engine.bf16_full_eval)
    _fill(config, "fp16.enabled", engine.fp16 or engine.fp16_full_eval)
    h = teacher_hidden_size
    _fill(config, "zero_optimization.reduce_bucket_size", h * h)
    if stage == 3:
        _fill(config, "zero_optimization.stage3_prefetch_bucket_size", int(0.9 * h * h))
        _fill(config, "zero_optimization.stage3_param_persistence_threshold", 10 * h)
    filled = _fill_zero_defaults(config)
    if filled and notes is not None:
        notes.append(f"'auto' filled with DeepSpeed's defaults: {filled}")
    left = _remaining_auto(config)
    if left:
        raise ValueError(
            f"The teacher's DeepSpeed config has 'auto' values that cannot be filled: {left}. "
            "Replace them with numbers."
        )
    config.setdefault("steps_per_print", float("inf"))
    return config


def print_engine_configs(accelerator, teacher_notes: list[str]) -> None:
    """Log the effective DeepSpeed config of each engine (call on global rank 0, as training starts)."""
    plugins = getattr(accelerator.state, "deepspeed_plugins", None)
    for name, plugin in (plugins.items() if isinstance(plugins, dict) else ()):
        mine = teacher_notes if name == "teacher" else [  # several teachers: "NAME: note" for plugin "teacher:NAME"
            note.split(": ", 1)[1] for note in teacher_notes if name.startswith("teacher:")
            and note.startswith(f"{name.split(':', 1)[1]}: ")]
        note = f" ({'; '.join(mine)})" if mine else ""
        logger.info(f"trl_distill: {name} DeepSpeed config{note}: {json.dumps(plugin.deepspeed_config)}")
