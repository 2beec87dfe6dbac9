"""The one table of teacher kinds (`TEACHER_KINDS`), by name: the only place a kind is named.

Each kind registers (`register_kind`) its name, how its SOURCE is recognised (`SourceForm`: ``cache:DIR``, an
``http(s)://`` URL, ``self``, any other path or hub id), its class (whose refusals a run checks before building it),
its builder (``build(spec, context)``: the context a `registry.BuildContext`, the run's `settings.TeacherSettings`
and its student), and its rows of the support matrix. `specs.parse_teacher` and `specs.TeacherSpec.kind` ask it which
kind a SOURCE or a spec is (`kind_of_source`, `kind_of`); `registry.build_teacher` builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import TeacherSource

SOURCE_FIELDS = ("model", "cache", "server")
"""The fields of a `specs.TeacherSpec` that may hold a kind's source."""


@dataclass(frozen=True)
class SourceForm:
    """How a kind's SOURCE is written in a ``NAME=SOURCE`` entry and held in a spec: in `field`, recognised by one
    of `prefixes` (kept in the value, or `stripped`) or by being `exact`ly a word; with neither, any SOURCE (the
    fallback, tried after every other form)."""

    field: str = "model"
    prefixes: tuple[str, ...] = ()
    exact: str | None = None
    stripped: bool = False

    @property
    def fallback(self) -> bool:
        return not self.prefixes and self.exact is None

    def recognises(self, source: str) -> bool:
        """Whether a SOURCE as written (``cache:DIR``, a URL) is this form's (a model object: the fallback's)."""
        if not isinstance(source, str):
            return self.fallback
        return self.fallback or source == self.exact or source.startswith(self.prefixes)

    def value(self, source: str) -> str:
        """What the spec's `field` holds of a SOURCE this form recognises."""
        prefix = next((p for p in self.prefixes if source.startswith(p)), "") if self.stripped else ""
        return source[len(prefix):]

    def written(self, value: str) -> str:
        """The SOURCE as a ``NAME=SOURCE`` entry writes it."""
        return f"{self.prefixes[0]}{value}" if self.stripped else value


@dataclass(frozen=True)
class TeacherKind:
    """A registered kind: its class (whose refusals a run checks before building it), its builder
    ``build(spec, context)``, its `form`, and the rows it adds to the support matrix (`rows`: label -> class; by
    default one, its name: its class). `checked_early`: the arguments alone name its class, so its refusals of the
    modes they decide are checked as the config is built (a model waits for its tokenizer). `mixes`: it gives its
    whole distribution, which a mixture of teachers (``teacher_combine='mixture'``) can mix. `once`: several teachers
    list it at most once (the student's own base). `check_flags(spec, settings, use_peft)`: the CLI's checks of its
    flags that need no model (a model's path), from the run's `settings.TeacherSettings`."""

    name: str
    source_class: type[TeacherSource]
    build: Callable[[Any, Any], TeacherSource]
    form: SourceForm = field(default_factory=SourceForm)
    rows: tuple[tuple[str, type], ...] = ()
    checked_early: bool = False
    mixes: bool = False
    once: bool = False
    check_flags: Callable[[Any, Any, bool], None] | None = None

    def matrix_rows(self) -> tuple[tuple[str, type], ...]:
        return self.rows or ((self.name, self.source_class),)


TEACHER_KINDS: dict[str, TeacherKind] = {}


def register_kind(kind: TeacherKind) -> TeacherKind:
    """Make `kind` one a `specs.TeacherSpec` may have (and a ``NAME=SOURCE`` entry may name by its form)."""
    if kind.name in TEACHER_KINDS:
        raise ValueError(f"The teacher kind {kind.name!r} is registered already.")
    if kind.form.field not in SOURCE_FIELDS:
        raise ValueError(f"A teacher kind's source is held in one of {SOURCE_FIELDS}, not {kind.form.field!r}.")
    TEACHER_KINDS[kind.name] = kind
    return kind


def register_teacher_kind(name: str, source_class: type[TeacherSource], build: Callable[[Any, Any], TeacherSource],
                          **details) -> TeacherKind:
    """`register_kind` of ``TeacherKind(name, source_class, build, **details)``."""
    return register_kind(TeacherKind(name, source_class, build, **details))


def teacher_kind(name: str) -> TeacherKind:
    if name not in TEACHER_KINDS:
        raise ValueError(f"Unknown teacher kind {name!r}; registered: {', '.join(TEACHER_KINDS)}.")
    return TEACHER_KINDS[name]


def _in_order() -> list[TeacherKind]:
    """Every kind, those with a form of their own first (in the order registered), the fallbacks last."""
    kinds = list(TEACHER_KINDS.values())
    return [k for k in kinds if not k.form.fallback] + [k for k in kinds if k.form.fallback]


def kind_of_source(source: str) -> TeacherKind | None:
    """The kind whose form recognises a SOURCE as written in ``NAME=SOURCE``."""
    return next((kind for kind in _in_order() if kind.form.recognises(source)), None)


def kind_of(spec) -> TeacherKind:
    """The kind of a spec: of those whose field the spec sets, the first whose form recognises its value as written
    (the only one of that field when none does)."""
    candidates = [kind for kind in _in_order() if getattr(spec, kind.form.field, None)]
    for kind in candidates:
        if kind.form.recognises(kind.form.written(getattr(spec, kind.form.field))):
            return kind
    if len(candidates) == 1:
        return candidates[0]
    raise ValueError(f"teachers: {spec.name!r} names no registered kind of teacher "
                     f"({', '.join(TEACHER_KINDS)}).")


def support_rows() -> dict[str, type]:
    """Every kind's rows of the support matrix: each kind's own first, in the order registered, then the further
    rows a kind adds (the model's other tokenizer)."""
    firsts = [kind.matrix_rows()[0] for kind in TEACHER_KINDS.values()]
    rest = [row for kind in TEACHER_KINDS.values() for row in kind.matrix_rows()[1:]]
    return dict(firsts + rest)
