"""Functions receive the typed part of the run plan they use, not the whole config (issue 57): a function of
`trl_distill` whose first parameter (after ``self`` / ``cls``) is ``args`` is one of those listed here, each with
why it takes the config; and a check of the config runs only from `run_plan.resolve`, as the config is built, or from
another such check, never from the trainer at run time."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "trl_distill"

CHECK = "a check of the config (or a value its checks share), run by run_plan.resolve"
BUILT = "part of building the config (DistillationConfig.__post_init__ / _setup_devices), which it writes"
# {"module:function": why it takes the whole config}
ALLOWED = {
    "run_plan.py:resolve": "the one place the config becomes the plan",
    "run_plan.py:_check_schedule": CHECK,
    "run_plan.py:_plan": "builds the plan's parts from the checked config",
    "evaluation/checks.py:check_generation_eval_args": CHECK,
    "rollout/engine_checks.py:check_engine_args": CHECK,
    "rollout/objective_checks.py:check_objective_args": CHECK,
    "runtime/guards.py:check_guard_args": CHECK,
    "runtime/sequence_parallel.py:check_sequence_parallel_args": CHECK + "; writes what accelerate and SFTTrainer "
                                                                          "read from the config",
    "runtime/sequence_parallel.py:_refusals": CHECK,
    "runtime/sequence_parallel.py:sequence_parallel_size": CHECK + " (the field or accelerate's parallelism_config)",
    "runtime/sequence_parallel.py:attention_implementation": CHECK + " (the field or accelerate's handler)",
    "teacher/privileged.py:check_teacher_prompt_args": CHECK,
    "teacher/resolve.py:refuse_unsupported": CHECK,
    "teacher/specs.py:check_teachers": CHECK + "; parses several teachers into the plan's specs",
    "teacher/support.py:active_modes": CHECK + " (and the plan's TeacherSettings.modes, which the kinds' refusals "
                                       "read)",
    "teacher/capabilities.py:ChecksArgs.check_args": CHECK + " (refuse_unsupported, per kind)",
    "teacher/served.py:ServedTeacher.check_args": CHECK + " (refuse_unsupported, per kind)",
    "teacher/resolve.py:check_cacheable_teacher": "a check of the config by `trl-distill cache-teacher`, before it "
                                                  "rewrites the config for the caching run",
    "config_checks.py:check_each_field": "__post_init__'s single-field checks",
    "config_checks.py:_check_counts": "__post_init__'s single-field checks",
    "runtime/guards.py:check_finite_settings": "__post_init__'s single-field checks",
    "config_checks.py:settle_for_transformers": BUILT,
    "config_checks.py:_use_activation_checkpointing_names": BUILT,
    "model/precision.py:settle_precision": BUILT,
    "runtime/distributed.py:prepare_cpu_distributed_state": BUILT,
    "runtime/distributed.py:_deepspeed_requested": BUILT,
    "config.py:as_distillation_config": "makes a DistillationConfig of a stock TrainingArguments",
    "runtime/log_setup.py:setup_logging": "TrainingArguments.get_process_log_level's rule: its levels and should_log",
    "runtime/log_setup.py:process_log_level": "TrainingArguments.get_process_log_level's rule",
    "runtime/run_lock.py:refuse_if_locked": "collective: the config's device and distributed_state",
    "runtime/run_lock.py:take_run_lock": "collective: the config's device and distributed_state",
    "runtime/run_lock.py:_collective": "collective: the config's device and distributed_state",
    "loss/settings.py:LossSettings.of": "builds the plan's loss part (and the step's, from the config as it is now)",
    "teacher/settings.py:TeacherSettings.of": "builds the plan's teacher part (and, for its check before the plan, "
                                              "the CLI's check_teacher_flags')",
    "loss/sampled_token.py:SampledTokenSettings.of": "builds the plan's sampled-token part (OnPolicyPlan)",
    "rollout/sampling.py:Sampling.from_args": "builds the plan's sampling part",
    "cli/plan.py:_specs": "`trl-distill plan`'s own PlanArguments, not a DistillationConfig",
}
CHECKS = {key for key, why in ALLOWED.items() if why.startswith((CHECK, "__post_init__"))} - {"run_plan.py:resolve"}


def _functions():
    """``{"module:qualname": (node, enclosing "module:qualname" of each call it makes)}`` over the package."""
    found = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found[f"{prefix}{child.name}"] = child
                visit(child, f"{prefix}{child.name}.")

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text()), f"{path.relative_to(PACKAGE).as_posix()}:")
    return found


def _takes_the_config(node) -> bool:
    params = [a.arg for a in node.args.posonlyargs + node.args.args]
    params = params[1:] if params and params[0] in ("self", "cls") else params
    hf_callback = node.name.startswith("on_") and params[:3] == ["args", "state", "control"]  # TrainerCallback's
    return bool(params) and params[0] == "args" and not hf_callback


def _called_names(node) -> set[str]:
    """The names `node` calls itself (a function or method name), not those its nested functions call."""
    names, todo = set(), list(ast.iter_child_nodes(node))
    while todo:
        child = todo.pop()
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if isinstance(child, ast.Call) and isinstance(child.func, ast.Name | ast.Attribute):
            names.add(child.func.id if isinstance(child.func, ast.Name) else child.func.attr)
        todo.extend(ast.iter_child_nodes(child))
    return names


def test_only_the_listed_functions_take_the_whole_config():
    functions = _functions()
    taking = {key for key, node in functions.items() if _takes_the_config(node)}
    assert sorted(taking - ALLOWED.keys()) == [], "take a typed part of the run plan (run_plan.RunPlan) instead"
    assert sorted(ALLOWED.keys() - taking) == []  # (the list stays that of what takes the config)
    assert len(ALLOWED) == 37


def test_the_checks_of_the_config_run_from_resolve_or_as_it_is_built():
    """Each caller of a check is itself a listed function (resolve, a check, the config's building): the trainer
    and the other run-time code read the plan."""
    functions = _functions()
    names = {key.rsplit(":", 1)[1].rsplit(".", 1)[-1] for key in CHECKS}
    building = {"config.py:DistillationConfig.__post_init__", "config.py:DistillationConfig._setup_devices"}
    callers = {name: sorted(key for key, node in functions.items() if name in _called_names(node)) for name in names}
    outside = {name: [key for key in keys if key not in ALLOWED.keys() | building] for name, keys in callers.items()}
    assert {name: keys for name, keys in outside.items() if keys} == {}
    assert callers["check_sequence_parallel_args"] == ["run_plan.py:resolve"]
    assert callers["check_each_field"] == ["config.py:DistillationConfig.__post_init__"]
    assert not names & _called_names(functions["trainer.py:DistillationTrainer.__init__"])
