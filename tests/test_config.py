import pytest

from trl_distill import LOSS_TYPES, DistillationConfig


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
        (
            {"auto_find_batch_size": True, "deepspeed": {"zero_optimization": {"stage": 2}}},
            "auto_find_batch_size is not supported with DeepSpeed",
        ),
    ],
)
def test_bad_values_fail_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_every_field_has_help():
    from dataclasses import fields

    from trl import SFTConfig

    ours = {f.name for f in fields(DistillationConfig)} - {f.name for f in fields(SFTConfig)}
    assert {"teacher_model_name_or_path", "teacher_deepspeed", "divergence", "temperature", "alpha"} <= ours
    for f in fields(DistillationConfig):
        if f.name in ours:
            assert f.metadata.get("help"), f.name


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
