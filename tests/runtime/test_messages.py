"""Messages that name the thing and the fix (issue 33), through `trl-distill`: damaged files (a saved dataset, a
cache manifest, a recipe, a checkpoint), data and flags out of range, a tokenizer without EOS, a hub that does not
answer, the planner's numbers, and TRL's repeated warning. Each bad input is one line on stderr
(``trl-distill: error: ...``), exit code 2, no traceback, nothing written to output_dir."""

import json
import logging
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill.cache.manifest import Manifest
from trl_distill.cli import main
from trl_distill.data import prepare
from trl_distill.runtime import hub
from trl_distill.runtime.distributed import free_port
from trl_distill.testing import build_tiny_model, build_tokenizer, synthetic_prompt_completion

FAST = ["--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--logging_steps", "1",
        "--disable_tqdm", "true", "--save_strategy", "no"]
UNREACHABLE = "is not a local {kind} and the Hugging Face Hub is unreachable (http://127.0.0.1:{port}: "
FIX = "): pass a local path, or set HF_HUB_OFFLINE=1 to use the local cache."


def cli_args(tiny_pair, dataset, output_dir, *extra, student=None, teacher=None):
    return ["--model_name_or_path", str(student or tiny_pair["student"]), "--teacher_model_name_or_path",
            str(teacher or tiny_pair["teacher"]), "--dataset_name", str(dataset), "--output_dir", str(output_dir),
            "--max_steps", "1", *FAST, *extra]


def one_line(capsys, argv, prog="trl-distill") -> str:
    """Run the CLI in-process: exit 2, exactly one `PROG: error:` line on stderr, no traceback; that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
    assert exit_info.value.code == 2 and len(errors) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "pc.jsonl"
    synthetic_prompt_completion(16).to_json(str(path))
    return path


@pytest.fixture
def out(tmp_path) -> Path:
    """An output_dir holding a student already: a refused run must leave it as it is."""
    directory = tmp_path / "out"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"the student already there")
    return directory


def untouched(directory: Path) -> bool:
    return ([p.name for p in directory.iterdir()] == ["model.safetensors"]
            and (directory / "model.safetensors").read_bytes() == b"the student already there")


# ---- 1. A damaged `save_to_disk` dataset ----

@pytest.mark.parametrize("damage", ["arrow cut short", "state.json cut short", "split of a DatasetDict cut short"])
def test_a_damaged_saved_dataset_names_its_directory(tiny_pair, tmp_path, out, capsys, damage):
    saved = tmp_path / "saved"
    rows = synthetic_prompt_completion(64)
    if damage.startswith("split"):
        DatasetDict({"train": rows}).save_to_disk(str(saved))
    else:
        rows.save_to_disk(str(saved))
    if damage == "state.json cut short":
        state = saved / "state.json"
        state.write_text(state.read_text()[:25])
    else:
        arrow = next(saved.rglob("*.arrow"))
        arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    line = one_line(capsys, cli_args(tiny_pair, saved, out))
    assert f"trl-distill: error: Cannot read the dataset saved at '{saved}' (with `save_to_disk`): " in line
    assert line.endswith("Its files are damaged or incomplete (a copy cut short?): save or copy it again.")
    assert untouched(out)


# ---- 2. A damaged teacher-cache manifest ----

def _manifest(directory: Path) -> Path:
    Manifest(teacher="t", teacher_revision=None, tokenizer_hash="h", vocab_size=256, top_k=4, temperature=1.0,
             max_length=1024, log_prob_dtype="7bit", dataset_fingerprint="f", num_rows=16, shard_rows=8).save(
        str(directory))
    return directory / "manifest.json"


@pytest.mark.parametrize("damage, message", [
    ("cut short", "is damaged: not valid JSON (Expecting"),
    ("a list", "is damaged: it holds list, not a manifest."),
    ("no top_k", "is damaged: no top_k."),
])
def test_a_damaged_cache_manifest_names_it_and_the_fix(tiny_pair, data, tmp_path, out, capsys, damage, message):
    cache = tmp_path / "cache"
    cache.mkdir()
    manifest = _manifest(cache)
    text = manifest.read_text()
    if damage == "cut short":
        manifest.write_text(text[: len(text) // 2])
    elif damage == "a list":
        manifest.write_text("[1, 2]\n")
    else:
        values = json.loads(text)
        del values["top_k"]
        manifest.write_text(json.dumps(values))
    argv = ["--model_name_or_path", tiny_pair["student"], "--teacher_cache", str(cache), "--dataset_name", str(data),
            "--output_dir", str(out), "--max_steps", "1", *FAST]
    line = one_line(capsys, argv)
    assert line.startswith(f"trl-distill: error: {manifest} {message}")
    assert line.endswith(f"Delete {cache} (or pass another --teacher_cache directory) and run `trl-distill "
                         "cache-teacher` again to rewrite the cache.")
    assert untouched(out)


# ---- 3. A tokenizer without eos_token ----

def _without_eos(source: str, directory: Path) -> Path:
    shutil.copytree(source, directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(directory)
    assert AutoTokenizer.from_pretrained(directory).eos_token is None
    return directory


def test_a_tokenizer_without_eos_token_names_it_and_the_flag(tiny_pair, data, tmp_path, out, capsys):
    student = _without_eos(tiny_pair["student"], tmp_path / "student")
    line = one_line(capsys, cli_args(tiny_pair, data, out, student=student))
    assert line == (f"trl-distill: error: The tokenizer of '{student}' has no eos_token, and SFT ends every text and "
                    "completion with it: set one (`tokenizer.eos_token = ...`, saved with the model) or pass "
                    "--eos_token TOKEN (a token of its vocabulary).")
    assert untouched(out)
    # --eos_token gives one; a conversational dataset needs none (the chat template ends the turns)
    prepare.check_eos_before_loading(str(student), str(data), None, "train", "</s>")
    chat = Dataset.from_list([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}])
    prepare.check_eos_token(AutoTokenizer.from_pretrained(student), chat)
    with pytest.raises(ValueError, match="has no eos_token"):
        prepare.check_eos_token(AutoTokenizer.from_pretrained(student), synthetic_prompt_completion(2))


# ---- 4. A recipe that is not valid YAML ----

@pytest.mark.parametrize("subcommand", ["", "cache-teacher"])
def test_a_recipe_with_a_yaml_syntax_error_names_the_file_and_line(tiny_pair, data, tmp_path, out, capsys,
                                                                   subcommand):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 1.0e-5\nlr_scheduler_type: [cosine\nwarmup_ratio: 0.1\n")
    prog = f"trl-distill {subcommand}".strip()
    argv = [*([subcommand] if subcommand else []), "--config", str(recipe), *cli_args(tiny_pair, data, out)]
    line = one_line(capsys, argv, prog)
    assert line == (f"{prog}: error: {recipe}: line 3, column 13: expected ',' or ']', but got ':' (while parsing a "
                    "flow sequence from line 2). The recipe (--config) is not valid YAML.")
    assert untouched(out)
    assert one_line(capsys, [*cli_args(tiny_pair, data, out), "--config"]).endswith(
        "--config needs the path of a YAML recipe.")


# ---- 5. Text fields that are not strings ----

@pytest.mark.parametrize("name, content, message", [
    ("numbers.csv", "prompt,completion\nreverse: cat dog =>,1\nreverse: red blue =>,2\n",
     "Row 0 of the 'train' split: 'completion' must be a string, got int 1. Store every text field as a string"),
    ("text.jsonl", '{"text": "a b"}\n{"text": 5}\n', "Row 1 of the 'train' split: 'text' must be a string, got int 5."),
    ("turns.jsonl", '{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}\n',
     "Row 0 of the 'train' split: 'messages' turn 0 (user) has content int 3, not a string."),
])
def test_text_fields_that_are_not_strings_name_the_column_and_row(tiny_pair, tmp_path, out, capsys, name, content,
                                                                  message):
    path = tmp_path / name
    path.write_text(content)
    assert message in one_line(capsys, cli_args(tiny_pair, path, out))
    assert untouched(out)


# ---- 6. Integer knobs that a 0 breaks later ----

@pytest.mark.parametrize("flags, message", [
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be >= 1, got 0."),
    (["--per_device_eval_batch_size", "0"], "per_device_eval_batch_size must be >= 1, got 0."),
    (["--max_length", "0"], "max_length must be a positive integer or None (no truncation), got 0."),
    (["--save_strategy", "steps", "--save_steps", "0"], "save_steps must be > 0 with save_strategy 'steps', got 0"),
    (["--max_steps", "-1", "--num_train_epochs", "0"], "num_train_epochs=0.0 trains nothing"),
    (["--dataloader_num_workers", "-1"], "dataloader_num_workers must be >= 0, got -1."),
    (["--generation_top_k", "-1"], "generation_top_k must be >= 0 (0: off), got -1."),
    (["--logging_steps", "0"], "requires non-zero --logging_steps"),  # transformers' own message
])
def test_integer_flags_out_of_range(tiny_pair, data, out, capsys, flags, message):
    assert message in one_line(capsys, cli_args(tiny_pair, data, out, *flags))
    assert untouched(out)


# ---- 7. Checkpoint files that do not match their config ----

def _bin_teacher(tiny_pair, directory: Path) -> Path:
    """The teacher saved as pytorch_model.bin (a torch.save zip archive) instead of safetensors."""
    shutil.copytree(tiny_pair["teacher"], directory, ignore=shutil.ignore_patterns("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"])
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return directory / "pytorch_model.bin"


def _set_vocab(directory: Path, vocab: int) -> Path:
    config = directory / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "vocab_size": vocab}))
    return config


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_a_config_whose_vocab_size_differs_from_its_weights(tiny_pair, data, tmp_path, out, capsys, weights):
    teacher = tmp_path / "teacher"
    if weights == "pytorch_model.bin":
        _bin_teacher(tiny_pair, teacher)
    else:
        shutil.copytree(tiny_pair["teacher"], teacher)
    rows = json.loads((teacher / "config.json").read_text())["vocab_size"]
    config = _set_vocab(teacher, rows + 8)
    line = one_line(capsys, cli_args(tiny_pair, data, out, teacher=teacher))
    assert line.startswith(f"trl-distill: error: --teacher_model_name_or_path: {config} says vocab_size={rows + 8}, "
                           f"but {teacher / weights} holds ")
    assert line.endswith(f" with {rows} rows: the config does not belong to these weights. Set vocab_size to {rows} "
                         "in config.json, or re-save the model with `save_pretrained`.")
    assert untouched(out)


def test_a_truncated_pytorch_model_bin(tiny_pair, data, tmp_path, out, capsys):
    weights = _bin_teacher(tiny_pair, tmp_path / "teacher")
    weights.write_bytes(weights.read_bytes()[:-1000])  # a download cut short
    line = one_line(capsys, cli_args(tiny_pair, data, out, teacher=weights.parent))
    assert line.startswith(f"trl-distill: error: --teacher_model_name_or_path: {weights} is truncated (")
    assert line.endswith("not a complete zip archive as `torch.save` writes). Re-save or re-download the model.")
    assert untouched(out)


def test_an_intact_pytorch_model_bin_passes_the_checks(tiny_pair, tmp_path):
    from trl_distill.runtime.validation import check_model_path

    check_model_path(str(_bin_teacher(tiny_pair, tmp_path / "teacher").parent), "teacher_model")


# ---- 8. The hub, unreachable ----

@pytest.fixture
def closed_hub(monkeypatch) -> int:
    """HF_ENDPOINT at a closed local port, the offline switches unset: a hub that is not there."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    port = free_port()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    return port


@pytest.mark.parametrize("role", ["student", "teacher", "dataset"])
def test_a_hub_id_without_a_hub_fails_in_seconds(tiny_pair, data, out, capsys, closed_hub, role):
    name = "trl-lib/Capybara" if role == "dataset" else f"some-org/tiny-{role}"
    argv = cli_args(tiny_pair, name if role == "dataset" else data, out, **({role: name} if role != "dataset" else {}))
    flag = {"student": "--model_name_or_path", "teacher": "--teacher_model_name_or_path", "dataset": "--dataset_name"}
    kind = "file or directory" if role == "dataset" else "directory"
    start = time.monotonic()
    line = one_line(capsys, argv)
    assert time.monotonic() - start < 10
    assert line.startswith(f"trl-distill: error: {flag[role]}: '{name}' "
                           + UNREACHABLE.format(kind=kind, port=closed_hub))
    assert line.endswith(FIX)
    assert untouched(out)


def test_a_hub_that_accepts_and_never_answers_is_unreachable_after_the_probe(tiny_pair, data, out, capsys,
                                                                              monkeypatch, closed_hub):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the kernel's backlog; nothing ever reads or answers them
    port = silent.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(hub, "PROBE_TIMEOUT", 1.0)
    try:
        start = time.monotonic()
        line = one_line(capsys, cli_args(tiny_pair, data, out, student="some-org/tiny-student"))
        assert 1.0 <= time.monotonic() - start < 6
    finally:
        silent.close()
    assert UNREACHABLE.format(kind="directory", port=port) in line and line.endswith(FIX)
    assert "timed out" in line or "no answer within 1 s" in line


class _Hub(BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 - http.server's name
        self.send_response(404)  # any answer: the hub is there
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_reachable_hub_or_offline_mode_goes_on_to_the_hub_loader(monkeypatch, closed_hub):
    loaded = []
    monkeypatch.setattr("datasets.load_dataset", lambda path, name=None: loaded.append(path) or {"train": []})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the local cache only: no probe, even with no hub
    prepare.load_dataset_any("trl-lib/Capybara")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    server = HTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        prepare.load_dataset_any("trl-lib/Capybara")
        hub.require_hub("some-org/model", "--model_name_or_path")
    finally:
        server.shutdown()
    assert loaded == ["trl-lib/Capybara", "trl-lib/Capybara"]
    for missing in ("./no/such/dir", "data/train.jsonl", "/abs/missing"):
        with pytest.raises(FileNotFoundError, match="Dataset path not found"):
            prepare.load_dataset_any(missing)


# ---- 9. The planner's numbers ----

@pytest.mark.parametrize("flags, message", [
    (["--gpu_memory_gb", "inf"], "--gpu_memory_gb must be a finite number, got inf."),
    (["--gpu_memory_gb", "nan"], "--gpu_memory_gb must be a finite number, got nan."),
    (["--gpu_memory_gb", "1e300"], "--gpu_memory_gb must be at most 1e+15 (past it the estimate is meaningless), got "
                                   "1e+300."),
    (["--seq_len", "9" * 400], "--seq_len must be at most 1e+15 (past it the estimate is meaningless), got a longer "
                               "number."),
    (["--student", "1e400"], "--student: '1e400' is more parameters than this planner plans (at most 1e+15)."),
    (["--teacher", "2e15"], "--teacher: '2e15' is more parameters than this planner plans (at most 1e+15)."),
    (["--student", "0"], "--student: '0' is 0 parameters: a model to plan needs at least one."),
    (["--student", "0.0001"], "--student: '0.0001' is 0 parameters: a model to plan needs at least one."),
])
def test_plan_numbers_out_of_range(capsys, flags, message):
    argv = ["plan", "--student", "1B", "--teacher", "8B", *flags]
    assert one_line(capsys, argv, "trl-distill plan") == f"trl-distill plan: error: {message}"


# ---- 10. TRL's "shown once" warning, once ----

def _ends_mid_word() -> Dataset:
    words = "teacher student knowledge distills memory gather shard learns stage large".split()
    return Dataset.from_list([{"prompt": f"reverse: the {word[:cut]}", "completion": f"{word[cut:]} the"}
                              for word in words for cut in range(1, len(word))])


@pytest.fixture(scope="module")
def merging_pair(tmp_path_factory) -> dict[str, str]:
    """A student and a teacher whose tokenizer merges whole words (the tiny pair's has byte tokens only)."""
    directory = tmp_path_factory.mktemp("merging_pair")
    tokenizer = build_tokenizer(vocab_size=640)
    paths = {size: str(directory / size) for size in ("teacher", "student")}
    for seed, (size, path) in enumerate(paths.items()):
        build_tiny_model(tokenizer, size, seed=seed).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths


def test_the_prompt_prefix_warning_is_shown_once_with_a_count(merging_pair, tmp_path, caplog):
    rows = _ends_mid_word()
    path = tmp_path / "mid_word.jsonl"
    rows.to_json(str(path))
    tokenizer = AutoTokenizer.from_pretrained(merging_pair["student"])
    endings = set()  # what TRL's warning quotes, one warning per distinct ending
    for row in rows:
        prompt, whole = tokenizer(row["prompt"])["input_ids"], tokenizer(row["prompt"] + row["completion"])["input_ids"]
        common = next((i for i, (a, b) in enumerate(zip(prompt, whole)) if a != b), min(len(prompt), len(whole)))
        if common < len(prompt):
            endings.add(tokenizer.decode(prompt[common:]))
    assert len(endings) > 10  # the data does what the test needs: many distinct warnings without the filter
    with caplog.at_level(logging.WARNING):
        main(cli_args(merging_pair, path, tmp_path / "out", "--use_cpu"))
    shown = [r for r in caplog.records if "This warning is shown once" in r.getMessage()]
    assert len(shown) == 1
    summary = [r.getMessage() for r in caplog.records if "applies to at least" in r.getMessage()]
    assert summary == [f"TRL's warning above (the tokenized prompt is not a prefix of the tokenized "
                       f"prompt+completion) applies to at least {len(endings)} rows (rows with the same prompt ending "
                       "count once), shown once. End the prompts on a token boundary (e.g. after a space or "
                       "punctuation) to train on the context the model sees at inference."]


WRITER = """import sys
from trl_distill.errors import stderr_line
if sys.argv[2] == "print":
    def stderr_line(text):
        print(text, file=sys.stderr, flush=True)
for _ in range(3000):
    stderr_line("trl-distill: error: " + sys.argv[1] * 600)
"""


def _interleaved_lines(how: str) -> int:
    """Two processes writing 3000 long lines each to one pipe, as a run's ranks share one stderr: the lines that did
    not come out whole."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, mark, how], stderr=write_end) for mark in "ab"]
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        lines = pipe.read().splitlines()
    assert [writer.wait() for writer in writers] == [0, 0]
    whole = {f"trl-distill: error: {mark * 600}" for mark in "ab"}
    return sum(line not in whole for line in lines) + abs(len(lines) - 6000)


def test_ranks_lines_on_a_shared_stderr_stay_whole():
    assert _interleaved_lines("stderr_line") == 0
