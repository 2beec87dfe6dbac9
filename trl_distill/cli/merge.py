"""`trl-distill merge --adapter DIR --output DIR [--base B] [--dtype bfloat16]`: see `trl_distill.model.merge`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import errors_as_messages


@dataclass
class MergeArguments:
    adapter: str = field(metadata={"help": "Directory with adapter_config.json and the adapter weights."})
    output: str = field(metadata={"help": "New or empty directory for the merged model and its tokenizer (or one an "
                                          "earlier merge wrote: its files are replaced)."})
    base: str | None = field(default=None, metadata={"help": "Base model path or hub id (default: the adapter's own)."})
    dtype: str = field(default="auto", metadata={
        "help": "dtype to load the base in before merging (default: as saved).",
        "choices": ["auto", "float32", "bfloat16", "float16"]})


def main(argv: list[str]) -> None:
    from transformers import HfArgumentParser

    from ..model.merge import merge_adapter

    parser = HfArgumentParser(MergeArguments, prog="trl-distill merge",
                              description="Fold a LoRA student's adapter into its base model.")
    with errors_as_messages("trl-distill merge"):
        (args,) = parser.parse_args_into_dataclasses(args=argv)
        path = merge_adapter(args.adapter, args.output, args.base, args.dtype)  # checks, merges, saves, checks
    print(f"Merged model saved to {path}")  # only once its config and weights are there (`merge._check_saved`)
