"""Fold a LoRA student's adapter into its base model, so it loads and serves without peft.

    trl-distill merge --adapter OUT/checkpoint-500 --output merged/ [--base BASE_DIR_OR_ID] [--dtype bfloat16]

The base model is the one named in the adapter's `adapter_config.json` unless `--base` says otherwise. The
tokenizer is copied from the adapter directory (the trainer saves it there) or else from the base.
"""

from __future__ import annotations

import json
import os


def merge_adapter(adapter: str, output: str, base: str | None = None, dtype: str = "auto") -> str:
    """Merge the LoRA adapter in `adapter` into its base model and save the result to `output`; returns `output`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_path = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"--adapter: no adapter_config.json in {adapter!r}; pass a LoRA checkpoint directory.")
    if os.path.isdir(output) and os.listdir(output):
        raise FileExistsError(f"--output: {output!r} exists and is not empty; choose a new directory.")
    with open(config_path) as f:
        base = base or json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError("The adapter does not name its base model; pass --base.")
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(output)
    tokenizer_source = adapter if os.path.isfile(os.path.join(adapter, "tokenizer_config.json")) else base
    AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(output)
    return output
