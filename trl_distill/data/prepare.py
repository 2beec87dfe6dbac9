"""Datasets for the CLI: a hub id or a local file / directory, in one of the formats SFT reads."""

from __future__ import annotations

import json
import logging
import os
import re
from typing import TYPE_CHECKING

from ..runtime.hub import require_hub
from ..runtime.quiet import PROMPT_NOT_A_PREFIX

if TYPE_CHECKING:  # datasets is imported where it is used: `import trl_distill` stays as cheap as TRL's own
    from datasets import Dataset, DatasetDict

logger = logging.getLogger(__name__)

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
# Endings that make a missing name a data file, not a hub id
_DATA_EXTENSIONS = {*_FILE_BUILDERS, ".txt", ".tsv", ".ndjson", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".xlsx"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # `name` or `owner/name`
_SAVED = ("dataset_dict.json", "dataset_info.json", "state.json")  # what `save_to_disk` writes
FORMATS = {
    "language modeling": ("text",),
    "prompt-completion": ("prompt", "completion"),
    "conversational": ("messages",),
}


def load_dataset_any(name: str, config: str | None = None, what: str = "--dataset_name") -> DatasetDict:
    """Load `name` as a `DatasetDict`: a local .jsonl/.json/.parquet/.csv/.arrow file (split "train"), a
    directory saved with `save_to_disk`, a directory of data files, or a hub id (``owner/name`` or ``name``, not an
    existing path: loaded from the hub, after `hub.require_hub` made sure the hub answers). `what` names the
    argument in messages."""
    from datasets import load_dataset

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
        if any(os.path.exists(os.path.join(name, saved)) for saved in _SAVED):
            return _load_saved(name)
        from datasets.exceptions import DatasetGenerationError

        try:
            return load_dataset(name, name=config)
        except DatasetGenerationError as error:  # e.g. its files' columns differ: datasets' traceback names none
            raise ValueError(_unloadable_directory(name, error, what)) from error
    if not looks_like_hub_id(name):
        raise FileNotFoundError(f"Dataset path not found: {name!r}.")
    require_hub(name, what, "file or directory")
    return load_dataset(name, name=config)


def named_datasets(name: str) -> dict[str, list[str]] | None:
    """``--dataset_name math=PATH,code=PATH`` (several teachers, routed): ``{teacher name: [datasets]}``, a name given
    twice keeping both of its datasets in order (``a=one.jsonl,a=two.jsonl``: all of both, for teacher a); None for
    one dataset, including an existing path whose name holds ``=`` or ``,``."""
    from ..teacher.specs import TEACHER_NAME  # here: the teacher package imports this module

    if os.path.exists(name):
        return None
    parts = [part.partition("=") for part in name.split(",")]
    if not all(sep and key.strip() and value.strip() for key, sep, value in parts):
        return None
    named: dict[str, list[str]] = {}
    for key, _, value in parts:
        if not TEACHER_NAME.fullmatch(key.strip()):  # `/d/eq=dir.jsonl`: a path, not a teacher's name
            return None
        named.setdefault(key.strip(), []).append(value.strip())
    return named


def looks_like_hub_id(name: str) -> bool:
    """Whether a name that is no existing path means a hub dataset: ``owner/name`` or ``name`` (letters, digits,
    ``-_.``), not ending like a data file (``data/train.jsonl`` is a missing file)."""
    return bool(_HUB_ID.fullmatch(name)) and os.path.splitext(name)[1].lower() not in _DATA_EXTENSIONS


def _load_saved(directory: str) -> DatasetDict:
    """A directory written by `save_to_disk`; one that cannot be read back (an arrow file cut short, a damaged
    state.json) is one line naming it."""
    from datasets import DatasetDict, load_from_disk

    try:
        loaded = load_from_disk(directory)
    except Exception as error:  # pyarrow's, json's or datasets' own error: none names the directory
        cause = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
        raise ValueError(f"Cannot read the dataset saved at {directory!r} (with `save_to_disk`): {cause}. Its files "
                         "are damaged or incomplete (a copy cut short?): save or copy it again.") from error
    return loaded if isinstance(loaded, DatasetDict) else DatasetDict({"train": loaded})


def _unloadable_directory(name: str, error: Exception, what: str) -> str:
    """One line for a directory of data files `datasets` cannot load: for files of different columns (a
    conversational eval file beside a prompt-completion train file), each file's columns."""
    cause = error.__cause__ or error.__context__ or error
    text = str(cause).strip()
    if "column names don't match" in text:
        columns = _file_columns(name)
        if len(set(columns.values())) > 1:
            listed = "; ".join(f"{os.path.relpath(path, name)}: {', '.join(names)}" for path, names in columns.items())
            return (f"The data files of {what} {name} have different columns ({listed}), and datasets loads a "
                    "directory's files with one set of columns: write every file in one format (prompt-completion: "
                    "prompt, completion; conversational: messages), the same columns in each.")
    detail = text.splitlines()[-1] if text else type(cause).__name__
    return f"Cannot load the data files of {what} {name}: {detail}"


def _file_columns(directory: str) -> dict[str, tuple[str, ...]]:
    """The columns of each JSON Lines, Parquet or CSV data file of `directory` (as `datasets` finds its splits' files),
    from its first row or its schema; a file read otherwise is left out."""
    try:
        from datasets.data_files import DataFilesDict, get_data_patterns

        files = [str(f) for split in DataFilesDict.from_patterns(get_data_patterns(directory),
                                                                   base_path=directory).values() for f in split]
    except Exception:  # noqa: BLE001 - a layout datasets does not infer: no columns to list
        return {}
    columns = {}
    for path in files:
        try:
            if path.endswith(".jsonl"):
                with open(path, encoding="utf-8") as f:
                    first = next((line for line in f if line.strip()), "{}")
                columns[path] = tuple(sorted(json.loads(first)))
            elif path.endswith(".parquet"):
                import pyarrow.parquet as pq

                columns[path] = tuple(sorted(pq.read_schema(path).names))
            elif path.endswith(".csv"):
                import csv

                with open(path, encoding="utf-8", newline="") as f:
                    columns[path] = tuple(sorted(next(csv.reader(f), [])))
        except (OSError, ValueError, TypeError, StopIteration):
            continue
    return columns


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


def dataset_format(dataset) -> str | None:
    """The SFT format (a key of `FORMATS`) whose columns `dataset` holds, without checking its rows; None for none."""
    columns = set(dataset.column_names)
    return next((fmt for fmt, needed in FORMATS.items() if set(needed) <= columns), None)


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
    """Every row has its format's fields, and each holds text: a string, or (messages, and a conversational
    prompt / completion) a list of turns whose content is text."""
    for column in needed:
        for row, value in enumerate(dataset[column]):
            if value is None:
                present = sorted(k for k, v in dataset[row].items() if v is not None)
                raise ValueError(f"Row {row} of the {split!r} split has no {column!r} (it has {present}): every row "
                                 f"must be in one format, here {fmt} ({', '.join(needed)}).")
            if column == "messages" or (column in ("prompt", "completion") and isinstance(value, list)):
                _check_turns(value, row, column, split)
            elif not isinstance(value, str):
                raise ValueError(f"Row {row} of the {split!r} split: {column!r} must be a string, got "
                                 f"{type(value).__name__} {_short(value)}. {_AS_TEXT}")


_AS_TEXT = ("Store every text field as a string (a CSV column of numbers is read as numbers: write the data as JSON "
            "Lines with quoted strings).")


def _check_turns(value, row: int, column: str, split: str) -> None:
    if not (isinstance(value, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)):
        raise ValueError(f"Row {row} of the {split!r} split: {column!r} must be a list of {{'role', "
                         f"'content'}} turns, got {str(value)[:80]!r}.")
    for turn, message in enumerate(value):
        content = message["content"]  # text, a list of parts (multimodal), or None (a turn of tool calls)
        if content is not None and not isinstance(content, str | list):
            raise ValueError(f"Row {row} of the {split!r} split: {column!r} turn {turn} ({message['role']}) has "
                             f"content {type(content).__name__} {_short(content)}, not a string. {_AS_TEXT}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_eos_token(tokenizer, dataset, eos_token: str | None = None, source: str | None = None) -> None:
    """SFT appends the tokenizer's EOS to every text and completion of a non-conversational dataset (and pads with
    it when there is no pad token): a tokenizer without one is one clear error before that (else ``endswith first
    arg must be str`` from inside SFT's preparation). `eos_token` is SFT's `eos_token` argument (it sets one);
    `source` names the tokenizer (default: its `name_or_path`)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    if tokenizer is None or eos_token is not None or getattr(tokenizer, "eos_token", None) is not None:
        return
    columns = getattr(dataset, "column_names", None)
    if isinstance(dataset, dict) or not columns or "input_ids" in columns:  # none, or tokenized: SFT adds no EOS
        return
    from trl.data_utils import is_conversational

    first = next(iter(dataset), None)
    if first is None or is_conversational(first):
        return
    name = source or getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    raise ValueError(f"The tokenizer of {name!r} has no eos_token, and SFT ends every text and completion with it: "
                     "set one (`tokenizer.eos_token = ...`, saved with the model) or pass --eos_token TOKEN (a token "
                     "of its vocabulary).")


def check_eos_before_loading(model: str | None, dataset_name: str | None, dataset_config: str | None, split: str,
                             eos_token: str | None) -> None:
    """The command line's `check_eos_token`, before any model is loaded: the tokenizer of a local `model` directory
    (a hub id is not checked here) against the training split (read only when the tokenizer has no EOS)."""
    if eos_token is not None or not model or not dataset_name or not os.path.isdir(model):
        return
    try:
        tokenizer = tokenizer_of(model)
    except (OSError, ValueError):  # no tokenizer saved there: the model's own loading says so
        return
    if tokenizer is None or tokenizer.eos_token is not None:
        return
    check_eos_token(tokenizer, load_dataset_any(dataset_name, dataset_config).get(split), source=model)


def log_skipped_rows(given, prepared, packing: bool, max_length: int | None) -> None:
    """Say how many training rows SFT's preparation dropped because they carry no loss token (a conversation with
    no assistant turn, a completion truncated away): a counted, logged skip rather than a silent one."""
    log_repeated_prompt_warning()
    if packing or not hasattr(given, "__len__") or isinstance(given, dict) or not hasattr(prepared, "__len__"):
        return
    skipped = len(given) - len(prepared)
    if skipped > 0:
        logger.warning(f"{skipped} of {len(given)} training rows carry no loss token (no completion or assistant "
                       f"turn left within max_length={max_length}) and are skipped.")


def log_repeated_prompt_warning() -> None:
    """TRL warns "the tokenized prompt is not a prefix of the tokenized prompt+completion" once per distinct prompt
    ending; `quiet` lets the first through and counts the rest: say here, once the data is prepared, how many."""
    count = PROMPT_NOT_A_PREFIX.take()
    if count > 1:
        logger.warning(f"TRL's warning above (the tokenized prompt is not a prefix of the tokenized prompt+completion) "
                       f"applies to at least {count} rows (rows with the same prompt ending count once), shown once. "
                       "End the prompts on a token boundary (e.g. after a space or punctuation) to train on the "
                       "context the model sees at inference.")


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
