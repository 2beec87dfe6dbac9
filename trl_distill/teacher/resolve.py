"""Which teacher a run distils from: its description (`registry.describe`) built through the registry of kinds
(`resolve_teacher`), the kinds registered here, and the settings a kind refuses as the config is built
(`refuse_unsupported`)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from transformers import PreTrainedModel, TrainingArguments

from ..data.prepare import tokenizer_of
from ..rollout.objective_checks import refuse_own_text
from ..runtime.sequence_parallel import check_models_before_loading
from .base import TeacherSource
from .cached import CachedTeacher
from .capabilities import ChecksArgs, declares
from .cross_tokenizer import CrossTokenizerTeacher
from .kinds import SourceForm, register_teacher_kind, support_rows, teacher_kind
from .live import LiveTeacher
from .no_teacher import SFT_ONLY, NoTeacher
from .registry import BuildContext, build_teacher, describe
from .self_distill import SELF, SelfTeacher
from .served import ServedTeacher
from .settings import TeacherSettings
from .specs import TeacherSpec
from .support import ARGS_MODES, TEACHER_PROMPT_REFUSAL, matrix

if TYPE_CHECKING:
    from ..run_plan import RunPlan

logger = logging.getLogger(__name__)

def _model(spec: TeacherSpec, context: BuildContext) -> LiveTeacher:
    """A model: live, or cross-tokenizer when its tokenizer maps tokens to other ids than the student's."""
    source = _live_or_cross(spec.model, context.settings, context.student, context.processing_class,
                            spec.init_kwargs or None, context.attention)
    if spec.deepspeed is not None:
        source.deepspeed_config = spec.deepspeed
    if spec.fsdp is not None:
        source.fsdp_config = spec.fsdp
    return source


def _server(spec: TeacherSpec, context: BuildContext) -> ServedTeacher:
    settings = context.settings
    return ServedTeacher(spec.server, spec.served_model, settings.server_top_k, settings.server_timeout,
                         settings.server_concurrency)


def _self_flags(spec: TeacherSpec, settings: TeacherSettings, use_peft: bool) -> None:
    if not use_peft:
        flag = f"--teachers {spec.name}=self" if settings.several else "--teacher_model_name_or_path self"
        raise ValueError(f"{flag} (self-distillation: the teacher is the student's own base with its LoRA "
                         "adapters off) needs a LoRA student: add --use_peft.")


def _model_flags(spec: TeacherSpec, settings: TeacherSettings, use_peft: bool) -> None:
    from ..runtime.validation import check_model_path

    check_model_path(spec.model, f"--teachers {spec.name}" if settings.several else "--teacher_model_name_or_path")


# A model (any path or hub id): live, or of another tokenizer (the support matrix's last row)
register_teacher_kind("model", LiveTeacher, _model, mixes=True, check_flags=_model_flags,
                      rows=(("live (ZeRO-3)", LiveTeacher), ("cross-tokenizer", CrossTokenizerTeacher)))
register_teacher_kind("self", SelfTeacher, lambda spec, context: SelfTeacher(), form=SourceForm(exact=SELF),
                      once=True, check_flags=_self_flags)
register_teacher_kind("cache", CachedTeacher, lambda spec, context: CachedTeacher(spec.cache), checked_early=True,
                      form=SourceForm("cache", prefixes=("cache:",), stripped=True))
register_teacher_kind("server", ServedTeacher, _server, checked_early=True, rows=(("served (vLLM)", ServedTeacher),),
                      form=SourceForm("server", prefixes=("http://", "https://")))


def support_matrix() -> dict[str, dict[str, str]]:
    """Every registered kind against every mode: ``"yes"`` or ``"refused: <the message>"`` (the README's table)."""
    return matrix(support_rows())


def refuse_unsupported(args, settings: TeacherSettings) -> None:
    """As the config is resolved: one error for a setting the run's one teacher refuses, where the arguments alone
    name its kind (a cache, a server; a model's kind waits for its tokenizer) and the mode (`settings`: the plan's
    teacher part of `args`)."""
    if args.teachers is not None:
        return  # several: `specs.check_teachers` has checked what the arguments decide
    for spec in describe((), settings):
        if teacher_kind(spec.kind).checked_early:
            kind = teacher_kind(spec.kind).source_class
            if declares(kind, ChecksArgs):
                kind.check_args(args)
            for mode in settings.modes:
                if mode in ARGS_MODES and mode in kind.refused:
                    raise ValueError(kind.refused[mode])


def resolve_teacher(teacher_model, plan: RunPlan, *, student, processing_class, eval_dataset,
                    peft_config) -> TeacherSource:
    """The teacher this run distils from, its refusals checked: each spec `registry.describe` gives built by its
    kind (`TEACHER_KINDS`), several (the plan's `teachers`, mixed with its `teacher_weights`) as one
    `panel.TeacherPanel`, none (alpha 0) as `NoTeacher`."""
    on_policy = plan.on_policy  # a teacher object given: the own-text check the config's checks left to here
    refuse_own_text(plan.alpha, on_policy.lmbda, bool(on_policy.task_rewards.funcs), teacher_model is not None)
    if isinstance(teacher_model, TrainingArguments):
        raise TypeError("DistillationTrainer(model, teacher_model, args, ...): "
                        "the second positional argument is the teacher. Pass the training arguments by keyword, "
                        "`args=...`.")
    teachers, weights, settings = plan.teachers, plan.teacher_weights, plan.teacher_settings
    check_models_before_loading(plan.parallelism.sequence_parallel_size, student,  # (their heads, attention)
                                teacher_model if teacher_model is not None else settings.paths.model)
    peft = peft_config is not None or hasattr(student, "disable_adapter")
    _check_single_teacher_flags(teacher_model, settings, teachers)
    context = BuildContext(settings, student, processing_class, plan.parallelism.attn_implementation)
    specs = describe(teachers, settings, teacher_model)
    if teachers:
        return resolve_panel(specs, weights, context, eval_dataset, peft)
    if not specs and plan.alpha == 0:  # the SFT baseline: CE only, nothing to distil from
        NoTeacher.refuse(settings, eval_dataset=eval_dataset, peft=peft)
        logger.info(SFT_ONLY)
        return NoTeacher()
    if not specs:
        raise ValueError("No teacher: pass `teacher_model=` or set `teacher_model_name_or_path` in the config (or set "
                         "alpha=0 to train on the cross-entropy alone, as trl.SFTTrainer does).")
    teacher = build_teacher(specs[0], context, eval_dataset=eval_dataset, peft=peft)
    return teacher if settings.prompt is None else privileged(teacher, context)


def privileged(teacher: TeacherSource, context: BuildContext) -> TeacherSource:
    """`teacher` reading `teacher_prompt` in place of each row's prompt: a live teacher on the student's tokenizer,
    or a served one (`privileged.PrivilegedTeacher`); a teacher of another tokenizer renders it itself, as it
    prepares its rows."""
    from .privileged import PrivilegedTeacher

    if type(teacher) is CrossTokenizerTeacher:
        return teacher
    if type(teacher) not in (LiveTeacher, ServedTeacher):  # (each other kind refuses the mode itself)
        raise ValueError(TEACHER_PROMPT_REFUSAL)
    tokenizer = context.processing_class or tokenizer_of(context.student)
    return PrivilegedTeacher(teacher, context.settings.prompt, getattr(tokenizer, "tokenizer", tokenizer))


def _check_single_teacher_flags(teacher_model, settings: TeacherSettings, teachers: tuple[TeacherSpec, ...]) -> None:
    """What the trainer's `teacher_model` and the single-teacher flags cannot say together."""
    if teachers and teacher_model is not None:
        raise ValueError("Pass the teachers either as `teacher_model=` or as `args.teachers`, not both.")
    model = teacher_model if teacher_model is not None else settings.paths.model
    if settings.server is not None:
        if settings.paths.cache is not None:
            raise ValueError("Pass either --teacher_server (a served teacher) or --teacher_cache (a cache of it) for "
                             "training, not both; `cache-teacher --teacher_server URL --teacher_cache DIR` writes the "
                             "cache from the server.")
        if model is not None and not isinstance(model, str):
            raise ValueError("With teacher_server the teacher runs on the server: pass its served name (a string) or "
                             "nothing as the teacher, not a model.")
    elif settings.paths.cache is not None and model is not None:
        logger.warning("Training from the teacher cache %s: the teacher %s is not loaded.", settings.paths.cache,
                       model if isinstance(model, str) else "model")


def resolve_panel(specs: list[TeacherSpec], weights: tuple[float, ...] | None, context: BuildContext, eval_dataset,
                  peft: bool) -> TeacherSource:
    """Several teachers (`specs.TeacherSpec` entries, checked as the config was built) mixed with `weights` as one
    `panel.TeacherPanel`, each built by its kind with its refusals checked; one may have another tokenizer than the
    student's (routed or summed)."""
    from .panel import TeacherPanel

    settings = context.settings
    members = {spec.name: build_teacher(spec, context, eval_dataset=eval_dataset, peft=peft) for spec in specs}
    foreign = [name for name, member in members.items() if isinstance(member, CrossTokenizerTeacher)]
    if len(foreign) > 1 or foreign and settings.combine == "mixture":
        raise ValueError(f"The teachers {foreign} have another tokenizer than the student's; "
                         + ("a mixture of distributions needs one vocabulary: every teacher must share the student's "
                            "tokenizer (or use --teacher_combine route or sum)." if len(foreign) == 1 else
                            "routed or summed, at most one teacher may have its own tokenizer (the others must share "
                            "the student's)."))
    return TeacherPanel(members, settings.combine, None if weights is None else list(weights), settings.column)


def _live_or_cross(teacher_model, settings: TeacherSettings, student, processing_class, init_kwargs=None,
                   attention=None) -> LiveTeacher:
    """A `LiveTeacher` with its own tokenizer (when it has one), or a `CrossTokenizerTeacher` when that tokenizer
    maps tokens to other ids than the student's (or `settings.cross_tokenizer` says so); loaded with `attention`
    (sequence parallelism's) unless its own kwargs name one."""
    init_kwargs = settings.init_kwargs if init_kwargs is None else init_kwargs
    if attention is not None:
        init_kwargs = {"attn_implementation": attention, **(init_kwargs or {})}
    live = LiveTeacher(teacher_model, init_kwargs)
    tokenizer = load_teacher_tokenizer(settings.paths.tokenizer, live.source)
    mine = processing_class or tokenizer_of(student) if tokenizer is not None else None
    if mine is not None and wants_cross_tokenizer(settings.cross_tokenizer, mine, tokenizer):
        return CrossTokenizerTeacher(live.source, init_kwargs, mine, tokenizer, settings)
    live.tokenizer = tokenizer
    return live


# The files `AutoTokenizer` reads from a directory (any one of them makes it a tokenizer directory)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")


def load_teacher_tokenizer(path: str | None, source: str | PreTrainedModel):
    """The teacher's tokenizer: `path` (`teacher_tokenizer_name_or_path`), else the one saved with the teacher; None
    when there is none to load (a model object without a tokenizer path; a teacher directory with no tokenizer file
    at all, with a warning). A tokenizer file there that cannot be read or parsed is one error naming it: the run
    must not go on assuming the student's ids for a teacher that has its own."""
    from transformers import AutoTokenizer

    if path is None and not isinstance(source, str | os.PathLike):
        return None
    if path is None:
        where, flag = os.fspath(source), "--teacher_model_name_or_path"
    else:
        where, flag = path, "--teacher_tokenizer_name_or_path"
    local = os.path.isdir(where)
    if local:
        present = [name for name in TOKENIZER_FILES if os.path.exists(os.path.join(where, name))]
        if not present and path is None:
            logger.warning("The teacher directory %s has no tokenizer files: assuming the teacher uses the student's "
                           "tokenizer. Pass --teacher_tokenizer_name_or_path if it has its own.", where)
            return None
        for name in present:
            _check_tokenizer_file(os.path.join(where, name), flag)
    try:
        return AutoTokenizer.from_pretrained(where)
    except Exception as error:  # noqa: BLE001 - tokenizers raises its own exception types; each is one line here
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if not local and path is None and isinstance(error, OSError):
            logger.warning("No tokenizer for the teacher %s (%s): assuming it uses the student's tokenizer.", where,
                           detail)
            return None
        raise ValueError(f"{flag}: cannot load the teacher's tokenizer from {where!r} ({detail}). Re-save it with "
                         "`save_pretrained`, or pass --teacher_tokenizer_name_or_path.") from error


def _check_tokenizer_file(path: str, flag: str) -> None:
    """A tokenizer file is readable and, when JSON, parses (``tokenizer.json`` as a `tokenizers.Tokenizer` too)."""
    import json

    fix = "Re-save the teacher's tokenizer with `save_pretrained`, or pass --teacher_tokenizer_name_or_path."
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise ValueError(f"{flag}: cannot read the tokenizer file {path} ({error.strerror or error}). {fix}") from error
    if not path.endswith(".json"):
        return
    try:
        json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{flag}: the tokenizer file {path} is not valid JSON ({error}). {fix}") from error
    if os.path.basename(path) == "tokenizer.json":
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as error:  # noqa: BLE001 - the Rust parser's own exception type
            detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"{flag}: the tokenizer file {path} cannot be parsed ({detail}). {fix}") from error


def wants_cross_tokenizer(cross_tokenizer: bool | None, student_tokenizer, teacher_tokenizer) -> bool:
    """Whether to distil across tokenizers: as `cross_tokenizer` (the field) says, else when their vocabularies
    differ."""
    if cross_tokenizer is not None:
        if cross_tokenizer and teacher_tokenizer is None:
            raise ValueError("cross_tokenizer=True needs the teacher's tokenizer: set teacher_tokenizer_name_or_path.")
        return cross_tokenizer
    return teacher_tokenizer is not None and student_tokenizer.get_vocab() != teacher_tokenizer.get_vocab()


def check_teacher_flags(teachers: tuple[TeacherSpec, ...], args, use_peft: bool) -> None:
    """The CLI's checks of the teacher flags that need no model (each kind's `check_flags`), several `teachers` (the
    run plan's) or the one of `args`: fail in seconds, before anything is loaded."""
    settings = TeacherSettings.of(args)
    specs = describe(teachers, settings)
    if not specs:
        if args.alpha == 0:
            return  # cross-entropy only, as trl.SFTTrainer trains (`no_teacher`)
        raise ValueError("Pass the teacher with --teacher_model_name_or_path (or a cache of it with --teacher_cache, "
                         "or a vLLM server of it with --teacher_server), or several with --teachers NAME=SOURCE ... "
                         "(--alpha 0 trains on the cross-entropy alone, without a teacher).")
    for spec in specs:  # a cache or a server: no model is loaded here (with a server the name is the served one)
        check = teacher_kind(spec.kind).check_flags
        if check is not None:
            check(spec, settings, use_peft)


def check_cacheable_teacher(args) -> None:
    """`cache-teacher` needs a teacher model or server to write from."""
    if args.teacher_model_name_or_path == SELF and not args.teacher_server:
        raise ValueError("--teacher_model_name_or_path self is a LoRA student's own base, which runs inside training: "
                         "there is no teacher to cache. Train with it (--use_peft), or cache the base model itself "
                         "(pass its path as --teacher_model_name_or_path).")
    if args.teacher_model_name_or_path is None and not args.teacher_server:
        raise ValueError("Pass the teacher to cache with --teacher_model_name_or_path (or its vLLM server with "
                         "--teacher_server URL).")
