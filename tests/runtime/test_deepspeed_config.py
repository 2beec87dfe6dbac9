"""The teacher's DeepSpeed config: loaded leniently, derived when absent, "auto" values filled."""

import json
import logging

import pytest

from trl_distill.run_plan import TeacherEngine
from trl_distill.runtime.deepspeed_config import build_teacher_config, derive_teacher_config, load_deepspeed_config

# the student's train and eval batches per device 2 and 8, accumulation 3, two processes, bf16
ARGS = TeacherEngine(deepspeed=None, micro_batch_size=8, gradient_accumulation_steps=3, world_size=2,
                     max_grad_norm=1.0, bf16=True, fp16=False, bf16_full_eval=False, fp16_full_eval=False,
                     seq_kd=False, fsdp_student=False)


def test_derived_config_is_zero3_inference_with_autos_filled():
    cfg = build_teacher_config(None, {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}, ARGS, 4096)
    assert cfg["zero_optimization"] == {
        "stage": 3,
        "reduce_bucket_size": 4096 * 4096,
        "stage3_prefetch_bucket_size": int(0.9 * 4096 * 4096),
        "stage3_param_persistence_threshold": 10 * 4096,
    }
    assert cfg["train_micro_batch_size_per_gpu"] == 8
    assert cfg["gradient_accumulation_steps"] == 3
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert "optimizer" not in cfg and "scheduler" not in cfg


def test_user_values_are_kept_and_optimizer_blocks_dropped(caplog):
    user = {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 123, "stage3_prefetch_bucket_size": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupLR"},
        "train_micro_batch_size_per_gpu": 1,
    }
    with caplog.at_level(logging.WARNING):
        cfg = build_teacher_config(user, None, ARGS, 64)
    assert "dropped the optimizer and scheduler" in caplog.text
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 123
    assert cfg["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert cfg["train_micro_batch_size_per_gpu"] == 1
    assert "optimizer" not in cfg and "scheduler" not in cfg
    assert user["optimizer"]  # the caller's dict is not modified


def test_non_zero3_teacher_warns(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = build_teacher_config({"zero_optimization": {"stage": 2}}, None, ARGS, 64)
    assert "every rank will hold the whole teacher" in caplog.text
    assert "stage3_prefetch_bucket_size" not in cfg["zero_optimization"]


def test_trailing_commas_parse(tmp_path):
    path = tmp_path / "teacher.json"
    path.write_text('{\n  "zero_optimization": {"stage": 3,},\n  "bf16": {"enabled": "auto"},\n}\n')
    assert load_deepspeed_config(str(path)) == {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}


def test_invalid_json_points_at_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "zero_optimization": {"stage": 3}\n  "bf16": {}\n}\n')
    with pytest.raises(ValueError, match=r"bad.json, line 3"):
        load_deepspeed_config(str(path))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_deepspeed_config(str(tmp_path / "nope.json"))


def test_json_string_and_unfillable_auto():
    assert load_deepspeed_config(json.dumps({"a": 1})) == {"a": 1}
    with pytest.raises(ValueError, match="zero_optimization.offload_param.device"):
        build_teacher_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "auto"}}}, None, ARGS, 64)


def test_other_zero_autos_get_deepspeeds_defaults_and_say_so():
    """accelerate's multi-model guide leaves stage3_max_live_parameters / _reuse_distance at "auto"."""
    notes = []
    zero = {"stage": 3, "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto",
            "sub_group_size": "auto", "stage3_prefetch_bucket_size": "auto"}
    cfg = build_teacher_config({"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}, None, ARGS, 64,
                               notes=notes)
    z = cfg["zero_optimization"]
    assert (z["stage3_max_live_parameters"], z["stage3_max_reuse_distance"], z["sub_group_size"]) == (10**9,) * 3
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)  # ours, from the teacher's hidden size
    assert notes == ["'auto' filled with DeepSpeed's defaults: {'stage3_max_live_parameters': 1000000000, "
                     "'stage3_max_reuse_distance': 1000000000, 'sub_group_size': 1000000000}"]
    # the guide fixes the teacher's micro batch at 1: the batch size follows it, or DeepSpeed refuses the config
    assert cfg["train_batch_size"] == 1 * ARGS.gradient_accumulation_steps * getattr(ARGS, "world_size", 1)


def test_derived_precision_follows_the_student():
    assert derive_teacher_config({"fp16": {"enabled": True}})["fp16"] == {"enabled": True}
    assert derive_teacher_config(None)["bf16"] == {"enabled": "auto"}
