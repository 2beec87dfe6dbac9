"""2 processes on CPU (gloo): an FSDP2 student beside each teacher kind other than the plain live one (a cache written
by a teacher sharded with FSDP2, then trained from; a teacher of another tokenizer; two teachers at once; 'self'; a
teacher reading its own prompt; an MoE teacher beside an MoE student; a vLLM server), each against the one-process
run on the same rows (tests/scripts/fsdp2_kinds_worker.py, one launch for all but the server)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trl_distill.testing import build_tokenizer, launch, logged, read_rank_records

pytestmark = pytest.mark.distributed
SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from fsdp2_kinds_worker import CACHE, trainer_for  # noqa: E402
from oracles import write_teacher_cache  # noqa: E402  (tests/ is on sys.path)

MODES = ("cache", "from_cache", "cross", "panel", "self", "privileged", "moe")
TRAINED = MODES[1:]
KEYS = ("loss", "kd_loss", "ce_loss")


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory) -> Path:
    """A Mixtral teacher (hidden 32, 3 experts: 2 on rank 0, 1 on rank 1) and student (hidden 16, 4 experts), top-2,
    saved as `save_pretrained` writes them: each expert's tensors apart."""
    directory = tmp_path_factory.mktemp("fsdp2_moe")
    tokenizer = build_tokenizer()
    for seed, (size, hidden, experts) in enumerate((("teacher", 32, 3), ("student", 16, 4))):
        ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   bos_token_id=tokenizer.bos_token_id)
        config = AutoConfig.for_model("mixtral", vocab_size=len(tokenizer), hidden_size=hidden,
                                      intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, num_local_experts=experts, num_experts_per_tok=2, **ids)
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory / size)
        tokenizer.save_pretrained(directory / size)
    return directory


@pytest.fixture(scope="module")
def kinds(tiny_pair, other_teacher, second_teacher, moe_pair, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp2_kinds")
    paths = {"pair": str(Path(tiny_pair["teacher"]).parent), "other": other_teacher, "second": second_teacher,
             "moe": str(moe_pair), "cache": str(out / "cache" / "written")}
    launch(SCRIPTS / "fsdp2_kinds_worker.py", str(out), json.dumps(paths), *MODES, timeout=400)
    return {"out": out, "paths": paths, **{mode: read_rank_records(out / mode) for mode in MODES}}


def one_process(out: Path, mode: str, paths: dict):
    """The same rows on one process, without FSDP: a batch of 4 is the two ranks' 2 + 2."""
    return trainer_for(str(out / "one"), mode, paths, use_cpu=True, per_device_train_batch_size=4)


def assert_equal_losses(ranks: list[dict], trainer, keys=KEYS, after_first: float = 1e-5) -> None:
    """Each step's logged `keys` equal the one-process run's (1e-5; `after_first` once the weights have moved)."""
    trainer.train()
    for rank in ranks:
        assert rank["is_fsdp2"]
        for key in keys:
            expected, got = logged(trainer.state.log_history, key), logged(rank["log_history"], key)
            assert sorted(got) == [1, 2, 3], key
            for step, value in got.items():
                assert value == pytest.approx(expected[step], abs=1e-5 if step == 1 else after_first), (key, step)


def assert_each_teacher_half_on_each_rank(ranks: list[dict], names: list[str]) -> None:
    for rank in ranks:
        assert sorted(rank["teachers"]) == names
        for share in rank["teachers"].values():
            assert share["all_sharded"] and share["held"] == share["total"] // 2, share  # root released, too
        whole = sum(share["total"] for share in rank["teachers"].values())
        assert rank["teacher_bytes_read"] == whole // 2  # fp32 on disk and in memory: each rank read its rows


def test_a_cache_written_by_a_teacher_sharded_with_fsdp2_is_the_one_process_cache(kinds):
    assert_each_teacher_half_on_each_rank(kinds["cache"], ["teacher"])
    trainer = one_process(kinds["out"], "cache", kinds["paths"])
    alone = kinds["out"] / "one" / "cache_written"
    write_teacher_cache(trainer, str(alone), **CACHE)
    written = Path(kinds["paths"]["cache"])
    shards = sorted(p.name for p in written.glob("shard-*.arrow"))
    assert shards == ["shard-00000.arrow", "shard-00001.arrow"]
    for name in shards:
        assert (written / name).read_bytes() == (alone / name).read_bytes(), name
    assert json.loads((written / "manifest.json").read_text())["shards"] == json.loads(
        (alone / "manifest.json").read_text())["shards"]


def test_training_from_a_cache_beside_an_fsdp2_student(kinds):
    assert all(rank["teachers"] == {} and rank["teacher_bytes_read"] == 0 for rank in kinds["from_cache"])
    assert_equal_losses(kinds["from_cache"], one_process(kinds["out"], "from_cache", kinds["paths"]))


def test_a_teacher_of_another_tokenizer_is_sharded_with_fsdp2(kinds):
    assert_each_teacher_half_on_each_rank(kinds["cross"], ["teacher"])
    assert_equal_losses(kinds["cross"], one_process(kinds["out"], "cross", kinds["paths"]))


def test_several_teachers_are_each_sharded_on_their_own(kinds):
    """Teacher a frees each layer after its forward (the default); b keeps its layers gathered once it ran
    (``fsdp: {"reshard_after_forward": false}``, its own settings): each reads its half and the root group is freed."""
    for rank in kinds["panel"]:
        a, b = rank["teachers"]["a"], rank["teachers"]["b"]
        assert a["all_sharded"] and a["held"] == a["total"] // 2
        assert b["total"] == a["total"] and not b["all_sharded"] and b["total"] // 2 < b["held"] < b["total"]
        assert rank["teacher_bytes_read"] == a["total"]  # half of each
    assert_equal_losses(kinds["panel"], one_process(kinds["out"], "panel", kinds["paths"]))


def test_self_distillation_runs_the_fsdp2_students_own_base(kinds):
    for rank in kinds["self"]:
        assert rank["teacher_is_the_students_base"] and rank["teachers"] == {} and rank["teacher_bytes_read"] == 0
        assert rank["student"]["all_sharded"] and rank["student"]["held"] == rank["student"]["total"] // 2
        assert logged(rank["log_history"], "kd_loss")[1] == 0.0  # the adapters start at zero: the student is its base
    assert_equal_losses(kinds["self"], one_process(kinds["out"], "self", kinds["paths"]))


def test_a_teacher_reading_its_own_prompt_is_sharded_with_fsdp2(kinds):
    assert_each_teacher_half_on_each_rank(kinds["privileged"], ["teacher"])
    assert_equal_losses(kinds["privileged"], one_process(kinds["out"], "privileged", kinds["paths"]))


def test_an_moe_teacher_sharded_with_fsdp2_beside_an_moe_student_with_its_router_loss(kinds):
    """Each rank reads the rows of each fused expert parameter (``[E, ...]``: experts 0-1 on rank 0, 2 on rank 1)
    from the checkpoint's per-expert tensors, and nothing else: gathered, every parameter equals transformers' own
    load of it."""
    ranks = kinds["moe"]
    shares = [rank["teachers"]["teacher"] for rank in ranks]
    assert all(share["all_sharded"] for share in shares)
    assert sum(share["held"] for share in shares) == shares[0]["total"]
    assert shares[0]["held"] > shares[1]["held"]  # (the other parameters split evenly)
    for rank in ranks:
        assert rank["teacher_bytes_read"] == rank["teachers"]["teacher"]["held"]  # fp32 on disk and in memory
        rows = rank["expert_rows"]
        assert len(rows["fused"]) == 4 and rows["max"] == 0.0, rows  # gate_up_proj and down_proj of 2 layers
        assert len(rank["own_router_losses"]) == 3
        for step, value in logged(rank["log_history"], "aux_loss").items():  # the ranks' mean of their own
            own = [r["own_router_losses"][step - 1] for r in ranks]
            assert value == pytest.approx(sum(own) / 2, abs=1e-6) and value > 1.9
        for entry in rank["log_history"][:3]:
            mixed = 0.5 * entry["kd_loss"] + 0.5 * entry["ce_loss"] + 0.02 * entry["aux_loss"]
            assert entry["loss"] == pytest.approx(mixed, abs=1e-5)
    # The router loss is not linear in the rows: the mean of two ranks' own over 2 rows each is not its value over
    # the 4 rows (4e-5 here), nor is its gradient, so the weights differ slightly (3e-5 in CE) once they have moved
    assert_equal_losses(ranks, one_process(kinds["out"], "moe", kinds["paths"]), ("kd_loss", "ce_loss"), 1e-4)


def test_a_served_teacher_beside_an_fsdp2_student(served, tmp_path):
    paths = {"served_student": served["student"], "url": served["url"]}
    launch(SCRIPTS / "fsdp2_kinds_worker.py", str(tmp_path), json.dumps(paths), "served", timeout=300)
    ranks = read_rank_records(tmp_path / "served")
    assert all(rank["teachers"] == {} for rank in ranks)
    assert min(logged(ranks[0]["log_history"], "kd_loss").values()) > 0.1  # a peaked teacher: far from zero
    assert_equal_losses(ranks, one_process(tmp_path, "served", paths))
