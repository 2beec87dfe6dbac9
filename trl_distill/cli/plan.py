"""`trl-distill plan`: the per-GPU memory of a distillation run, six ways (see `trl_distill.runtime.plan`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from ..runtime.plan import (
    DTYPE_BYTES,
    HEADROOM,
    OPTIMIZER_BYTES,
    Settings,
    check_size,
    load_spec,
    parse_count,
    plan,
)
from ..runtime.plan_long import format_long_rows, long_rows
from ..runtime.plan_text import format_plan
from .errors import errors_as_messages

EPILOG = f"""\
assumptions: GiB = 2^30 bytes; a setup fits when its total is <= {1 - HEADROOM:.0%} of --gpu_memory_gb (the rest is
headroom for the CUDA context, NCCL/allocator buffers and fragmentation). Mixed precision (bf16/fp16) keeps
16-bit weights and gradients plus ZeRO's fp32 gradient partition and the optimizer's fp32 master copy; adamw =
12 bytes per trained parameter (fp32 master + 2 fp32 moments), sgd = 8 (master + momentum). Activations assume
flash/SDPA attention (no [T, T] scores) and a Llama-style layer. ZeRO-3 buffers follow the "auto" values our
configs get (prefetch bucket 0.9 h^2, persistence 10 h, reduce bucket h^2) and DeepSpeed's default
stage3_max_live_parameters (1e9). Details: docs/planner.md."""
_DIMS = {"hidden_size": "hidden", "layers": "layers", "vocab": "vocab", "intermediate_size": "intermediate",
         "heads": "heads", "kv_heads": "kv_heads"}
_MODEL = ("a model directory, a config.json (parameters counted exactly on the meta device), or a parameter count "
          "such as 8B, 600M or 8e9.")


@dataclass
class PlanArguments:
    student: str = field(metadata={"help": f"The student: {_MODEL}"})
    teacher: list[str] = field(metadata={"help": f"The teacher: {_MODEL} Several teachers at once (`--teachers`): "
                                         "one after another, e.g. --teacher 8B 7B (each its own ZeRO-3 engine)."})
    nodes: int = field(default=1, metadata={"help": "Number of nodes (default: 1)."})
    gpus_per_node: int = field(default=8, metadata={"help": "GPUs per node (default: 8)."})
    gpu_memory_gb: float = field(default=80.0, metadata={"help": "Memory of one GPU, GiB (default: 80)."})
    dtype: str = field(default="bf16", metadata={
        "help": "Weights/activations dtype of both models (default: bf16; fp32 = no mixed precision).",
        "choices": sorted(DTYPE_BYTES)})
    micro_batch: int = field(default=1, metadata={"help": "Sequences per GPU per step (default: 1)."})
    seq_len: int = field(default=4096, metadata={"help": "Tokens per sequence (default: 4096)."})
    optimizer: str = field(default="adamw", metadata={
        "help": "The student's optimizer: adamw = 12 bytes/param (fp32 master + 2 moments), sgd = 8.",
        "choices": sorted(OPTIMIZER_BYTES)})
    gradient_checkpointing: str = field(default="off", metadata={
        "help": "Student activation checkpointing (default: off).", "choices": ["on", "off"]})
    loss_chunk_size: int | None = field(default=None, metadata={
        "help": "Completion tokens per loss chunk (default: as the trainer picks it, so one chunk of fp32 logits is "
                "~128 MiB).", "metavar": "N"})
    gradient_accumulation: int = field(default=1, metadata={
        "help": "Micro-batches per optimizer step (default: 1). The teacher runs once per step over all of them "
                "and holds its hidden states at their loss tokens, and its lm_head, through the step."})
    teacher_batch_size: int | None = field(default=None, metadata={
        "help": "Rows per teacher forward in that pass (default: all rows of the step).", "metavar": "N"})
    sequence_parallel: int = field(default=1, metadata={
        "help": "GPUs that split each sequence (DeepSpeed Ulysses, `--sequence_parallel_size` in training): each holds "
        "1/N of its positions. Adds the long-sequence rows against SP 2 when 1 (default: 1)."})
    json: bool = field(default=False, metadata={"help": "Print the plan as JSON (sizes in bytes) instead of a table."})

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node", "gpu_memory_gb", "micro_batch", "seq_len", "loss_chunk_size",
                     "gradient_accumulation", "teacher_batch_size"):
            check_size(f"--{name}", getattr(self, name))  # > 0, finite, and small enough to compute with


@dataclass
class ModelShapeArguments:
    """Only with a parameter count (a config gives them): activations, logits and ZeRO-3 buffers need them. Unset:
    guessed Llama-like from the count (hidden/layers ~ 128, SwiGLU 8h/3, 128-dim heads), vocab from the other model,
    else 32000."""

    _argument_group_name = "model shape"
    student_hidden_size: int | None = field(default=None, metadata={"metavar": "N"})
    student_layers: int | None = field(default=None, metadata={"metavar": "N"})
    student_vocab: int | None = field(default=None, metadata={"metavar": "N"})
    student_intermediate_size: int | None = field(default=None, metadata={"metavar": "N"})
    student_heads: int | None = field(default=None, metadata={"metavar": "N"})
    student_kv_heads: int | None = field(default=None, metadata={"metavar": "N"})
    teacher_hidden_size: int | None = field(default=None, metadata={"metavar": "N"})
    teacher_layers: int | None = field(default=None, metadata={"metavar": "N"})
    teacher_vocab: int | None = field(default=None, metadata={"metavar": "N"})
    teacher_intermediate_size: int | None = field(default=None, metadata={"metavar": "N"})
    teacher_heads: int | None = field(default=None, metadata={"metavar": "N"})
    teacher_kv_heads: int | None = field(default=None, metadata={"metavar": "N"})

    def __post_init__(self):
        for f in fields(self):
            check_size(f"--{f.name}", getattr(self, f.name))


def build_parser():
    import argparse

    from transformers import HfArgumentParser

    return HfArgumentParser((PlanArguments, ModelShapeArguments), prog="trl-distill plan",
                            description="Estimate the per-GPU memory of a distillation run, six ways.",
                            epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)


def _specs(args: PlanArguments, shape: ModelShapeArguments):
    """Load the models; a count-only model without --*_vocab borrows the other side's vocabulary (a teacher the
    student's, the student the first teacher's). Several teachers: a tuple, each given the --teacher_* shape."""
    sources = {"student": args.student, "teacher": args.teacher[0]}
    dims = {role: {dim: getattr(shape, f"{role}_{flag}") for flag, dim in _DIMS.items()
                   if getattr(shape, f"{role}_{flag}")} for role in ("student", "teacher")}
    counted = {role: _for(role, parse_count, sources[role]) is not None for role in dims}
    order = ("teacher", "student") if counted["student"] else ("student", "teacher")
    specs = {}
    for role in order:
        other = specs.get("student" if role == "teacher" else "teacher")
        if counted[role] and other is not None and "vocab" not in dims[role]:
            dims[role]["vocab"] = other.vocab
        specs[role] = _for(role, load_spec, sources[role], dims[role])
    teachers = [specs["teacher"]]
    for source in args.teacher[1:]:
        own = dict(dims["teacher"])
        if _for("teacher", parse_count, source) is not None and "vocab" not in own:
            own["vocab"] = specs["student"].vocab
        teachers.append(_for("teacher", load_spec, source, own))
    return specs["student"], teachers[0] if len(teachers) == 1 else tuple(teachers)


def _for(role: str, function, *args):
    """`function(*args)`, a `ValueError` naming the flag of the model it is about (``--student: '0' is ...``)."""
    try:
        return function(*args)
    except ValueError as error:
        raise ValueError(f"--{role}: {error}") from error


def main(argv: list[str]) -> None:
    """`trl-distill plan ARGS...`."""
    with errors_as_messages("trl-distill plan"):
        args, shape = build_parser().parse_args_into_dataclasses(args=argv)
        student, teacher = _specs(args, shape)
        values = {f.name: getattr(args, f.name) for f in fields(Settings)}
        settings = Settings(**{**values, "gradient_checkpointing": args.gradient_checkpointing == "on"})
    result = plan(student, teacher, settings)
    result["long_sequences"] = long_rows(student, teacher, settings)
    print(json.dumps(result, indent=2) if args.json else
          format_plan(result) + "\n\n" + format_long_rows(result["long_sequences"]))
