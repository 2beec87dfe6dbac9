"""Checks that run before any heavy work (on every rank), so bad input fails in seconds with one clear message."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
from typing import TYPE_CHECKING

import torch

from ..errors import ExternalError

if TYPE_CHECKING:
    from ..teacher.settings import TeacherPaths

logger = logging.getLogger(__name__)


def looks_local(path: str) -> bool:
    """Whether `path` means a local directory rather than a hub id (``org/name``)."""
    return os.path.isabs(path) or path.startswith(".") or path.count("/") > 1 or os.path.isdir(path)


def check_model_path(path: str, what: str) -> None:
    """A local-looking model path must be a directory whose checkpoint files agree with its config; a hub id needs
    a hub that answers (`checkpoint_files.check_model_source`), then is left to `from_pretrained`."""
    if looks_local(path) and not os.path.isdir(path):
        raise FileNotFoundError(f"{what}: no model directory at {path!r}.")
    from .checkpoint_files import check_model_source

    check_model_source(path, what)  # a directory: its files agree with its config; a hub id: the hub answers


def check_weights_complete(directory: str, what: str) -> None:
    """A local model's safetensors files hold every byte their headers promise: a truncated or damaged file is one
    clear error here, on every rank, before any engine is built (else one rank dies mid-load and the others hang)."""
    if not os.path.isdir(directory):
        return
    index = os.path.join(directory, "model.safetensors.index.json")
    try:
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    except (ValueError, KeyError) as error:
        raise ValueError(f"{what}: {index} is not a valid safetensors index ({error}).") from error
    present: dict[str, str] = {}  # every tensor the files hold: the file that holds it
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ValueError(f"{what}: {path} is listed in model.safetensors.index.json but missing.")
        size = os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length)) if 8 + length <= size else None
        except (struct.error, ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{what}: {path} is not a valid safetensors file ({error}). Re-save or re-download "
                             "the model.") from error
        if header is None:
            raise ValueError(f"{what}: {path} is truncated ({size} bytes, shorter than its header). Re-save or "
                             "re-download the model.")
        header.pop("__metadata__", None)
        expected = 8 + length + max((entry["data_offsets"][1] for entry in header.values()), default=0)
        if size < expected:
            raise ValueError(f"{what}: {path} is truncated ({size} bytes; its header needs {expected}). Re-save or "
                             "re-download the model.")
        present.update(dict.fromkeys(header, path))
    if present:
        source = index if os.path.exists(index) else os.path.join(directory, files[0])
        missing = _tensors_missing(directory, set(present))
        if missing:
            raise ValueError(missing_tensors_message(what, source, missing))


def missing_tensors_message(what: str, source: str, missing: list[str]) -> str:
    """One line naming the tensors a checkpoint lacks (transformers would initialise them randomly) and its file."""
    names = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    return (f"{what}: {source} lacks {len(missing)} tensor(s) the model needs ({names}); loading would fill them "
            "with random values. Re-save or re-download the model.")


def weights_file(source: str) -> str:
    """The file a model's weights are read from, for a message: the index of a sharded checkpoint, else its one
    weights file; `source` itself for a hub id."""
    for name in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                 "pytorch_model.bin"):
        if os.path.isfile(os.path.join(source, name)):
            return os.path.join(source, name)
    return source


def expected_parameters(model) -> list[list[str]]:
    """The names of each of `model`'s parameters, one list per parameter (tied weights share one: either name in
    a checkpoint fills it)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())


def unfilled(groups: list[list[str]], present: set[str], ignore: list[str] | None = None) -> list[str]:
    """The parameters (first name of each group) none of whose names is in `present`, less the `ignore` patterns
    (a model class's ``_keys_to_ignore_on_load_missing``)."""
    import re

    missing = [names[0] for names in groups if not present.intersection(names)]
    return [name for name in missing if not any(re.search(pattern, name) for pattern in ignore or ())]


def _tensors_missing(directory: str, present: set[str]) -> list[str]:
    """The parameters a causal LM built from `directory`'s config has and its safetensors files lack: built on the
    meta device (nothing allocated). Only where the files use the model's own names (no tensor the model does not
    name): a checkpoint that transformers converts as it loads (renamed or fused tensors) is its loader's to report.
    Empty when the config cannot be built here (remote code, another kind of model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(directory)
        if getattr(config, "quantization_config", None) is not None:
            return []
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as error:  # noqa: BLE001 - any config this check cannot build is left to the loader
        logger.debug("Not checking %s for missing tensors: %s", directory, error)
        return []
    known = set(model.state_dict())
    if present - known:
        return []  # names the model does not use: a checkpoint transformers converts as it loads
    return unfilled(expected_parameters(model), present, getattr(model, "_keys_to_ignore_on_load_missing", None))


def refuse_quantization_without_gpu(init_kwargs: dict | str | None, where: str) -> None:
    """QLoRA (bitsandbytes 4-/8-bit weights) needs a CUDA GPU: say so up front instead of failing deep in loading."""
    quantized = isinstance(init_kwargs, dict) and (
        init_kwargs.get("quantization_config") is not None
        or init_kwargs.get("load_in_4bit") or init_kwargs.get("load_in_8bit")
    )
    if quantized and not torch.cuda.is_available():
        raise ValueError(
            f"{where} asks for quantized (QLoRA / bitsandbytes) weights, which need a CUDA GPU, and none is visible. "
            "Drop the quantization (--load_in_4bit / --load_in_8bit / quantization_config) to train in full "
            "precision on this machine."
        )


def check_tokenizers_match(student_tokenizer, teacher_tokenizer) -> None:
    """When the teacher has its own tokenizer and the run does not distil across tokenizers, it must map tokens to
    the same ids as the student's: the divergence compares distributions id by id. Skipped when either is None."""
    student_tokenizer = getattr(student_tokenizer, "tokenizer", student_tokenizer)
    if student_tokenizer is None or teacher_tokenizer is None or not hasattr(student_tokenizer, "get_vocab"):
        return
    mine, theirs = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if mine == theirs:
        return
    differing = sorted(t for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t))
    raise ValueError(
        f"Student and teacher tokenizers differ: {len(mine)} vs {len(theirs)} tokens, {len(differing)} mapped "
        f"differently (e.g. {differing[:3]}). Distillation compares next-token distributions id by id, so both models "
        "must use one tokenizer."
    )


def check_dataset_not_empty(dataset, split: str, when: str, max_length: int | None = None) -> None:
    """An empty split would make the Trainer fail later with an unrelated error (or train on nothing)."""
    if dataset is None or not hasattr(dataset, "__len__") or len(dataset) > 0:
        return
    if when == "given":
        raise ValueError(f"The {split} dataset is empty.")
    raise ValueError(
        f"The {split} dataset is empty after preprocessing: every example was dropped because no completion or "
        f"assistant token survived truncation to max_length={max_length}. Raise `max_length`, shorten the prompts, "
        "or check that the completions are not empty."
    )


class TeacherNotFiniteError(ExternalError, FloatingPointError):
    """The teacher's outputs hold NaN or inf (its weights or its dtype), raised on every rank together."""


def teacher_not_finite(where: str, ranks: int) -> TeacherNotFiniteError:
    return TeacherNotFiniteError(
        f"The teacher produced NaN or inf at {where} (on {ranks} rank(s)). Check its dtype (fp16 "
        "overflows: use bf16 or fp32 via `teacher_model_init_kwargs={'dtype': ...}`) and its weights."
    )


def shared_vocab_size(student_config, teacher_config, tokenizer) -> int:
    """The number of logits compared: the tokenizer's length (padded embedding rows beyond it are ignored); one
    clear error when the two models cannot share a tokenizer."""
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


def check_output_dir(path: str, inputs: dict[str, str | None] | None = None) -> None:
    """`output_dir` must be a directory this process can write, apart from everything the run reads, checked before
    any work: an output that is, holds or lies inside one of `inputs` (``{what: path}``, see `run_inputs`) would
    save over the teacher, the student or the data; an existing file there, or a place it cannot create or write,
    is found at the end otherwise, after the whole run. Writes nothing that stays: an existing directory gets a
    probe file, removed at once; a missing one is not created here, its nearest existing parent is checked."""
    check_apart(path, inputs or {})
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"output_dir {path!r} is an existing file, not a directory: pass another --output_dir.")
    if os.path.isdir(path):
        probe = os.path.join(path, f".trl_distill_write_probe_{socket.gethostname()}_{os.getpid()}")
        try:
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
            return
        except OSError as error:
            raise ValueError(f"Cannot write to output_dir {path!r} ({error.strerror or error}): pass a writable "
                             "--output_dir.") from error
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"Cannot create output_dir {path!r}: {parent!r} is not a writable directory. Pass a "
                         "writable --output_dir.")


def check_apart(output: str, inputs: dict[str, str | None]) -> None:
    """Refuse an `output` directory that is, holds or lies inside a local path of `inputs` (``{what: path}``; a hub
    id, None or a path that does not exist is not a local input). Symbolic links are followed."""
    out = os.path.realpath(output)
    for what, given in inputs.items():
        if not given or not os.path.exists(given):
            continue
        read = os.path.realpath(given)
        if out == read:
            how = "is"
        elif out.startswith(read.rstrip(os.sep) + os.sep):
            how = "is inside"
        elif read.startswith(out.rstrip(os.sep) + os.sep):
            how = "holds"
        else:
            continue
        raise ValueError(f"The output directory {output!r} {how} {what} {given!r}: the run would write its model "
                         "and checkpoints into what it reads. Pass an output directory apart from every input "
                         "(--output_dir; for cache-teacher, --teacher_cache).")


def run_inputs(paths: TeacherPaths, student=None, teacher=None, datasets=(), teachers=()) -> dict[str, str | None]:
    """``{what: path}`` of everything a run reads from disk: the student, the teacher (a `teacher` object or name,
    else the plan's `paths`; or several `teachers`, the plan's specs), its cache and tokenizer, the data files (for
    `check_output_dir`). A model object counts by the directory it was loaded from."""
    teacher = teacher if teacher is not None else paths.model
    inputs = {"the student (--model_name_or_path)": _source_of(student),
              "the teacher (--teacher_model_name_or_path)": _source_of(teacher),
              "the teacher cache (--teacher_cache)": paths.cache,
              "the teacher's tokenizer (--teacher_tokenizer_name_or_path)": paths.tokenizer}
    for spec in teachers:  # several teachers: each one's model or cache directory
        inputs[f"the teacher {spec.name} (--teachers)"] = _source_of(spec.model or spec.cache)
    for number, source in enumerate(path for dataset in datasets for path in dataset_sources(dataset)):
        inputs[f"the dataset{'' if number == 0 else f' ({number + 1})'} (--dataset_name)"] = source
    return inputs


def _source_of(model) -> str | None:
    """The local directory a model (or a path) comes from, if any."""
    path = model if isinstance(model, str | os.PathLike) else getattr(model, "name_or_path", None)
    return os.fspath(path) if isinstance(path, str | os.PathLike) and os.path.exists(path) else None


def dataset_sources(dataset) -> list[str]:
    """The local paths a `datasets` dataset (or a dict of them) was read from: its data files where `datasets`
    recorded them, and the directory of the Arrow files of a `save_to_disk` dataset (not the datasets cache, which
    is not the user's). A data file loaded with `load_dataset("json", ...)` is not recorded: the command line checks
    its --dataset_name itself."""
    from datasets import config

    cache = os.path.realpath(str(config.HF_DATASETS_CACHE))
    found = []
    for split in dataset.values() if isinstance(dataset, dict) else [dataset] if dataset is not None else []:
        info = getattr(split, "info", None)
        names = list(getattr(info, "download_checksums", None) or {})
        names += [os.path.dirname(entry.get("filename") or "") for entry in getattr(split, "cache_files", None) or []]
        for name in names:
            if isinstance(name, str) and os.path.exists(name) and not os.path.realpath(name).startswith(cache):
                found.append(name)
    return list(dict.fromkeys(found))


def check_router_aux_loss(student, enabled: bool, sequence_parallel_size: int) -> None:
    """A Mixture-of-Experts student whose router load-balancing loss is on (`router_aux_loss_coef`): the loss takes
    it from the student's own forward (`model.fused_forward.router_aux_loss`), so the model must compute one; under
    sequence parallelism (the run's `sequence_parallel_size`) each rank would balance its shard's positions alone:
    refused."""
    if not enabled:
        return
    from ..model.fused_forward import moe_aux_refusal

    refusal = moe_aux_refusal(student)
    if refusal is not None:
        raise ValueError(refusal)
    coefficient = getattr(student.config.get_text_config(), "router_aux_loss_coef", 0.0)
    if isinstance(coefficient, float) and not math.isfinite(coefficient):  # the model's own (the flag is checked)
        raise ValueError(f"The student's config.json sets router_aux_loss_coef={coefficient}: pass a finite "
                         "--router_aux_loss_coef (e.g. 0.001), or 0.0 to train without the router loss.")
    if sequence_parallel_size > 1:
        raise ValueError("A Mixture-of-Experts student's router load-balancing loss under sequence parallelism is not "
                         "supported: each rank would balance its own shard of the positions. Set "
                         "router_aux_loss_coef=0.0, or sequence_parallel_size=1.")
