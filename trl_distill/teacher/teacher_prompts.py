"""`teacher_prompt`, read and checked: a column name, or a template of the row's columns (``{column}`` fields).

Its syntax is checked as the config is built (`template_fields`), each row's value on the raw datasets before
anything loads (`check_teacher_prompts`; a streamed dataset's rows as they are read, `privileged.StreamedPrompts`),
one line each naming ``--teacher_prompt``, the row and the fix: a column or field the dataset lacks, a null, a value
that is no prompt, a template a row cannot fill, and an empty teacher prompt (no token before the completion: the
teacher would have no position to predict its first token from, and every position would pair with the student's
next one).
"""

from __future__ import annotations

from string import Formatter

FLAG = "--teacher_prompt"
_BRACES = {"expected '}' before end of string": "a '{' that is not closed",
           "Single '{' encountered in format string": "a '{' that is not closed",
           "Single '}' encountered in format string": "a '}' that no '{' opens"}


def template_fields(spec: str) -> list[str] | None:
    """The columns template `spec` reads, in order, or None when `spec` is a column name (no braces); a malformed
    template is one `ValueError`."""
    if not isinstance(spec, str):
        raise TypeError(f"{FLAG} is a column name or a template of the row's columns, got {type(spec).__name__}.")
    if not spec.strip():
        raise ValueError(f"{FLAG} {spec!r} names no column: give a column of the dataset (e.g. golden_prompt) or a "
                         "template of its columns (e.g. '{prompt} (answer: {answer})').")
    if "{" not in spec and "}" not in spec:
        return None
    try:
        parsed = list(Formatter().parse(spec))
    except ValueError as error:
        raise ValueError(f"{FLAG} {spec!r}: the template has {_BRACES.get(str(error), error)}: write each field as "
                         "{column} (e.g. {prompt}), and a literal brace as '{{' or '}}'.") from None
    fields = []
    for _, name, format_spec, conversion in parsed:
        if name is None:
            continue
        field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{format_spec}" if format_spec else "") + "}"
        column = name.split(".")[0].split("[")[0] or "prompt"
        if name == "" or name.isdigit():
            why = f"the positional field {field}: name a column of the dataset in it (e.g. {{prompt}})"
        elif column != name:
            why = f"the field {field}, which reads into a column: name the whole column (e.g. {{{column}}})"
        elif "{" in (format_spec or ""):
            why = f"the field {field}, with a field inside its format spec: write the spec as text (e.g. {{{name}:>8}})"
        elif conversion not in (None, "r", "s", "a"):
            why = f"the field {field}, whose conversion !{conversion} is not Python's (!r, !s or !a): drop it"
        else:
            fields.append(name)
            continue
        raise ValueError(f"{FLAG} {spec!r}: the template has {why}.")
    return fields


def check_teacher_prompts(spec: str, dataset, split: str, tokens) -> None:
    """Every row of `dataset` (the `split` named in the message, raw: before SFT's preparation, so its row numbers
    are the user's) has a teacher prompt: the column or the template's fields present, no null, a string or a list
    of messages (a template: scalars), a template that fills, and at least one token (`tokens` tokenizes one prompt
    as the teacher will read it)."""
    if dataset is None or not hasattr(dataset, "__len__") or not getattr(dataset, "column_names", None):
        return  # an IterableDataset: its rows are not read ahead
    fields = template_fields(spec)
    columns = list(dataset.column_names)
    wanted = [spec] if fields is None else list(dict.fromkeys(fields))
    missing = [name for name in wanted if name not in columns]
    if missing and fields is None:
        raise ValueError(f"{FLAG} {spec!r} names a column the {split} dataset does not have ({', '.join(columns)}): "
                         "add it, or give a template of its columns such as '{prompt} (answer: {answer})'.")
    if missing:
        raise ValueError(f"{FLAG} {spec!r} reads {_names(missing)}, which the {split} dataset does not have "
                         f"({', '.join(columns)}): add {'it' if len(missing) == 1 else 'them'}, or read only the "
                         "columns it has.")
    values = [dataset[name] for name in wanted]
    empty_has_tokens = bool(tokens(""))
    bad = []  # (row, why) of each row without a usable teacher prompt
    for index, row in enumerate(zip(*values, strict=True)):
        why = prompt_problem(spec, fields, dict(zip(wanted, row, strict=True)), empty_has_tokens)
        if why is not None:
            bad.append((index, why))
    if bad:
        index, why = bad[0]
        more = f" (and {len(bad) - 1} more of its {len(dataset)} rows)" if len(bad) > 1 else ""
        raise ValueError(f"{FLAG} {spec!r}: row {index} of the {split} dataset{more} {why}.")


def prompt_problem(spec: str, fields: list[str] | None, row: dict, empty_has_tokens: bool) -> str | None:
    """What keeps `row` (its values of the columns `spec` reads; `fields`: `template_fields(spec)`) from a teacher
    prompt, as the end of a sentence naming the fix; None when nothing does."""
    if fields is None:
        value = row[spec]
        if value is None:
            return f"has a null in the column {spec!r}: give every row its teacher prompt, or drop those rows"
        if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
            return None
        if not isinstance(value, str):
            return (f"holds {_kind(value)} in the column {spec!r}, and a teacher prompt is a string or a list of "
                    "messages (dicts with 'role' and 'content'): convert the column, or read it in a template such "
                    f"as '{{{spec}}}'")
        text = value
    else:
        for name in fields:
            value = row[name]
            if value is None or value != value:  # (NaN: a missing number)
                return f"has a null in the column {name!r}, which the template reads: fill it, or drop those rows"
            if isinstance(value, list | dict):
                return (f"holds {_kind(value)} in the column {name!r}, and a template fills in text: give a string "
                        f"or a number, or name a column of messages as the whole {FLAG}")
        try:
            text = spec.format(**template_values(row))
        except (ValueError, TypeError) as error:
            return f"cannot fill the template ({error}): fix its format spec, or the column's values"
    if not text and not empty_has_tokens:
        return ("gives an empty teacher prompt, so the teacher has no token before the completion to predict its "
                f"first token from: fill the column{'' if fields is None else 's'}, or drop those rows")
    return None


def template_values(row: dict) -> dict:
    """A row's values as a template writes them: a whole number read as a float (a JSON or CSV column of numbers that
    also holds a fraction is all floats: ``3`` is loaded as 3.0) as the integer, as the dataset's file wrote it."""
    return {name: int(value) if isinstance(value, float) and value.is_integer() else value
            for name, value in row.items()}


def _kind(value) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    article = "an" if type(value).__name__[0] in "aeiou" else "a"
    return f"{article} {type(value).__name__} ({shown})" if not isinstance(value, list) or value else "an empty list"


def _names(names: list[str]) -> str:
    return (f"the column {names[0]!r}" if len(names) == 1 else
            "the columns " + ", ".join(map(repr, names)))


def splits(train_dataset, eval_dataset):
    """``(name, dataset)`` of the train dataset and each eval one, as the messages name them."""
    if not isinstance(train_dataset, dict):  # (a dict of train datasets is the panel's: refused with one teacher)
        yield "train", train_dataset
    named = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
    for key, dataset in named.items():
        yield ("eval" if key is None else f"eval {key!r}"), dataset
