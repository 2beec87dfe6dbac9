"""`import trl_distill` loads what its config needs and little more than `from trl import SFTConfig` does: the trainer
(with `trl.SFTTrainer` and datasets), DeepSpeed, matplotlib, requests, the rollout server's client and `report` are
imported where they are used. Every CLI call pays the import; `benchmarks/import_time.py` measures it against
`from trl import SFTConfig`. The package imports each public name on first use, and the config imports only leaf
modules of it."""

import json
import subprocess
import sys

import pytest

import trl_distill

ADDED = ("import json, sys; from trl import SFTConfig; before = set(sys.modules); import trl_distill; "
         "print(json.dumps(sorted(set(sys.modules) - before)))")
ALLOWED_THIRD_PARTY = {"pyarrow"}  # the teacher cache's shards (trl_distill.cache), about 40 ms


def test_import_adds_no_heavy_library_to_what_sft_config_imports():
    added = json.loads(subprocess.run([sys.executable, "-c", ADDED], check=True, capture_output=True,
                                      text=True).stdout)
    top = {name.split(".")[0] for name in added}
    third_party = {name for name in top - {"trl_distill"} if name not in sys.stdlib_module_names
                   and not name.startswith("_")}
    assert third_party <= ALLOWED_THIRD_PARTY, third_party
    ours = {name for name in added if name.startswith("trl_distill")}
    for later in ("trl_distill.trainer", "trl_distill.report", "trl_distill.cli", "trl_distill.rollout.engine_rollouts",
                  "trl_distill.rollout.engine_client", "trl_distill.rollout.weight_sync"):
        assert later not in ours, later


CONFIG_ONLY = ("import json, sys; import trl_distill.config; print(json.dumps(sorted(name for name in sys.modules "
               "if name == 'trl_distill' or name.startswith('trl_distill.'))))")


def test_the_config_loads_at_most_four_modules_of_the_package():
    """The config is no import hub: its fields' choices come from `constants`, its checks of how they combine are
    `run_plan.resolve`'s, and what `__post_init__` needs beyond it is imported when a config is built."""
    ours = json.loads(subprocess.run([sys.executable, "-c", CONFIG_ONLY], check=True, capture_output=True,
                                     text=True).stdout)
    assert ours == ["trl_distill", "trl_distill.compat", "trl_distill.config", "trl_distill.constants"]
    assert len(ours) <= 4


def test_every_public_name_is_there_on_first_use():
    from trl_distill.config import DistillationConfig
    from trl_distill.loss.divergences import LOSS_TYPES, divergence
    from trl_distill.loss.fused import chunked_distillation_loss, chunked_divergence

    defined = {"DistillationConfig": DistillationConfig, "LOSS_TYPES": LOSS_TYPES, "divergence": divergence,
               "chunked_distillation_loss": chunked_distillation_loss, "chunked_divergence": chunked_divergence}
    for name, value in defined.items():
        assert getattr(trl_distill, name) is value and name in trl_distill.__all__ and name in dir(trl_distill)
    with pytest.raises(AttributeError, match="has no attribute 'Distillation'"):
        trl_distill.Distillation  # noqa: B018


def test_the_trainer_is_there_on_first_use():
    from trl_distill import DistillationTrainer
    from trl_distill.trainer import DistillationTrainer as defined

    assert DistillationTrainer is defined is trl_distill.DistillationTrainer
    assert "DistillationTrainer" in dir(trl_distill) and "DistillationTrainer" in trl_distill.__all__
