"""Reliability round five, `--teacher_prompt` and the self teacher through `trl-distill` as a user gets them wrong:
an empty teacher prompt (it trained with each student position paired with the teacher's next one), malformed
templates, nulls and values that are no prompt, and `self` without a LoRA student. Each case: exit code 2, the one
line (no traceback), before training, with the data files unchanged and no output directory."""

import json
from pathlib import Path

import pytest

from trl_distill.cli import main
from trl_distill.testing import synthetic_prompt_completion

FAST = ["--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--disable_tqdm", "true",
        "--save_strategy", "no", "--per_device_train_batch_size", "4", "--use_cpu", "true", "--max_steps", "1"]
GOLDEN = {"ok": lambda i: f"gold {i}", "empty": lambda i: "", "null": lambda i: None if i in (3, 5) else "gold",
          "one_null": lambda i: None if i == 6 else "gold", "number": lambda i: 7, "list": lambda i: ["a", "b"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A directory of 8-row prompt-completion files, one per kind of `golden` column (`GOLDEN`)."""
    directory = tmp_path_factory.mktemp("teacher_prompt_data")
    rows = synthetic_prompt_completion(8).to_list()
    for name, golden in GOLDEN.items():
        lines = [json.dumps({**row, "golden": golden(i)}) for i, row in enumerate(rows)]
        (directory / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (directory / "split").mkdir()  # train and test splits: the teacher prompts of the test split's row 6 are null
    (directory / "split" / "train.jsonl").write_bytes((directory / "ok.jsonl").read_bytes())
    (directory / "split" / "test.jsonl").write_bytes((directory / "one_null.jsonl").read_bytes())
    return directory


def refused(capsys, argv: list[str], data: Path, out: Path) -> str:
    """Run the CLI in-process: exit 2, one `trl-distill: error:` line and no traceback; the data files unchanged
    and no output directory. Returns the line's message."""
    before = {path: path.read_bytes() for path in data.rglob("*.jsonl")}
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("trl-distill")]
    assert stop.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert {path: path.read_bytes() for path in data.rglob("*.jsonl")} == before
    assert not out.exists()
    return errors[0].removeprefix("trl-distill: error: ")


def argv(tiny_pair, data: Path, out: Path, file: str, *flags: str) -> list[str]:
    name = data / (file if file == "split" else f"{file}.jsonl")
    return ["--model_name_or_path", tiny_pair["student"], "--dataset_name", str(name),
            "--output_dir", str(out), *FAST, *flags]


def teacher_prompt(tiny_pair, data, out, file, spec) -> list[str]:
    return argv(tiny_pair, data, out, file, "--teacher_model_name_or_path", tiny_pair["teacher"], "--teacher_prompt",
                spec)


def test_an_empty_teacher_prompt_is_refused_naming_the_column_and_row(tiny_pair, data, tmp_path, capsys):
    """It trained: the teacher prompt has no token, so the teacher's first completion position went missing and
    every student position was paired with the teacher's next (tests/teacher/test_teacher_prompt_boundaries.py
    checks the alignment by hand where a teacher prompt is one token, or BOS)."""
    out = tmp_path / "out"
    for spec, columns in (("golden", "the column"), ("{golden}", "the columns")):
        assert refused(capsys, teacher_prompt(tiny_pair, data, out, "empty", spec), data, out) == (
            f"--teacher_prompt {spec!r}: row 0 of the train dataset (and 7 more of its 8 rows) gives an empty teacher "
            "prompt, so the teacher has no token before the completion to predict its first token from: fill "
            f"{columns}, or drop those rows.")


BRACES = "write each field as {column} (e.g. {prompt}), and a literal brace as '{{' or '}}'."


@pytest.mark.parametrize("spec, message", [
    ("{prompt} answer: {golden", f"the template has a '{{' that is not closed: {BRACES}"),
    ("{prompt} answer: golden}", f"the template has a '}}' that no '{{' opens: {BRACES}"),
    ("{} {golden}", "the template has the positional field {}: name a column of the dataset in it (e.g. {prompt})."),
    ("{0} {golden}", "the template has the positional field {0}: name a column of the dataset in it (e.g. {prompt})."),
    ("{golden[0]}", "the template has the field {golden[0]}, which reads into a column: name the whole column (e.g. "
                    "{golden})."),
    ("{golden:{width}}", "the template has the field {golden:{width}}, with a field inside its format spec: write the "
                         "spec as text (e.g. {golden:>8})."),
    ("{golden!x}", "the template has the field {golden!x}, whose conversion !x is not Python's (!r, !s or !a): drop "
                   "it."),
], ids=["unclosed", "unopened", "positional", "numbered", "index", "nested-spec", "conversion"])
def test_a_malformed_template_is_one_line_before_anything_loads(tiny_pair, data, tmp_path, capsys, spec, message):
    out = tmp_path / "out"
    assert refused(capsys, teacher_prompt(tiny_pair, data, out, "ok", spec), data, out) == (
        f"--teacher_prompt {spec!r}: {message}")


@pytest.mark.parametrize("file, spec, message", [
    ("ok", "{prompt} {gold:>10}", " reads the column 'gold', which the train dataset does not have (prompt, "
                                  "completion, golden): add it, or read only the columns it has."),
    ("ok", "gold", " names a column the train dataset does not have (prompt, completion, golden): add it, or give a "
                   "template of its columns such as '{prompt} (answer: {answer})'."),
    ("ok", "{golden:d}", ": row 0 of the train dataset (and 7 more of its 8 rows) cannot fill the template (Unknown "
                         "format code 'd' for object of type 'str'): fix its format spec, or the column's values."),
    ("null", "golden", ": row 3 of the train dataset (and 1 more of its 8 rows) has a null in the column 'golden': "
                       "give every row its teacher prompt, or drop those rows."),
    ("one_null", "golden", ": row 6 of the train dataset has a null in the column 'golden': give every row its "
                           "teacher prompt, or drop those rows."),
    ("one_null", "{prompt} {golden}", ": row 6 of the train dataset has a null in the column 'golden', which the "
                                      "template reads: fill it, or drop those rows."),
    ("number", "golden", ": row 0 of the train dataset (and 7 more of its 8 rows) holds an int (7) in the column "
                         "'golden', and a teacher prompt is a string or a list of messages (dicts with 'role' and "
                         "'content'): convert the column, or read it in a template such as '{golden}'."),
    ("list", "golden", ": row 0 of the train dataset (and 7 more of its 8 rows) holds a list (['a', 'b']) in the "
                       "column 'golden', and a teacher prompt is a string or a list of messages (dicts with 'role' "
                       "and 'content'): convert the column, or read it in a template such as '{golden}'."),
    ("list", "{golden}", ": row 0 of the train dataset (and 7 more of its 8 rows) holds a list (['a', 'b']) in the "
                         "column 'golden', and a template fills in text: give a string or a number, or name a column "
                         "of messages as the whole --teacher_prompt."),
    ("split", "golden", ": row 6 of the eval dataset has a null in the column 'golden': give every row its teacher "
                        "prompt, or drop those rows."),
], ids=["template-missing-column", "missing-column", "bad-format-spec", "nulls", "one-null", "null-in-template",
        "number", "list", "list-in-template", "eval-split"])
def test_a_row_without_a_teacher_prompt_is_named(tiny_pair, data, tmp_path, capsys, file, spec, message):
    out = tmp_path / "out"
    flags = ["--eval_strategy", "steps", "--eval_steps", "1"] if file == "split" else []
    assert refused(capsys, teacher_prompt(tiny_pair, data, out, file, spec) + flags, data, out) == (
        f"--teacher_prompt {spec!r}{message}")


@pytest.mark.parametrize("flags, message", [
    (["--teachers", "a={teacher}", "keep=self"],
     "--teachers keep=self (self-distillation: the teacher is the student's own base with its LoRA adapters off) "
     "needs a LoRA student: add --use_peft."),
    (["--teacher_model_name_or_path", "self"],
     "--teacher_model_name_or_path self (self-distillation: the teacher is the student's own base with its LoRA "
     "adapters off) needs a LoRA student: add --use_peft."),
    (["--teacher_model_name_or_path", "self", "--use_peft", "--teacher_prompt", "golden"],
     "teacher_prompt gives the teacher its own prompt in place of each row's: it needs a live teacher (of the "
     "student's tokenizer or another) or a served one, not 'self' or a cache. Drop teacher_prompt, or name such a "
     "teacher."),
], ids=["keep=self", "self", "self-with-teacher-prompt"])
def test_the_self_teacher_names_the_flag_it_came_from(tiny_pair, data, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    flags = [flag.format(teacher=tiny_pair["teacher"]) for flag in flags]
    assert refused(capsys, argv(tiny_pair, data, out, "ok", *flags), data, out) == message


def test_caching_the_self_teacher_says_there_is_nothing_to_cache(tiny_pair, data, tmp_path, capsys):
    out = tmp_path / "cache"
    with pytest.raises(SystemExit) as stop:
        main(["cache-teacher", *argv(tiny_pair, data, tmp_path / "out", "ok", "--teacher_model_name_or_path", "self",
                                     "--use_peft", "--teacher_cache", str(out))])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trl-distill")]
    assert stop.value.code == 2 and errors == [
        "trl-distill cache-teacher: error: --teacher_model_name_or_path self is a LoRA student's own base, which runs "
        "inside training: there is no teacher to cache. Train with it (--use_peft), or cache the base model itself "
        "(pass its path as --teacher_model_name_or_path)."]
    assert not out.exists()
