import ast
import os
import re
from dataclasses import fields
from pathlib import Path

import pytest

from trl_distill import LOSS_TYPES, DistillationConfig
from trl_distill.run_plan import resolve


def make(**kwargs):
    return DistillationConfig(output_dir="unused", use_cpu=True, report_to="none", **kwargs)


def test_defaults_and_sft_fields_untouched():
    cfg = make()
    assert cfg.divergence == "forward_kl" and cfg.loss_type == "nll"  # SFT's own loss_type is untouched
    assert cfg.temperature == 1.0 and cfg.alpha == 0.5 and cfg.kd_temperature_scaling


@pytest.mark.parametrize("divergence", LOSS_TYPES)
def test_every_divergence_accepted(divergence):
    assert make(divergence=divergence).divergence == divergence


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"divergence": "kl"}, "Unknown divergence 'kl'; choose one of forward_kl"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"temperature": -1.0}, "temperature must be > 0"),
        ({"alpha": 1.5}, r"alpha must be in \[0, 1\]"),
        ({"beta": -0.1}, r"beta must be in \[0, 1\]"),
        ({"skew_alpha": 2.0}, r"skew_alpha must be in \[0, 1\]"),
        ({"loss_chunk_size": 0}, "loss_chunk_size must be a positive integer"),
        ({"teacher_fsdp_config": {"reshard": True}}, r"teacher_fsdp_config: unknown key\(s\) reshard; the keys are"),
        ({"teacher_fsdp_config": '{"dtype": "int8"}'}, "teacher_fsdp_config: dtype must be one of bf16, fp16, fp32"),
        ({"teacher_fsdp_config": "./nowhere.json"}, "teacher_fsdp_config='./nowhere.json' is neither a JSON object"),
    ],
)
def test_bad_values_fail_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"auto_find_batch_size": True, "teacher_deepspeed": {"zero_optimization": {"stage": 3}}},
            "auto_find_batch_size is not supported with DeepSpeed",
        ),
        ({"save_steps": 0}, "save_steps must be > 0 with save_strategy 'steps', got 0"),
        ({"num_train_epochs": 0}, "num_train_epochs=0 trains nothing"),
    ],
)
def test_settings_that_cannot_combine_fail_with_the_fix_as_the_run_is_resolved(kwargs, message):
    config = make(**kwargs)  # each field alone is a value a run may take
    with pytest.raises(ValueError, match=message):
        resolve(config)


def test_auto_find_batch_size_with_a_deepspeed_student_fails_as_the_run_is_resolved(tmp_path):
    """(A fresh interpreter: a DeepSpeed student's config sets up DeepSpeed's process state on CPU as it is built.)"""
    import subprocess
    import sys

    code = (
        "from trl_distill import DistillationConfig\n"
        "from trl_distill.run_plan import resolve\n"
        f"args = DistillationConfig(output_dir={str(tmp_path)!r}, deepspeed={{'zero_optimization': {{'stage': 2}}}}, "
        "auto_find_batch_size=True, bf16=False, report_to='none')\n"
        "try:\n    resolve(args)\nexcept ValueError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines()[-1].startswith(
        "auto_find_batch_size is not supported with DeepSpeed here: retrying a smaller batch would rebuild the "
        "student's engine but not the teacher's."), out.stderr[-2000:]


def test_resolve_returns_the_runs_plan_in_typed_parts():
    plan = resolve(make(divergence="jsd", beta=0.3, alpha=0.7, lmbda=0.5, max_new_tokens=7, generation_top_k=5,
                        eval_reward_funcs="exact_match", num_generations_eval=4, eval_max_new_tokens=3))
    assert (plan.loss.divergence, plan.loss.beta, plan.loss.vocab_size, plan.alpha) == ("jsd", 0.3, None, 0.7)
    assert plan.loss.kd_grad and plan.loss.ce_grad
    assert (plan.on_policy.lmbda, plan.on_policy.samples, plan.on_policy.objective) == (0.5, True, "divergence")
    assert (plan.on_policy.sampling.max_new_tokens, plan.on_policy.sampling.top_k) == (7, 5)
    assert plan.evaluation.reward_funcs == ("exact_match",) and plan.evaluation.num_generations == 4
    assert (plan.evaluation.sampling.max_new_tokens, plan.evaluation.sampling.temperature) == (3, 1.0)
    # the eval temperature: greedy for one generation, generation_temperature for several, unless it is given
    assert [resolve(make(num_generations_eval=n, generation_temperature=0.7, **given)).evaluation.sampling.temperature
            for n, given in ((1, {}), (4, {}), (4, {"eval_temperature": 0.3}))] == [0.0, 0.7, 0.3]
    assert plan.teachers == () and plan.parallelism.sequence_parallel_size == 1
    assert plan.parallelism.attn_implementation is None and not plan.parallelism.student_deepspeed
    assert resolve(make(teachers=["a=./a", "b=cache:./b"], teacher_combine="sum")).teachers[1].cache == "./b"
    with pytest.raises(AttributeError):
        plan.alpha = 0.1  # frozen: what the run was resolved to


def test_the_offered_names_are_the_tables_names():
    """`trl_distill.constants` lists the choices for the config without importing the code behind them."""
    from trl_distill import constants
    from trl_distill.evaluation.verifiers import BUILT_INS
    from trl_distill.loss.divergences import DIVERGENCES
    from trl_distill.teacher.specs import COMBINE

    assert constants.LOSS_TYPES == tuple(DIVERGENCES) == LOSS_TYPES
    assert constants.BUILT_IN_VERIFIERS == BUILT_INS and constants.TEACHER_COMBINES == tuple(COMBINE)
    field = {f.name: f for f in fields(DistillationConfig)}
    assert field["on_policy_objective"].metadata["choices"] == list(constants.OBJECTIVES) == ["divergence",
                                                                                             "sampled_token"]
    assert field["vllm_mode"].metadata["choices"] == ["server", "colocate"]


def test_every_field_has_help():
    from dataclasses import fields

    from trl import SFTConfig

    ours = {f.name for f in fields(DistillationConfig)} - {f.name for f in fields(SFTConfig)}
    assert {"teacher_model_name_or_path", "teacher_deepspeed", "divergence", "temperature", "alpha"} <= ours
    for f in fields(DistillationConfig):
        if f.name in ours:
            assert f.metadata.get("help"), f.name


SECTIONS = ["Teacher", "Loss", "On-policy and rollouts", "On-policy objective", "Cache", "Several teachers",
            "Long rows", "Metrics and guards", "Generation-based evaluation", "Reliability"]


def documented() -> list[tuple[str, str, str, bool, str | None]]:
    """(section, name, type, optional, default) of every entry in DistillationConfig's docstring, in order."""
    entry = re.compile(r"^ {8}(\w+) \(`([^`]+)`(, \*optional\*)?(?:, defaults to `([^`]+)`)?\):$")
    out, section = [], None
    for line in DistillationConfig.__doc__.splitlines():
        if line.startswith("        > "):
            section = line.strip()[2:]
        elif match := entry.match(line):
            out.append((section, *match.groups()))
    return out


def declared_annotation(name: str) -> str:
    """A field's annotation as written in its class (`f.type` is no help: `HfArgumentParser` resolves it in place)."""
    for klass in DistillationConfig.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return vars(klass)["__annotations__"][name]
    raise AssertionError(f"{name} has no annotation")


def test_the_docstring_lists_every_field_of_ours_in_order_with_its_type_and_default():
    from trl import SFTConfig

    sft = {f.name: f for f in fields(SFTConfig)}
    ours = [f for f in fields(DistillationConfig) if f.name not in sft or f.default != sft[f.name].default]
    assert ours[0].name == "assistant_only_loss"  # SFT's field, our default: it keeps SFT's place in --help
    entries = documented()
    assert list(dict.fromkeys(e[0] for e in entries)) == SECTIONS
    by_name = {e[1]: e for e in entries}
    assert len(by_name) == len(entries)  # none listed twice
    assert set(by_name) == {f.name for f in ours}, set(by_name) ^ {f.name for f in ours}
    in_sections = [f.name for f in fields(DistillationConfig) if f.name in by_name and f.name not in sft]
    assert [e[1] for e in entries if e[1] in in_sections] == in_sections  # the docstring's order is --help's
    for f in ours:
        _, _, kind, optional, default = by_name[f.name]
        annotation = declared_annotation(f.name)
        assert bool(optional) and kind == annotation.removesuffix(" | None"), (f.name, kind, annotation)
        if f.default is None:
            assert default is None and annotation.endswith("| None"), f.name
        else:
            assert default is not None and ast.literal_eval(default) == f.default, (f.name, default, f.default)


def test_the_sections_follow_sft_config_and_the_dead_colocate_field_is_gone():
    from trl import SFTConfig

    names = [f.name for f in fields(DistillationConfig)]
    sft = [f.name for f in fields(SFTConfig)]
    assert names[: len(sft)] == sft and names[len(sft)] == "teacher_model_name_or_path"
    assert names[-1] == "resume_allow_changes" and "vllm_gpu_memory_utilization" not in names


def test_building_a_config_leaves_the_callers_dicts_alone(tmp_path):
    """DeepSpeed on CPU needs a configured gloo state; the config sets it up where transformers sets up devices,
    on its own copy of `accelerator_config` (a fresh process: that state lives as long as the process)."""
    import subprocess
    import sys

    code = (
        "from trl_distill import DistillationConfig\n"
        "accel = {'split_batches': False}\n"
        "ds = {'zero_optimization': {'stage': 2}}\n"
        f"args = DistillationConfig(output_dir={str(tmp_path)!r}, deepspeed=ds, accelerator_config=accel, bf16=False)\n"
        "assert accel == {'split_batches': False}, accel\n"
        "assert ds == {'zero_optimization': {'stage': 2}}, ds\n"
        "assert args.accelerator_config.split_batches is False and args.distributed_state.num_processes == 1\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


ENV_PROBE = """
import json, os, sys
from trl_distill.runtime.process_setup import prepare_process
prepare_process()  # (DeepSpeed's DS_ACCELERATOR, its build directory: the probe compares what the configs do after it)
from trl import SFTConfig
from trl_distill import DistillationConfig
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[3])
before = dict(os.environ)
config = DistillationConfig if sys.argv[1] == "ours" else SFTConfig
args = config(output_dir=sys.argv[2], deepspeed="configs/deepspeed/zero2_student.json", bf16=False, report_to="none")
args.device  # where the process is set up (TrainingArguments._setup_devices)
print(json.dumps(sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))))
"""


def test_the_config_changes_the_environment_no_more_than_sft_config_does(tmp_path):
    """Building a DeepSpeed config and setting up its devices (the gloo state DeepSpeed needs on CPU) leaves the
    environment as `trl.SFTConfig` with the same arguments does: `ACCELERATE_USE_DEEPSPEED` is set only while
    accelerate's state is created, as transformers itself does."""
    import json
    import subprocess
    import sys

    from trl_distill.runtime.distributed import free_port

    changed = {}
    for kind in ("ours", "sft"):
        result = subprocess.run([sys.executable, "-c", ENV_PROBE, kind, str(tmp_path / kind), str(free_port())],
                                capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1],
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-2000:]
        changed[kind] = json.loads(result.stdout.strip().splitlines()[-1])
    assert changed["ours"] == changed["sft"] and "ACCELERATE_USE_DEEPSPEED" not in changed["ours"]
