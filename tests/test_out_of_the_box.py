"""What a new user runs, run as written on this CPU (2 processes, DeepSpeed, default precision): the README's minimal
example, each recipe under configs/recipes/, examples/distill.py, and the DeepSpeed configs of accelerate's
multi-model guide. Only hub ids, the dataset and the output directory are swapped for local ones."""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config

from trl_distill.model.precision import cpu_supports_bf16
from trl_distill.testing import build_tokenizer, launch, synthetic_prompt_completion

ROOT = Path(__file__).parent.parent
HEADLINE = ("--config_file", str(ROOT / "configs/accelerate/zero2_student_zero3_teacher.yaml"))
pytestmark = pytest.mark.distributed


def conversations(n: int):
    return synthetic_prompt_completion(n, seed=7).map(
        lambda r: {"messages": [{"role": "user", "content": r["prompt"]},
                                {"role": "assistant", "content": r["completion"]}]},
        remove_columns=["prompt", "completion"])


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory) -> dict[str, str]:
    """Tiny Qwen3 models saved like the hub's (the README names Qwen3-0.6B and Qwen3-8B), and a chat dataset."""
    out = tmp_path_factory.mktemp("qwen")
    tokenizer = build_tokenizer()
    paths = {}
    for seed, (name, hidden, layers) in enumerate((("teacher", 64, 3), ("student", 32, 2))):
        config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(seed)
        paths[name] = str(out / name)
        AutoModelForCausalLM.from_config(config).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    paths["data"] = str(out / "capybara")  # a directory of jsonl files, as `load_dataset(dir)` reads it
    Path(paths["data"]).mkdir()
    conversations(16).to_json(str(out / "capybara" / "train.jsonl"))
    return paths


def readme_example() -> str:
    """The README's minimal example, exactly as printed there."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Minimal example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def moved(trained: dict, initial_dir: str) -> bool:
    """The saved student is not the initial one (a few bf16 steps at SFT's learning rate move few bf16 values)."""
    initial = load_file(str(Path(initial_dir) / "model.safetensors"))
    assert trained.keys() == initial.keys()
    return any(not torch.equal(trained[k].float(), initial[k].to(trained[k].dtype).float()) for k in initial)


def test_the_readme_minimal_example_runs_as_written(qwen_pair, tmp_path):
    code = readme_example()
    swaps = {'"Qwen/Qwen3-0.6B"': repr(qwen_pair["student"]), '"Qwen/Qwen3-8B"': repr(qwen_pair["teacher"]),
             '"trl-lib/Capybara"': repr(qwen_pair["data"]), '"qwen-distilled"': repr(str(tmp_path / "out"))}
    for old, new in swaps.items():
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    script = tmp_path / "train.py"
    script.write_text(code)
    # "torchrun --nproc_per_node N train.py", as a user runs it (not a shared-ranks job); 16 rows, 3 epochs: 3 steps
    launch(script, cwd=ROOT, timeout=400, own_launch=True)
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    dtype = torch.bfloat16 if cpu_supports_bf16() else torch.float32  # precision chosen for this machine
    assert {t.dtype for t in saved.values()} == {dtype}
    assert moved(saved, qwen_pair["student"])


def cli(tiny_pair, data: str, out: Path, *flags: str, launcher_args=HEADLINE):
    return launch("trl_distill", "--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path",
                  tiny_pair["teacher"], "--dataset_name", data, "--output_dir", str(out), *flags,
                  launcher="accelerate", launcher_args=(*launcher_args, "-m"), cwd=ROOT, timeout=400)


def test_recipe_reverse_kl_chat_as_written(tiny_pair, tmp_path):
    data = tmp_path / "chat.jsonl"
    conversations(96).to_json(str(data))  # 4 rows x 4 accumulation x 2 ranks: 3 optimizer steps (1 of warmup at lr 0)
    out = tmp_path / "out"
    cli(tiny_pair, str(data), out, "--config", "configs/recipes/reverse_kl_chat.yaml")
    assert moved(load_file(str(out / "model.safetensors")), tiny_pair["student"])
    assert list(out.rglob("events.out.tfevents.*"))  # its report_to: tensorboard


def test_recipe_lora_student_as_written(tiny_pair, tmp_path):
    data = tmp_path / "pc.jsonl"
    synthetic_prompt_completion(48, seed=8).to_json(str(data))  # 8 rows x 2 ranks: 3 steps (1 of warmup at lr 0)
    out = tmp_path / "out"
    cli(tiny_pair, str(data), out, "--config", "configs/recipes/lora_student.yaml")
    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert adapter and not (out / "model.safetensors").exists()
    assert any(k.endswith("lora_B.weight") and t.abs().sum() > 0 for k, t in adapter.items())  # B starts at 0


def test_accelerate_guide_configs_verbatim(tiny_pair, tmp_path):
    """Both JSON files of accelerate's multi-model guide, unedited (trailing commas, "auto" everywhere, CPU
    optimizer offload), the student's given to `accelerate launch --deepspeed_config_file` as the guide does."""
    guide = ROOT / "tests/data/accelerate_guide"
    data = tmp_path / "pc.jsonl"
    synthetic_prompt_completion(16, seed=9).to_json(str(data))
    out = tmp_path / "out"
    result = cli(tiny_pair, str(data), out, "--teacher_deepspeed", str(guide / "zero3_config.json"),
                 "--max_steps", "4", launcher_args=("--use_deepspeed", "--deepspeed_config_file",
                                                    str(guide / "zero2_config.json")))
    assert "'auto' filled with DeepSpeed's defaults: {'stage3_max_live_parameters': 1000000000" in result.stdout
    assert moved(load_file(str(out / "model.safetensors")), tiny_pair["student"])


def test_examples_distill_script(tiny_pair, tmp_path):
    out = tmp_path / "out"
    launch(ROOT / "examples/distill.py", "--teacher", tiny_pair["teacher"], "--student", tiny_pair["student"],
           "--output_dir", str(out), "--max_steps", "2", timeout=400)
    assert moved(load_file(str(out / "model.safetensors")), tiny_pair["student"])
