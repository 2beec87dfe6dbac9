"""The shipped configs: every DeepSpeed JSON loads and says what it is; recipes parse into the CLI."""

from pathlib import Path

import pytest
import yaml

from trl_distill.cli import make_parser
from trl_distill.run_plan import resolve
from trl_distill.runtime.deepspeed_config import load_deepspeed_config

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize(
    "name, stage, offload",
    [
        ("zero2_student.json", 2, None),
        ("zero2_student_offload_optimizer.json", 2, "offload_optimizer"),
        ("zero3_student.json", 3, None),
        ("zero3_teacher.json", 3, None),
        ("zero3_teacher_offload_params.json", 3, "offload_param"),
    ],
)
def test_deepspeed_configs(name, stage, offload):
    config = load_deepspeed_config(str(CONFIGS / "deepspeed" / name))
    assert config["zero_optimization"]["stage"] == stage
    assert "optimizer" not in config and "scheduler" not in config  # the Trainer's optimizer is used
    if offload:
        assert config["zero_optimization"][offload]["device"] == "cpu"


def test_accelerate_configs_point_at_shipped_files():
    for path in (CONFIGS / "accelerate").glob("*.yaml"):
        config = yaml.safe_load(path.read_text())
        ds_file = config.get("deepspeed_config", {}).get("deepspeed_config_file")
        if ds_file:
            assert (CONFIGS.parent / ds_file).is_file(), (path.name, ds_file)
        assert config["num_processes"] >= config["num_machines"]


def test_recipe_parses_with_command_line_overrides():
    recipe = str(CONFIGS / "recipes" / "quickstart.yaml")
    _, args, model_args = make_parser().parse_args_and_config(
        ["--config", recipe, "--model_name_or_path", "s", "--output_dir", "o", "--use_cpu", "--max_steps", "7"]
    )
    assert args.max_steps == 7  # the command line wins over the recipe
    assert args.divergence == "forward_kl" and args.alpha == 1.0 and args.learning_rate == 3e-3
    assert args.teacher_deepspeed == "configs/deepspeed/zero3_teacher.json"
    assert model_args.model_name_or_path == "s"


@pytest.mark.parametrize(
    "recipe, expected",
    [
        ("quickstart.yaml", {"divergence": "forward_kl", "alpha": 1.0}),
        ("lora_student.yaml", {"divergence": "forward_kl", "alpha": 0.5, "use_peft": True, "lora_r": 16}),
        ("reverse_kl_chat.yaml", {"divergence": "reverse_kl", "temperature": 2.0, "alpha": 0.7}),
        ("two_teachers.yaml", {"teacher_combine": "route", "teacher_column": "teacher", "alpha": 0.5}),
        ("two_teachers_on_policy.yaml", {"teacher_combine": "route", "lmbda": 1.0, "divergence": "reverse_kl"}),
        ("sampled_token_task_reward.yaml", {"on_policy_objective": "sampled_token", "lmbda": 1.0,
                                            "task_reward_funcs": ["last_number"]}),
        ("teacher_prompt.yaml", {"teacher_prompt": "{prompt}\nThe correct answer is {answer}.\n", "lmbda": 1.0}),
    ],
)
def test_every_recipe_parses(recipe, expected):
    """GPU recipes ask for bf16; on this CPU machine the command line turns it off, as a user would."""
    assert {p.name for p in (CONFIGS / "recipes").glob("*.yaml")} >= {recipe}
    _, args, model_args = make_parser().parse_args_and_config(
        ["--config", str(CONFIGS / "recipes" / recipe), "--model_name_or_path", "s", "--output_dir", "o",
         "--use_cpu", "--bf16", "false"]
    )
    for key, value in expected.items():
        assert getattr(model_args if hasattr(model_args, key) else args, key) == value, key
    assert (CONFIGS.parent / args.teacher_deepspeed).is_file()
    for spec in resolve(args).teachers:  # a recipe's list of teachers, parsed (as the command line resolves it)
        assert spec.model.endswith("_TEACHER")
        assert spec.deepspeed is None or (CONFIGS.parent / spec.deepspeed).is_file()


def test_every_shipped_recipe_is_tested():
    tested = {"quickstart.yaml", "lora_student.yaml", "reverse_kl_chat.yaml", "two_teachers.yaml",
              "two_teachers_on_policy.yaml", "sampled_token_task_reward.yaml", "teacher_prompt.yaml"}
    assert {p.name for p in (CONFIGS / "recipes").glob("*.yaml")} == tested
