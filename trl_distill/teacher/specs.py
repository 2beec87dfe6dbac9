"""Several teachers, as the config names them (`DistillationConfig.teachers`): each entry parsed into a
`TeacherSpec`, and every setting of theirs checked as the config is built, before anything loads.

An entry is ``"NAME=SOURCE"`` (the command line, a recipe's list) or a dict (Python, a recipe). SOURCE is a path or
hub id (a live teacher: its own ZeRO-3 plugin under DeepSpeed), ``cache:DIR`` (a teacher cache written by
`trl-distill cache-teacher`) or an ``http(s)://`` URL (a vLLM server of the teacher). A dict has ``name`` and one of
``model`` / ``cache`` / ``server``, and may add ``deepspeed`` (that teacher's own DeepSpeed config), ``fsdp`` (its
own FSDP2 settings beside an FSDP2 student, as `teacher_fsdp_config`), ``init_kwargs`` (its `from_pretrained` keyword
arguments) and ``served_model`` (the server's model name).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from .capabilities import ChecksArgs, declares
from .kinds import SOURCE_FIELDS, kind_of, kind_of_source, teacher_kind

COMBINE = ("route", "mixture", "sum")
"""How several teachers' signals make one loss (`loss.combined`)."""
TEACHER_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""What a teacher may be called (it names the teacher in the routing column, the logs and `--dataset_name`)."""
_KEYS = {"name", "model", "cache", "server", "served_model", "deepspeed", "fsdp", "init_kwargs"}
SINGLE = "teacher"
"""The name of a run's one teacher (given by the single-teacher flags), as a spec."""


@dataclass
class TeacherSpec:
    """One teacher of several: its name (what the routing column holds, what its logs are called) and its source."""

    name: str
    model: str | None = None
    cache: str | None = None
    server: str | None = None
    served_model: str | None = None
    deepspeed: dict | str | None = None
    fsdp: dict | str | None = None
    init_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """Its entry in `kinds.TEACHER_KINDS` (e.g. ``cache``, ``server``, ``self`` or ``model``), as the registry
        recognises it."""
        return kind_of(self).name

    @property
    def source(self) -> str:
        """What holds its source (the field its kind reads)."""
        return getattr(self, kind_of(self).form.field)

    def as_dict(self) -> dict:
        """The dict form of this entry (what `parse_teacher` reads back), only the fields that are set: what
        `DistillationConfig.to_dict` writes, and so the JSON that logging callbacks record."""
        return {key: value for key, value in vars(self).items() if value not in (None, {})}

    def entry(self) -> str:
        """The ``NAME=SOURCE`` form (what a run record holds)."""
        return f"{self.name}={kind_of(self).form.written(self.source)}"


def parse_teacher(entry) -> TeacherSpec:
    """One entry of `teachers` (``"NAME=SOURCE"`` or a dict), or one `ValueError` naming the fix."""
    if isinstance(entry, TeacherSpec):
        return entry
    if isinstance(entry, str):
        name, sep, source = entry.partition("=")
        if not sep or not source:
            raise ValueError(f"teachers: {entry!r} is not NAME=SOURCE (e.g. math=./math-teacher, code=cache:./code-"
                             "cache, big=http://teacher-host:8000).")
        form = kind_of_source(source).form
        return _checked(TeacherSpec(name.strip(), **{form.field: form.value(source)}))
    if isinstance(entry, dict):
        unknown = set(entry) - _KEYS
        if unknown:
            raise ValueError(f"teachers: {entry!r} has unknown keys {sorted(unknown)}; an entry takes "
                             f"{sorted(_KEYS)}.")
        sources = [key for key in SOURCE_FIELDS if entry.get(key)]
        if len(sources) != 1 or not entry.get("name"):
            raise ValueError(f"teachers: {entry!r} needs a name and exactly one of model, cache or server.")
        return _checked(TeacherSpec(**{k: v for k, v in entry.items() if v is not None}))
    raise ValueError(f"teachers: an entry is NAME=SOURCE or a dict, got {type(entry).__name__}.")


def _checked(spec: TeacherSpec) -> TeacherSpec:
    if not TEACHER_NAME.fullmatch(spec.name):
        raise ValueError(f"teachers: the name {spec.name!r} must be letters, digits, '_', '.' or '-' (it names the "
                         "teacher in the routing column and in the logs).")
    if spec.fsdp is not None:
        from ..runtime.fsdp2 import TeacherShardSettings

        if not spec.model:
            raise ValueError(f"teachers: {spec.name!r} has `fsdp` settings, which shard a teacher model; a cache or "
                             "a server has nothing to shard. Drop its `fsdp`.")
        try:
            TeacherShardSettings.parse(spec.fsdp)
        except ValueError as error:
            raise ValueError(f"teachers: {spec.name!r}: {error}".replace("teacher_fsdp_config", "fsdp")) from None
    return spec


def parse_teachers(entries) -> tuple[TeacherSpec, ...]:
    """`teachers` as the config holds it (a list of entries, or one entry) parsed into specs; () for None."""
    if entries is None:
        return ()
    if isinstance(entries, str | dict | TeacherSpec):
        entries = [entries]
    return tuple(parse_teacher(entry) for entry in entries)


def check_teachers(args) -> tuple[tuple[TeacherSpec, ...], tuple[float, ...] | None]:
    """Every setting of several teachers that needs no model, checked as the config is built (one line each); the
    teachers as `TeacherSpec` entries and their weights for mixing (equal unless given; None when routed or one
    teacher). `args` stays as written."""
    if args.teachers is None:
        if args.teacher_weights is not None:
            raise ValueError("teacher_weights weight several teachers: list them with --teachers NAME=SOURCE ...")
        return (), None
    specs = parse_teachers(args.teachers)
    if not specs:
        raise ValueError("teachers is empty: list at least one NAME=SOURCE, or pass one teacher with "
                         "--teacher_model_name_or_path.")
    kinds = [teacher_kind(spec.kind) for spec in specs]
    selves = [spec.name for spec, kind in zip(specs, kinds, strict=True) if kind.once]
    if len(selves) > 1:
        raise ValueError(f"teachers: {selves} are all 'self': the student's base is one teacher; list it once.")
    names = [spec.name for spec in specs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"teachers: the names {twice} are given twice; each teacher needs its own name.")
    single = [flag for flag in ("teacher_model_name_or_path", "teacher_cache", "teacher_server") if getattr(args, flag)]
    if single:
        raise ValueError(f"Pass the teachers either as a list (--teachers) or as one teacher (--{single[0]}), not "
                         "both.")
    if args.teacher_combine not in COMBINE:
        raise ValueError(f"teacher_combine must be one of {', '.join(COMBINE)}, got {args.teacher_combine!r}.")
    weights = _weights(args.teacher_weights, specs, args.teacher_combine)
    if args.teacher_combine == "mixture":
        sparse = [spec.name for spec, kind in zip(specs, kinds, strict=True) if not kind.mixes]
        if sparse:
            raise ValueError(f"teacher_combine='mixture' mixes the teachers' whole distributions, and {sparse} give "
                             "their top-k only (a cache or a server): use --teacher_combine sum (the weighted sum of "
                             "divergences) or list live teachers.")
    if args.seq_kd:
        raise ValueError("seq_kd samples the completions from the teacher, and several teach: which one samples is "
                         "not defined. Set seq_kd=False (on-policy, lmbda > 0, takes several teachers), or name one "
                         "teacher.")
    cached = [spec.name for spec, kind in zip(specs, kinds, strict=True) if "on-policy" in kind.source_class.refused]
    if args.lmbda > 0 and cached:
        raise ValueError(f"On-policy distillation (lmbda > 0) scores the student's own samples, and the teachers "
                         f"{cached} are caches of the dataset's completions only: list their models or servers "
                         "instead, or set lmbda=0.")
    if args.teacher_combine == "route" and (args.packing or args.padding_free):
        raise ValueError("Routing rows to teachers needs one example per row: set packing=False and padding_free="
                         "False, or mix the teachers (--teacher_combine mixture or sum).")
    for kind in dict.fromkeys(kinds):  # each kind's own checks, once
        if declares(kind.source_class, ChecksArgs):
            kind.source_class.check_args(args)
    return specs, None if weights is None else tuple(weights)


def _weights(weights, specs: tuple[TeacherSpec, ...], combine: str) -> list[float] | None:
    if combine == "route":
        if weights is not None:
            raise ValueError("teacher_weights weight a mixture of teachers; routing takes each row's teacher from the "
                             "routing column. Drop --teacher_weights, or set --teacher_combine mixture or sum.")
        return None
    if weights is None:
        return [1.0 / len(specs)] * len(specs)
    weights = [float(w) for w in weights]
    if len(weights) != len(specs):
        raise ValueError(f"teacher_weights has {len(weights)} weights for {len(specs)} teachers: give one per "
                         "teacher, in the order of --teachers.")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"teacher_weights must be finite and >= 0, got {weights}.")
    if combine == "mixture" and abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"teacher_weights of a mixture are the probabilities of its teachers and must sum to 1; "
                         f"{weights} sum to {sum(weights):.6g}.")
    if not sum(weights) > 0:
        raise ValueError(f"teacher_weights are all 0: at least one teacher must teach, got {weights}.")
    return weights


def written_teachers(teachers, weights, combine: str) -> tuple[list | None, list | None]:
    """`teachers` and `teacher_weights` as `DistillationConfig.to_dict` writes them, JSON that builds the same run:
    each entry in its dict form, and the weights a mixture or sum uses (equal unless given). Entries that do not
    parse are written as given (building the config from them refuses them)."""
    try:
        specs = parse_teachers(teachers)
    except ValueError:
        return teachers, weights
    if combine in ("mixture", "sum") and specs:
        try:
            weights = [1.0 / len(specs)] * len(specs) if weights is None else [float(w) for w in weights]
        except (TypeError, ValueError):
            pass  # written as given; `check_teachers` names what is wrong
    return [spec.as_dict() for spec in specs] if specs else teachers, weights
