"""A model's checkpoint files, checked against its config before anything loads them (on every rank, in seconds).

Only what the files say about themselves is read: a safetensors header (its tensors' shapes), a PyTorch zip
archive's directory and pickled metadata (memory-mapped onto the meta device: no weight is read). What is refused:

- a `config.json` that is not JSON, or whose ``vocab_size`` is not the number of rows of the embedding / lm_head
  the weights hold (`from_pretrained` would stop at training time, after the engines are built);
- a `pytorch_model.bin` (or a shard) that is not a complete zip archive: a download or a copy cut short.

A truncated or damaged safetensors file is `validation.check_weights_complete`'s to name; here it is skipped.
A quantized checkpoint (its config has a ``quantization_config``) packs its tensors in other shapes: not compared.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile

from .hub import require_hub

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# The tensors with one row per token: input embeddings and output heads, as transformers' models name them
VOCAB_ROWS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "lm_head.weight",
              "embed_out.weight")
_FIX = "Re-save or re-download the model."


def check_model_source(path: str, what: str) -> None:
    """A local model directory: its checkpoint files agree with its config. Any other name is a hub id: the hub
    must answer (`hub.require_hub`), unless ``HF_HUB_OFFLINE`` is set."""
    if os.path.isdir(path):
        check_checkpoint_files(path, what)
    else:
        require_hub(path, what)


def check_checkpoint_files(directory: str, what: str) -> None:
    """Raise one `ValueError` naming the file and the fix when `directory`'s weights cannot be what its
    `config.json` describes (see the module's docstring). A directory without a config is left to its loader."""
    config = _read_config(directory, what)
    shapes = _safetensors_shapes(directory) if _has_safetensors(directory) else _torch_bin_shapes(directory, what)
    if config is None or config.get("quantization_config"):
        return
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int):
        return
    for name, (shape, file) in shapes.items():
        if len(shape) == 2 and shape[0] != vocab and any(name == s or name.endswith("." + s) for s in VOCAB_ROWS):
            raise ValueError(
                f"{what}: {os.path.join(directory, 'config.json')} says vocab_size={vocab}, but {file} holds {name} "
                f"with {shape[0]} rows: the config does not belong to these weights. Set vocab_size to {shape[0]} in "
                "config.json, or re-save the model with `save_pretrained`."
            )


def _read_config(directory: str, what: str) -> dict | None:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{what}: {path} is not valid JSON ({error.msg}, line {error.lineno}). {_FIX}") from error
    except UnicodeDecodeError as error:
        raise ValueError(f"{what}: {path} is not valid JSON (not UTF-8 text). {_FIX}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{what}: {path} holds {type(config).__name__}, not a model config (a JSON object). {_FIX}")
    return config


def _has_safetensors(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in (SAFETENSORS, SAFETENSORS_INDEX))


def _shard_files(directory: str, single: str, index: str) -> list[str]:
    """The files transformers would load: those the index lists, else the single file (when present)."""
    index_path = os.path.join(directory, index)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                return sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return []  # a damaged index: check_weights_complete names it (safetensors), the loader otherwise
    return [single] if os.path.isfile(os.path.join(directory, single)) else []


def _safetensors_shapes(directory: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and file, from the headers; a file whose header does not parse is skipped (it is
    `check_weights_complete`'s to name)."""
    shapes = {}
    for name in _shard_files(directory, SAFETENSORS, SAFETENSORS_INDEX):
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > os.path.getsize(path) - 8:
                    continue
                header = json.loads(f.read(length))
        except (OSError, struct.error, ValueError, UnicodeDecodeError):
            continue
        for tensor, entry in header.items():
            if tensor != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("shape"), list):
                shapes[tensor] = (tuple(entry["shape"]), path)
    return shapes


def _torch_bin_shapes(directory: str, what: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and file in `pytorch_model.bin` (or its shards), read memory-mapped onto the meta device
    (`torch.load(mmap=True, weights_only=True)`: the pickled metadata only). A file that is not a complete zip
    archive is refused; one in PyTorch's legacy (pre-1.6, non-zip) format is left to its loader."""
    shapes = {}
    for name in _shard_files(directory, TORCH_BIN, TORCH_BIN_INDEX):
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        if not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                start = f.read(4)
            if size == 0 or start.startswith(b"PK"):  # a zip archive without its end: cut short
                raise ValueError(f"{what}: {path} is truncated ({size} bytes, not a complete zip archive as "
                                 f"`torch.save` writes). {_FIX}")
            continue
        state = _load_meta(path, what)
        for tensor, value in state.items():
            if hasattr(value, "shape"):
                shapes[tensor] = (tuple(value.shape), path)
    return shapes


def _load_meta(path: str, what: str) -> dict:
    import torch

    try:
        state = torch.load(path, map_location="meta", weights_only=True, mmap=True)
    except Exception as error:  # a damaged archive: torch's loader names no file
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{what}: {path} cannot be read as a PyTorch checkpoint ({detail}). {_FIX}") from error
    return state if isinstance(state, dict) else {}
