"""`trl-distill merge` never writes over the user's files and never says "saved" without the files (issue 33; a
damaged adapter, issue 41): each refusal is one `trl-distill merge: error:` line, with the user's files as they were."""

import shutil
from pathlib import Path

import pytest
from test_owned_files import error_lines, one_line, tree  # the shared helpers (tests/runtime is on sys.path)
from transformers import AutoModelForCausalLM

from trl_distill.cli import main


@pytest.fixture
def owned(tiny_pair, tmp_path) -> dict[str, Path]:
    """The user's own copy of the tiny student (the adapter's base), under `tmp_path`."""
    student = tmp_path / "models" / "student"
    shutil.copytree(tiny_pair["student"], student)
    return {"student": student}


@pytest.fixture
def adapter(owned, tmp_path) -> Path:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(owned["student"]), lora).save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def test_merge_refuses_an_existing_file_or_a_directory_of_other_files(adapter, owned, tmp_path, capsys):
    (target := tmp_path / "merged.safetensors").write_bytes(b"the user's file")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    for output, message in ((target, "is an existing file"),
                            (tmp_path / "mine", "is not empty ('notes.txt') and holds no earlier merge"),
                            (owned["student"], f"overlaps the base model {str(owned['student'])!r}")):
        line = one_line(capsys, ["merge", "--adapter", str(adapter), "--output", str(output)], prog="trl-distill merge")
        assert f"--output: {str(output)!r} {message}" in line, line
    assert tree(tmp_path) == before


def test_merge_saves_then_says_so_and_may_replace_its_own_earlier_merge(adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    main(["merge", "--adapter", str(adapter), "--output", str(out)])
    assert f"Merged model saved to {out}" in capsys.readouterr().out
    first = tree(out)
    assert "model.safetensors" in first and "config.json" in first and "trl_distill_merge.json" in first
    main(["merge", "--adapter", str(adapter), "--output", str(out)])  # again: only its own files, replaced
    assert f"Merged model saved to {out}" in capsys.readouterr().out
    assert tree(out).keys() == first.keys() and tree(out)["model.safetensors"] == first["model.safetensors"]


def test_merge_never_says_saved_when_nothing_was(adapter, tmp_path, capsys, monkeypatch):
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", lambda self, *a, **k: None)  # a save that writes nothing
    with pytest.raises(SystemExit) as exit_info:
        main(["merge", "--adapter", str(adapter), "--output", str(tmp_path / "m")])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "Merged model saved" not in captured.out
    assert error_lines(captured.err, "trl-distill merge") == [
        f"trl-distill merge: error: The merged model was not saved to {str(tmp_path / 'm')!r}: config.json, "
        "model.safetensors missing after saving. Check that the directory is writable and has space, then run the "
        "merge again."]


@pytest.mark.parametrize("damage, message", [
    ("cut", "--adapter: {weights} is truncated"),
    ("config", "--adapter: {config} is not a readable adapter config"),
    ("gone", "--adapter: {adapter!r} holds adapter_config.json but no adapter weights"),
])
def test_merge_of_a_damaged_adapter_is_one_line_and_writes_nothing(adapter, tmp_path, capsys, damage, message):
    """An adapter copied short (its safetensors or its config) or without weights: one line naming the file, before
    the base loads; --output is not created."""
    weights, config = adapter / "adapter_model.safetensors", adapter / "adapter_config.json"
    if damage == "cut":
        weights.write_bytes(weights.read_bytes()[:-40])
    elif damage == "config":
        config.write_text(config.read_text()[:30])
    else:
        weights.unlink()
    line = one_line(capsys, ["merge", "--adapter", str(adapter), "--output", str(tmp_path / "m")],
                    prog="trl-distill merge")
    assert message.format(weights=weights, config=config, adapter=str(adapter)) in line, line
    assert "Traceback" not in line and not (tmp_path / "m").exists()
