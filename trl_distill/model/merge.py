"""Fold a LoRA student's adapter into its base model, so it loads and serves without peft.

    trl-distill merge --adapter OUT/checkpoint-500 --output merged/ [--base BASE_DIR_OR_ID] [--dtype bfloat16]

The base model is the one named in the adapter's `adapter_config.json` unless `--base` says otherwise. The
tokenizer is copied from the adapter directory (the trainer saves it there) or else from the base.

`--output` is a new or empty directory, or one a finished merge wrote (it holds `MARKER`, listing the files it
saved, and nothing else): that merge's files are replaced. Anything else there (an existing file, the base model,
the user's files) is refused before anything loads; success is reported only once the files are on disk.
"""

from __future__ import annotations

import json
import os

from ..errors import ExternalError

MARKER = "trl_distill_merge.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # what peft's save_pretrained writes


def check_merge_output(output: str, adapter: str, base: str | None = None) -> list[str]:
    """Refuse an `output` that is an existing file, the adapter or base directory (or holds them), or a directory
    holding files no finished merge of ours wrote; returns the files of the previous merge there (to replace), else
    ``[]``."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise FileExistsError(f"--output: {output!r} is an existing file; pass a new directory for the merged model.")
    out = os.path.realpath(output)
    for what, given in (("the adapter (--adapter)", adapter), ("the base model", base)):
        if given and os.path.exists(given):
            read = os.path.realpath(given)
            # (a new directory inside the adapter's, like the example's OUT/merged, writes over nothing of it)
            if out == read or read.startswith(out + os.sep):
                raise FileExistsError(f"--output: {output!r} overlaps {what} {given!r}: the merge would write over "
                                      "what it reads. Pass a new directory.")
    if not os.path.isdir(output) or not os.listdir(output):
        return []
    previous = _previous_merge(output)
    others = sorted(set(_files(output)) - set(previous) - {MARKER}) if previous is not None else _files(output)
    if previous is None or others:
        shown = ", ".join(repr(n) for n in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise FileExistsError(f"--output: {output!r} is not empty ({shown}) and holds no earlier merge of ours: "
                              "choose a new directory; nothing there was touched.")
    return previous


def _files(directory: str) -> list[str]:
    """Every file under `directory`, relative to it."""
    found = []
    for root, _, names in os.walk(directory):
        found += [os.path.relpath(os.path.join(root, name), directory) for name in names]
    return sorted(found)


def _previous_merge(output: str) -> list[str] | None:
    try:
        with open(os.path.join(output, MARKER)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [name for name in files if isinstance(name, str)]


def _check_saved(output: str) -> list[str]:
    """The files the merge saved, or one error when the model is not all there (a save that wrote nothing)."""
    files = _files(output)
    index = os.path.join(output, "model.safetensors.index.json")
    try:
        if os.path.exists(index):
            with open(index) as f:
                weights = sorted(set(json.load(f)["weight_map"].values()))
        else:
            weights = ["model.safetensors"]
    except (OSError, ValueError, KeyError) as error:
        raise ExternalError(f"The merged model in {output!r} has an unreadable weight index ({error}).") from error
    absent = [name for name in ("config.json", *weights) if name not in files]
    if absent:
        raise ExternalError(f"The merged model was not saved to {output!r}: {', '.join(absent)} missing after saving. "
                            "Check that the directory is writable and has space, then run the merge again.")
    return files


def _check_weights(adapter: str, base: str, base_what: str) -> None:
    """The adapter's weights, and a local base's, are there and whole (a file cut short is one line naming it, not
    safetensors' error from inside peft)."""
    from ..runtime.validation import check_weights_complete

    if not any(os.path.isfile(os.path.join(adapter, name)) for name in ADAPTER_WEIGHTS):
        raise FileNotFoundError(f"--adapter: {adapter!r} holds adapter_config.json but no adapter weights "
                                f"({' or '.join(ADAPTER_WEIGHTS)}); pass a complete LoRA checkpoint directory.")
    check_weights_complete(adapter, "--adapter")
    check_weights_complete(base, base_what)


def merge_adapter(adapter: str, output: str, base: str | None = None, dtype: str = "auto") -> str:
    """Merge the LoRA adapter in `adapter` into its base model and save the result to `output`; returns `output`."""
    config_path = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"--adapter: no adapter_config.json in {adapter!r}; pass a LoRA checkpoint directory.")
    base_what = "--base" if base else f"the base model {config_path} names"
    try:
        with open(config_path) as f:
            base = base or json.load(f).get("base_model_name_or_path")
    except (ValueError, AttributeError) as error:  # cut short, not JSON, or JSON that is not an object
        raise ValueError(f"--adapter: {config_path} is not a readable adapter config ({error}); save or copy the "
                         "adapter again.") from error
    if not base:
        raise ValueError("The adapter does not name its base model; pass --base.")
    previous = check_merge_output(output, adapter, base)
    _check_weights(adapter, base, base_what)

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    tokenizer_source = adapter if os.path.isfile(os.path.join(adapter, "tokenizer_config.json")) else base
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    for name in [MARKER, *previous]:  # the earlier merge's files only (checked above), so none is left stale
        path = os.path.join(output, name)
        if os.path.isfile(path):
            os.remove(path)
    merged.save_pretrained(output)
    tokenizer.save_pretrained(output)
    files = _check_saved(output)
    with open(os.path.join(output, MARKER + ".tmp"), "w") as f:
        json.dump({"adapter": adapter, "base": base, "files": files}, f)
    os.replace(os.path.join(output, MARKER + ".tmp"), os.path.join(output, MARKER))
    return output
