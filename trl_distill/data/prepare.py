"""Datasets for the CLI: a hub id or a local file / directory, in one of the formats SFT reads."""

from __future__ import annotations

import json
import logging
import os

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

logger = logging.getLogger(__name__)

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
FORMATS = {
    "language modeling": ("text",),
    "prompt-completion": ("prompt", "completion"),
    "conversational": ("messages",),
}


def load_dataset_any(name: str, config: str | None = None) -> DatasetDict:
    """Load `name` as a `DatasetDict`: a local .jsonl/.json/.parquet/.csv/.arrow file (split "train"), a
    directory saved with `save_to_disk`, a directory of data files, or a hub id."""
    looks_local = os.path.sep in name or name.startswith(".") or os.path.splitext(name)[1] in _FILE_BUILDERS
    if os.path.isfile(name):
        builder = _FILE_BUILDERS.get(os.path.splitext(name)[1].lower())
        if builder is None:
            raise ValueError(f"Unsupported dataset file {name!r}: use one of {', '.join(_FILE_BUILDERS)}.")
        if os.path.getsize(name) == 0:
            raise ValueError(f"Dataset file {name!r} is empty (0 bytes).")
        try:
            return load_dataset(builder, data_files={"train": name})
        except Exception as error:  # datasets wraps a parser's error in its own DatasetGenerationError
            raise ValueError(_unreadable(name, builder, error)) from error
    if os.path.isdir(name):
        if os.path.exists(os.path.join(name, "dataset_dict.json")) or os.path.exists(
            os.path.join(name, "dataset_info.json")
        ):
            loaded = load_from_disk(name)
            return loaded if isinstance(loaded, DatasetDict) else DatasetDict({"train": loaded})
        return load_dataset(name, name=config)
    if looks_local:
        raise FileNotFoundError(f"Dataset path not found: {name!r}.")
    return load_dataset(name, name=config)


def _unreadable(name: str, builder: str, error: Exception) -> str:
    """One line for a data file its loader cannot read: for JSON Lines, the first line that does not parse."""
    if builder == "json" and name.endswith(".jsonl"):
        with open(name, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as bad:
                    return f"Dataset file {name!r}, line {number}: not valid JSON ({bad.msg}). Fix or remove that line."
    cause = error.__cause__ or error
    detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return f"Cannot read dataset file {name!r} as {builder}: {detail}"


def check_format(dataset: Dataset, split: str = "train") -> str:
    """The SFT format of `dataset` (see `FORMATS`), or one clear error naming the columns found and expected, or the
    first row that lacks its format's fields (rows of two formats mixed in one file) or holds a malformed
    conversation."""
    columns = set(dataset.column_names)
    for fmt, needed in FORMATS.items():
        if set(needed) <= columns:
            _check_rows(dataset, fmt, needed, split)
            return fmt
    expected = "; ".join(f"{fmt}: {', '.join(cols)}" for fmt, cols in FORMATS.items())
    raise ValueError(
        f"The {split!r} split has columns {sorted(columns)}, which match no supported format. Expected "
        f"{expected}. Rename the columns (or pass `--dataset_text_field` for a text column with another name)."
    )


def resolve_assistant_only_loss(setting: bool | None, dataset, tokenizer) -> bool:
    """`assistant_only_loss` when left unset (None): on for a conversational `messages` dataset whose chat template
    has `{% generation %}` markers or is one TRL can patch (`trl.chat_template_utils.get_training_chat_template`),
    so KD and CE run on assistant tokens like they run on completions; otherwise off, with a warning."""
    if setting is not None:
        return setting
    if dataset is None or isinstance(dataset, dict) or "messages" not in (dataset.column_names or []):
        return False
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return False
    if has_generation_markers(template):
        return True
    try:
        get_training_chat_template(tokenizer)
        return True
    except ValueError:
        logger.warning(
            "The dataset is conversational but its chat template has no `{% generation %}` markers and TRL cannot "
            "patch it, so KD and CE run on every token, the user's included. To train on assistant turns only, "
            "give the tokenizer a chat template with `{% generation %}...{% endgeneration %}` around assistant "
            "content, or use the prompt-completion format. Pass `--assistant_only_loss false` to silence this."
        )
        return False


def student_tokenizer(model, dataset):
    """The student's tokenizer, loaded only when a conversational dataset needs its chat template early."""
    if dataset is None or isinstance(dataset, dict) or "messages" not in (dataset.column_names or []):
        return None
    return tokenizer_of(model)


def tokenizer_of(model):
    """The tokenizer saved with `model` (a path, or a model loaded from one); None when it names no source."""
    from transformers import AutoTokenizer

    source = model if isinstance(model, str) else getattr(model.config, "_name_or_path", None)
    return AutoTokenizer.from_pretrained(source) if source else None


def _check_rows(dataset: Dataset, fmt: str, needed: tuple[str, ...], split: str) -> None:
    for column in needed:
        for row, value in enumerate(dataset[column]):
            if value is None:
                present = sorted(k for k, v in dataset[row].items() if v is not None)
                raise ValueError(f"Row {row} of the {split!r} split has no {column!r} (it has {present}): every row "
                                 f"must be in one format, here {fmt} ({', '.join(needed)}).")
            if column == "messages" and not (isinstance(value, list) and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)):
                raise ValueError(f"Row {row} of the {split!r} split: 'messages' must be a list of {{'role', "
                                 f"'content'}} turns, got {str(value)[:80]!r}.")


def log_skipped_rows(given, prepared, args) -> None:
    """Say how many training rows SFT's preparation dropped because they carry no loss token (a conversation with
    no assistant turn, a completion truncated away): a counted, logged skip rather than a silent one."""
    if args.packing or not hasattr(given, "__len__") or isinstance(given, dict) or not hasattr(prepared, "__len__"):
        return
    skipped = len(given) - len(prepared)
    if skipped > 0:
        logger.warning(f"{skipped} of {len(given)} training rows carry no loss token (no completion or assistant "
                       f"turn left within max_length={args.max_length}) and are skipped.")


def drop_unanswered_conversations(dataset, assistant_only_loss: bool):
    """A conversational dataset trained on assistant tokens, without the rows that have no assistant turn (they
    carry no loss token; TRL would stop on them): a counted, logged skip. Other datasets are returned as they are."""
    if (not assistant_only_loss or not hasattr(dataset, "filter") or isinstance(dataset, dict)
            or "messages" not in (dataset.column_names or [])):
        return dataset
    answered = dataset.filter(lambda row: any(m.get("role") == "assistant" for m in row["messages"] or []))
    if len(answered) < len(dataset):
        logger.warning(f"{len(dataset) - len(answered)} of {len(dataset)} training rows have no assistant turn (no "
                       "loss token) and are skipped.")
    return answered
