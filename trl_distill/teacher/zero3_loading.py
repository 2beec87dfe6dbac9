"""Load a ZeRO-3 teacher straight into each rank's partition, each rank reading only its own bytes of the checkpoint.

transformers' ZeRO-3 `from_pretrained` (5.24) maps the whole checkpoint on rank 0 and gathers every module whole on
every rank to copy it in, so loading peaks well above the 1/N a rank keeps. Here the model is built partitioned
(`from_config` under the teacher's ZeRO-3 plugin: `zero.Init`, with no random initialisation and no broadcast, see
`compat.partitioned_construction`), then every parameter's partition is filled with ``os.pread`` from its byte range
in the ``.safetensors`` files, straight into the partition's memory: a rank reads 1/N of the checkpoint and its
memory grows by its partitions only (plus a 16 MiB buffer where the file's dtype differs from the model's). Each
module's whole tensor is still allocated while it is built, but never written, so its pages are never touched.

Used when the teacher is a local directory of safetensors whose tensor names and shapes are exactly the model's
parameters (the usual `save_pretrained` output), or a Mixture-of-Experts checkpoint whose experts' tensors are stored
apart and fused by transformers' conversion (`expert_layout`); anything else (hub ids, ``.bin``, otherwise renamed or
converted weights, quantization, NVMe offload) goes through `from_pretrained`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct

import torch

from ..compat import partitioned_construction, zero3_partition
from ..errors import ExternalError
from ..runtime.validation import expected_parameters, missing_tensors_message, unfilled
from .expert_layout import expert_layout

logger = logging.getLogger(__name__)

# safetensors dtype names -> torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def safetensors_index(directory: str) -> dict[str, tuple[str, dict, int]] | None:
    """``{tensor name: (file, header entry, data start offset)}`` of a local safetensors checkpoint, else None."""
    if not os.path.isdir(directory):
        return None
    index_file = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index_file):
        with open(index_file) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        return None
    entries = {}
    for name in files:
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        for key, entry in header.items():
            entries[key] = (path, entry, 8 + length)
    return entries


_CHUNK_BYTES = 16 << 20  # the host buffer a conversion or a device partition is filled through


class HostStaging:
    """One bounded host buffer (`_CHUNK_BYTES`) through which a partition that `pread` cannot write is filled: one
    on an accelerator (CUDA: page-locked, so each copy up is a DMA from it) or of another dtype than the file's. One
    per load, reused for every parameter: pinning memory is slow, so it is not done per tensor."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.nbytes = _CHUNK_BYTES
        self._buffer: torch.Tensor | None = None

    def chunk(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """A host tensor of `count` elements of `dtype` over the buffer (`count` at most `elements(dtype)`)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self._buffer[: count * itemsize].view(dtype)

    def elements(self, dtype: torch.dtype) -> int:
        return max(1, self.nbytes // torch.empty((), dtype=dtype).element_size())


def _read_into(target: torch.Tensor, path: str, entry: dict, data_start: int, first: int,
               staging: HostStaging | None = None) -> int:
    """Fill the contiguous 1-D `target` with elements ``[first, first + target.numel())`` of a tensor stored
    row-major in a safetensors file: read with pread straight into `target`'s memory when it is host memory of the
    file's dtype, else through `staging`'s bounded host buffer (a partition on a GPU, or another dtype), chunk by
    chunk. Returns the bytes read from the file."""
    dtype = _DTYPES[entry["dtype"]]
    itemsize = torch.empty((), dtype=dtype).element_size()
    begin = data_start + entry["data_offsets"][0] + first * itemsize
    fd = os.open(path, os.O_RDONLY)
    try:
        if target.dtype == dtype and target.device.type == "cpu":
            _pread_exact(fd, _bytes_of(target), begin, path)
        else:
            staging = staging if staging is not None else HostStaging(target.device)
            step = staging.elements(dtype)
            for start in range(0, target.numel(), step):
                chunk = staging.chunk(dtype, min(step, target.numel() - start))
                _pread_exact(fd, _bytes_of(chunk), begin + start * itemsize, path)
                # a blocking copy: the buffer is refilled next, so this chunk must have left it
                target[start : start + chunk.numel()].copy_(chunk)
    finally:
        os.close(fd)
    return target.numel() * itemsize


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    if tensor.device.type != "cpu":
        raise ValueError(f"_bytes_of reads host memory; this tensor is on {tensor.device} (fill it via HostStaging)")
    return memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else memoryview(bytearray())


def _pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{path}: short read at byte {offset + done}")
        done += n


def read_segments(target: torch.Tensor, segments: list[tuple[str, int]], entries: dict, first: int,
                   staging: HostStaging | None = None) -> int:
    """Fill `target` with elements ``[first, first + target.numel())`` of a tensor laid out as the checkpoint tensors
    `segments` one after another (`expert_layout`; one segment: the tensor itself). Returns the bytes read."""
    done, offset, stop = 0, 0, first + target.numel()
    for name, numel in segments:
        low, high = max(first, offset), min(stop, offset + numel)
        if low < high:
            path, entry, start = entries[name]
            done += _read_into(target[low - first : high - first], path, entry, start, low - offset, staging)
        offset += numel
    return done


def _read_flat(path: str, entry: dict, data_start: int, first: int, count: int) -> torch.Tensor:
    """Elements ``[first, first + count)`` of a tensor stored row-major in a safetensors file, as a new tensor."""
    values = torch.empty(count, dtype=_DTYPES[entry["dtype"]])
    _read_into(values, path, entry, data_start, first)
    return values


def refuse_missing(directory: str, model, entries: dict) -> None:
    """One error naming the parameters the checkpoint lacks, where its tensors all carry the model's own names (the
    fallback, `from_pretrained`, would fill the others with random values; tied weights need one of their names)."""
    known = {name for name, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers()}
    if set(entries) - known:
        return  # other names: not ours to judge here (`from_pretrained` converts them, and reports what is missing)
    ignored = getattr(model, "_keys_to_ignore_on_load_missing", None)
    missing = unfilled(expected_parameters(model), set(entries), ignored)
    if missing:
        index = os.path.join(directory, "model.safetensors.index.json")
        source = index if os.path.exists(index) else os.path.join(directory, "model.safetensors")
        raise ExternalError(missing_tensors_message("teacher_model", source, missing))


def parameter_layout(model_type: str, shapes: dict[str, tuple], entries: dict) -> dict | None:
    """``{parameter name: [(checkpoint tensor, element count), ...]}``: the checkpoint tensors each parameter's flat
    elements come from, in order (one: the tensor of the same name and shape; several: a Mixture-of-Experts
    checkpoint whose experts are stored apart, `expert_layout`). None when the checkpoint's names or shapes are not
    the model's (the caller loads with `from_pretrained`)."""
    layout = {name: [(name, math.prod(shape))] for name, shape in shapes.items()}
    if any(name not in entries or tuple(entries[name][1]["shape"]) != shape for name, shape in shapes.items()):
        # a Mixture-of-Experts checkpoint with each expert's tensors apart: each fused parameter from them
        layout = expert_layout(model_type, shapes, {k: tuple(e[1]["shape"]) for k, e in entries.items()})
    if layout is None:
        logger.info("Teacher checkpoint names/shapes differ from the model's parameters: loading with from_pretrained.")
    return layout


def loadable(directory: str, init_kwargs: dict) -> bool:
    """Whether `load_partitioned` applies: a local safetensors checkpoint and no quantization."""
    quantized = any(k in init_kwargs for k in ("quantization_config", "load_in_4bit", "load_in_8bit"))
    return not quantized and isinstance(directory, str) and safetensors_index(directory) is not None


def load_partitioned(directory: str, init_kwargs: dict):
    """Build the model under the selected ZeRO-3 plugin and fill each rank's partitions from the checkpoint.

    Returns None (nothing loaded) when the checkpoint's names or shapes do not match the model's parameters
    exactly, so the caller can fall back to `from_pretrained`; raises `ExternalError` when its names are the
    model's but some parameter has none (it would be left random). Collective: every rank calls it.
    """
    from transformers import AutoModelForCausalLM

    entries = safetensors_index(directory)
    config, dtype, model_kwargs = construction_args(directory, init_kwargs)
    with partitioned_construction():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    params = dict(model.named_parameters())  # tied weights appear once
    refuse_missing(directory, model, entries)
    layout = parameter_layout(config.model_type, {name: tuple(getattr(p, "ds_shape", p.shape))
                                                  for name, p in params.items()}, entries)
    if layout is None:
        return None
    if any(zero3_partition(p) is None for p in params.values()):
        return None  # not partitioned (or swapped to NVMe): nothing for a slice to go into
    staging = HostStaging(zero3_partition(next(iter(params.values())))[0].device)  # one host buffer for a GPU's
    with torch.no_grad():
        for name, param in params.items():
            part, first, count = zero3_partition(param)
            # into the partition itself (through `staging` on a GPU): no second whole copy
            read_segments(part[:count], layout[name], entries, first, staging)
            part[count:].zero_()
        fill_buffers(model, entries)  # (not partitioned by ZeRO-3)
    model.eval()
    return model


def construction_args(directory: str, init_kwargs: dict) -> tuple:
    """``(config, dtype, from_config keyword arguments)`` to build the model of the checkpoint in `directory` as
    `from_pretrained` with `init_kwargs` would."""
    from transformers import AutoConfig

    config_kwargs = {k: init_kwargs[k] for k in ("revision", "trust_remote_code") if k in init_kwargs}
    config = AutoConfig.from_pretrained(directory, **config_kwargs)
    dtype = init_kwargs.get("dtype", init_kwargs.get("torch_dtype"))
    if dtype is None or dtype == "auto":
        dtype = config.dtype if dtype == "auto" and config.dtype is not None else torch.float32
    model_kwargs = {k: v for k, v in init_kwargs.items() if k in ("attn_implementation", "trust_remote_code")}
    return config, dtype, model_kwargs


@torch.no_grad()
def fill_buffers(model, entries: dict) -> None:
    """Copy the checkpoint's persistent buffers (those of the model's names and shapes) into the model's."""
    for name, buffer in model.named_buffers():
        if name in entries and tuple(entries[name][1]["shape"]) == tuple(buffer.shape):
            path, entry, start = entries[name]
            buffer.copy_(_read_flat(path, entry, start, 0, buffer.numel()).view(buffer.shape).to(buffer.dtype))
