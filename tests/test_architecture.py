"""The package's shape, read from its source with `ast`: no import cycle among trl_distill modules, no module importing
another's private name, no file over 450 lines (the trainer under 300), and no branching on the kind of teacher
outside the teacher package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trl_distill"
KIND_NAMES = {"LiveTeacher", "SelfTeacher", "CachedTeacher", "ServedTeacher", "CrossTokenizerTeacher", "SELF",
              "TeacherCache", "TeacherServerClient"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every `from X import names` / `import X` in module `name`, at any depth, resolved."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return found


def internal_edges(name: str) -> set[str]:
    """The trl_distill modules `name` imports (a `from pkg import module` counts as that module)."""
    edges = set()
    for target, names in imports(name):
        if not target.startswith("trl_distill"):
            continue
        submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
        edges.update(submodules or ([target] if target in MODULES else []))
    return edges - {name}


def type_checking_lines(path: Path) -> set[int]:
    """Lines inside `if TYPE_CHECKING:` blocks (imports for annotations only, never run)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def runtime_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        skip = type_checking_lines(path)
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom | ast.Import) and node.lineno not in skip:
                graph[name] |= {t for t in internal_edges(name) if _imports_target(node, name, t)}
    return graph


def _imports_target(node, name: str, target: str) -> bool:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    if isinstance(node, ast.Import):
        return any(alias.name == target for alias in node.names)
    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
    module = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
    return target == module or any(target == f"{module}.{alias.name}" for alias in node.names)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_trl_distill_modules():
    """A package `__init__` importing its own submodules is the package itself, not a cycle: edges into a package
    from inside it are left out."""
    graph = runtime_graph()
    for name in graph:
        graph[name] = {t for t in graph[name] if not (MODULES[t].name == "__init__.py" and name.startswith(t + "."))}
    assert find_cycle(graph) is None, find_cycle(graph)


def test_no_module_imports_another_modules_private_name():
    offenders = []
    for name in MODULES:
        for target, names in imports(name):
            if target.startswith("trl_distill") and target != name:
                offenders += [f"{name}: from {target} import {n}" for n in names
                              if n.startswith("_") and not n.startswith("__")]
    assert offenders == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_file_over_450_lines(name):
    """The usual cap for the trainer too: its own 300-line cap pushed its work into modules that took it and changed
    it (issue 42)."""
    assert len(MODULES[name].read_text().splitlines()) <= 450


def test_no_branch_on_the_kind_of_teacher_outside_the_teacher_package():
    """No `isinstance(..., <a teacher kind>)` and no `== "self"` outside `trl_distill.teacher`."""
    offenders = []
    for name, path in MODULES.items():
        if name.startswith("trl_distill.teacher"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                offenders += [f"{name}:{node.lineno} isinstance {sorted(named & KIND_NAMES)}"] if named & KIND_NAMES \
                    else []
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "self"
                                                     for c in node.comparators):
                offenders.append(f"{name}:{node.lineno} == 'self'")
    assert offenders == []


def test_the_trainer_never_names_a_kind_of_teacher():
    source = MODULES["trl_distill.trainer"].read_text()
    assert not [kind for kind in KIND_NAMES if kind in source]


def test_only_the_trainer_sets_its_collator():
    """The collators are composed once, in the trainer, in a stated order: a teacher kind returns `collator(base)`,
    sequence parallelism likewise; no module reassigns ``data_collator`` (issue 42)."""
    offenders = [f"{name}:{node.lineno}" for name, path in MODULES.items() if name != "trl_distill.trainer"
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assign | ast.AugAssign)
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(target, ast.Attribute) and target.attr == "data_collator"]
    assert offenders == []


def test_the_loss_reads_only_declared_members_of_a_teacher_signal():
    """Every member the fused loss reads of a teacher signal or a teacher batch is declared on their abstract bases
    (`loss.signal.TeacherSignal`, `teacher.base.TeacherBatch`): no `getattr` / `hasattr` probes them (issue 42)."""
    probed = {"signal", "teacher", "batch", "chunks"}
    offenders = [f"{name}:{node.lineno}" for name, path in MODULES.items()
                 if name == "trl_distill.trainer" or name.startswith(("trl_distill.loss", "trl_distill.teacher"))
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                 and isinstance(node.args[0], ast.Name) and node.args[0].id in probed]
    assert offenders == []


def holds_the_trainer(tree: ast.AST) -> list[int]:
    """The lines that store the trainer (``x.trainer = ...``) or take it (a parameter named ``trainer``, or one
    annotated as a trainer)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "trainer"
                                                for t in node.targets):
            lines.append(node.lineno)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg == "trainer" or "Trainer" in annotation:
                    lines.append(node.lineno)
    return lines


def trainer_attributes() -> set[str]:
    """What the trainer keeps on itself: every ``self.X = ...`` of trainer.py, and the HF Trainer's members that a
    collaborator might be tempted to replace."""
    names = {"data_collator", "train_dataset", "eval_dataset", "model_wrapped", "is_deepspeed_enabled", "deepspeed",
             "optimizer", "lr_scheduler", "processing_class"}  # (not `model`, `args`: names every client uses)
    for node in ast.walk(ast.parse(MODULES["trl_distill.trainer"].read_text())):
        for target in node.targets if isinstance(node, ast.Assign) else []:
            for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


def assigns_a_trainer_attribute(tree: ast.AST, names: set[str]) -> list[int]:
    """The lines that assign a trainer's attribute from outside it: ``trainer.X = ...`` (or ``x.trainer.X``), or
    ``obj.X = ...`` for an attribute the trainer keeps (not ``self.X``: an object's own), or
    ``setattr(trainer, ...)``."""
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign | ast.AnnAssign) else []
        for target in targets:
            for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                if not isinstance(leaf, ast.Attribute):
                    continue
                owner = ast.unparse(leaf.value)
                if owner == "trainer" or owner.endswith(".trainer") or (owner != "self" and leaf.attr in names):
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args and \
                ast.unparse(node.args[0]).split(".")[-1] == "trainer":
            lines.append(node.lineno)
    return lines


def test_no_module_but_the_trainer_takes_or_stores_the_trainer_or_changes_it():
    """Collaborators receive a `runtime.context.RunContext` (arguments, accelerator, student, collator, tokenizer,
    vocabulary, logit paths, step, training, logger), not the trainer, and never change it (issue 42). No HF
    callback of ours needs it either (`TrainerCallback`s get the state and the model), so nothing is allowed."""
    names = trainer_attributes()
    holding = {name: lines for name, path in MODULES.items() if name != "trl_distill.trainer"
               for lines in [holds_the_trainer(ast.parse(path.read_text()))] if lines}
    changing = {name: lines for name, path in MODULES.items() if name != "trl_distill.trainer"
                for lines in [assigns_a_trainer_attribute(ast.parse(path.read_text()), names)] if lines}
    assert holding == {} and changing == {}
    assert holds_the_trainer(ast.parse("class A:\n    def __init__(self, trainer):\n        self.trainer = trainer\n"))
    assert holds_the_trainer(ast.parse("def f(run: 'DistillationTrainer'):\n    pass\n"))
    for source in ("trainer.train_dataset = d", "self.trainer.data_collator = c", "context.sequence_parallel_scope = s",
                   "setattr(self.trainer, 'x', 1)", "x.logit_paths, y = a, b"):
        assert assigns_a_trainer_attribute(ast.parse(source), names), source
    assert not assigns_a_trainer_attribute(ast.parse("self.model = m\nargs.save_total_limit = None"), names)
