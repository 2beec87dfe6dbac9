"""The registry of teacher kinds (`trl_distill.teacher.registry`): every run's teachers are described as specs, and
every spec is built through its registered kind, the one place a kind is chosen."""

from __future__ import annotations

import json
import pickle

import pytest

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.run_plan import resolve
from trl_distill.teacher import CachedTeacher, LiveTeacher, SelfTeacher, ServedTeacher
from trl_distill.teacher.registry import TEACHER_KINDS, TeacherKind, describe, register_teacher_kind, teacher_kind
from trl_distill.teacher.settings import TeacherSettings
from trl_distill.teacher.specs import TeacherSpec
from trl_distill.testing import synthetic_prompt_completion


def config(tmp_path, **kwargs) -> DistillationConfig:
    return DistillationConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


def test_each_kind_is_registered_once_by_name_with_the_class_whose_refusals_it_checks():
    assert {name: kind.source_class for name, kind in TEACHER_KINDS.items()} == {
        "model": LiveTeacher, "self": SelfTeacher, "cache": CachedTeacher, "server": ServedTeacher}
    with pytest.raises(ValueError, match="The teacher kind 'cache' is registered already"):
        register_teacher_kind("cache", CachedTeacher, lambda spec, context: None)
    with pytest.raises(ValueError, match="Unknown teacher kind 'ghost'; registered: model, self, cache, server"):
        teacher_kind("ghost")


def described(args) -> list[TeacherSpec]:
    """The run's teachers as the trainer describes them: the plan's several (parsed by `resolve`), else the one of
    the single-teacher flags."""
    plan = resolve(args)
    return describe(plan.teachers, plan.teacher_settings)


def single(args) -> list[TeacherSpec]:
    """The one teacher of the single-teacher flags, as a spec (none without a teacher)."""
    return describe((), TeacherSettings.of(args))


def test_the_single_teacher_flags_and_the_teacher_list_describe_the_run_as_specs(tmp_path):
    assert single(config(tmp_path, teacher_model_name_or_path="/m")) == [TeacherSpec("teacher", model="/m")]
    assert single(config(tmp_path, teacher_model_name_or_path="self"))[0].kind == "self"
    assert single(config(tmp_path, teacher_cache="/c")) == [TeacherSpec("teacher", cache="/c")]
    served = single(config(tmp_path, teacher_server="http://h:8000", teacher_model_name_or_path="big"))
    assert served == [TeacherSpec("teacher", server="http://h:8000", served_model="big")]
    assert single(config(tmp_path, alpha=0.0)) == []
    several = config(tmp_path, teachers=["a=/m", "b=cache:/c", "c=http://h:8000"], teacher_combine="sum")
    # the list parsed into specs, as the trainer and the command line resolve it
    assert [(s.name, s.kind) for s in described(several)] == [("a", "model"), ("b", "cache"), ("c", "server")]
    # what the config holds serialises and builds the same teachers again, through JSON and through pickle
    again = config(tmp_path, teachers=json.loads(several.to_json_string())["teachers"], teacher_combine="sum")
    assert described(again) == described(several) == described(pickle.loads(pickle.dumps(several)))


def test_resolve_leaves_the_teachers_as_written_and_their_json_as_logged(tmp_path):
    """The config stays plain data: `resolve` parses the teachers into the plan, and `to_json_string()` (what the
    logging callbacks write) is the same before and after it, each entry as a dict with the weights of the sum."""
    written = ["a=/m", {"name": "b", "cache": "/c", "served_model": None}, "c=http://h:8000"]
    args = config(tmp_path, teachers=list(written), teacher_combine="sum")
    before = args.to_json_string()
    plan = resolve(args)
    assert args.teachers == written and args.teacher_weights is None
    assert plan.teachers == (TeacherSpec("a", model="/m"), TeacherSpec("b", cache="/c"),
                             TeacherSpec("c", server="http://h:8000"))
    assert plan.teacher_weights == (1 / 3, 1 / 3, 1 / 3)
    assert args.to_json_string() == before
    assert json.loads(before)["teachers"] == [{"name": "a", "model": "/m"}, {"name": "b", "cache": "/c"},
                                              {"name": "c", "server": "http://h:8000"}]
    assert json.loads(before)["teacher_weights"] == [1 / 3, 1 / 3, 1 / 3]
    routed = config(tmp_path, teachers="a=/m")  # one entry, routed: a list of one, no weights
    assert json.loads(routed.to_json_string())["teachers"] == [{"name": "a", "model": "/m"}]
    assert resolve(routed).teachers == (TeacherSpec("a", model="/m"),) and routed.teachers == "a=/m"
    assert resolve(routed).teacher_weights is None and json.loads(routed.to_json_string())["teacher_weights"] is None


@pytest.mark.parametrize("flags", [
    {"teacher_model_name_or_path": "/m", "teacher_model_init_kwargs": {"revision": "r1"},
     "teacher_deepspeed": {"zero_optimization": {"stage": 3}}},
    {"teacher_model_name_or_path": "self"},
    {"teacher_cache": "/c"},
    {"teacher_server": "http://h:8000", "teacher_model_name_or_path": "big"},
    {"teachers": ["a=/m", {"name": "b", "model": "/m2", "deepspeed": {"train_batch_size": 8}}, "c=cache:/c"],
     "teacher_combine": "sum", "teacher_weights": [0.5, 0.25, 0.25]},
], ids=["model", "self", "cache", "server", "several"])
def test_every_kind_of_teacher_config_is_json_that_builds_the_same_teachers(tmp_path, flags):
    """`to_json_string()` (TensorBoard's and W&B's callbacks call it as training starts) for every kind of teacher:
    the JSON fields given back to the config describe the same teachers."""
    args = config(tmp_path, **flags)
    written = json.loads(args.to_json_string())
    again = config(tmp_path, **{key: written[key] for key in flags})
    assert described(again) == described(args) and described(args)
    assert {key: getattr(again, key) for key in flags if key != "teachers"} == \
        {key: getattr(args, key) for key in flags if key != "teachers"}


def test_a_trainer_builds_its_teacher_through_the_registry(tiny_pair, tmp_path, monkeypatch):
    """Replacing the registered builder of a kind changes what the trainer gets: the kind is chosen there only."""
    built = []

    def build(spec, context):
        built.append((spec, context.settings.paths.model))
        return LiveTeacher(spec.model, None)

    monkeypatch.setitem(TEACHER_KINDS, "model", TeacherKind("model", LiveTeacher, build))
    args = config(tmp_path, teacher_model_name_or_path=tiny_pair["teacher"], max_steps=1, per_device_train_batch_size=2,
                  bf16=False, save_strategy="no", gradient_checkpointing=False)
    trainer = DistillationTrainer(model=tiny_pair["student"], args=args,
                                  train_dataset=synthetic_prompt_completion(4, seed=0))
    assert built == [(TeacherSpec("teacher", model=tiny_pair["teacher"]), tiny_pair["teacher"])]
    assert type(trainer.teacher) is LiveTeacher and trainer.teacher.tokenizer is None  # the stand-in's, untouched


def test_self_twice_in_a_teacher_list_is_one_line(tmp_path):
    assert [spec.kind for spec in resolve(config(tmp_path, teachers=["a=self", "b=/m"])).teachers] == ["self", "model"]
    with pytest.raises(ValueError, match=r"teachers: \['a', 'c'\] are all 'self': the student's base is one teacher"):
        resolve(config(tmp_path, teachers=["a=self", "b=/m", "c=self"]))


def test_the_registry_alone_names_the_kinds(monkeypatch):
    """A registered kind is one that a NAME=SOURCE entry, a spec and the support matrix know, by its form and its
    rows: there is no other table of kinds."""
    from trl_distill.teacher import support_matrix
    from trl_distill.teacher.kinds import SourceForm
    from trl_distill.teacher.specs import parse_teacher

    monkeypatch.setitem(TEACHER_KINDS, "echo", TeacherKind("echo", CachedTeacher, lambda spec, context: None,
                                                           form=SourceForm("server", prefixes=("echo://",))))
    spec = parse_teacher("e=echo://x")
    assert (spec.server, spec.kind, spec.entry()) == ("echo://x", "echo", "e=echo://x")
    assert [parse_teacher(f"t={source}").kind for source in ("http://h:8000", "cache:/c", "self", "/m")] == [
        "server", "cache", "self", "model"]
    assert list(support_matrix()) == ["live (ZeRO-3)", "self", "cache", "served (vLLM)", "echo", "cross-tokenizer"]
    assert support_matrix()["echo"] == support_matrix()["cache"]  # its class's refusals


def test_no_module_compares_a_kind_with_a_name():
    """The kinds are named in their registrations only: nothing compares a spec's `kind` with a name (an if-chain,
    a table); what a kind does differently is a field of its registration (`once`, `mixes`, `check_flags`...)."""
    import ast
    from pathlib import Path

    import trl_distill

    offenders = []
    for path in sorted(Path(trl_distill.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            sides = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            if any(isinstance(side, ast.Attribute) and side.attr == "kind" for side in sides) and any(
                    isinstance(side, ast.Constant | ast.Tuple | ast.List | ast.Set) for side in sides):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_a_teachers_own_fsdp2_settings_are_checked_before_anything_loads_and_are_their_own(tiny_pair, tmp_path):
    """Several teachers beside an FSDP2 student: an entry's ``fsdp`` (as `teacher_fsdp_config`) shards that teacher
    only; a bad one, one on a cache, and an entry's ``deepspeed`` beside an FSDP student are one line each."""
    from trl_distill.runtime.fsdp2 import TeacherShardSettings

    entry = {"name": "b", "model": tiny_pair["teacher"], "fsdp": {"reshard_after_forward": False}}
    args = config(tmp_path, teachers=["a=/m", entry], teacher_combine="sum")
    assert resolve(args).teachers[1].fsdp == {"reshard_after_forward": False}
    assert json.loads(args.to_json_string())["teachers"][1] == entry
    with pytest.raises(ValueError, match=r"^teachers: 'b': fsdp: unknown key\(s\) reshard; the keys are dtype, "
                                         r"reshard_after_forward\.$"):
        resolve(config(tmp_path, teachers=["a=/m", {**entry, "fsdp": {"reshard": True}}]))
    with pytest.raises(ValueError, match=r"^teachers: 'c' has `fsdp` settings, which shard a teacher model"):
        resolve(config(tmp_path, teachers=["a=/m", {"name": "c", "cache": "/c", "fsdp": {}}]))
    teacher = LiveTeacher(tiny_pair["teacher"])
    assert teacher.shard_settings() == TeacherShardSettings()
    teacher.fsdp_config, teacher.deepspeed_config, teacher.label = entry["fsdp"], {"zero_optimization": {}}, "teacher b"
    assert teacher.shard_settings() == TeacherShardSettings(reshard_after_forward=False)
    fsdp2 = config(tmp_path, fsdp="full_shard", fsdp_config={"fsdp_version": 2})
    with pytest.raises(ValueError, match=r"^teacher b's `deepspeed` is set beside an FSDP student, whose teachers are "
                                         r"sharded with FSDP2: give its settings as teacher b's `fsdp` instead\.$"):
        teacher.plugin(resolve(fsdp2).teacher_engine, None)
