"""The teacher interface's shape (`trl_distill.teacher.base`, `capabilities`): a narrow core every kind implements,
each further capability declared one by one, and wrappers that have every capability of what they wrap without a
hand-written forwarding method (a hook forgotten in a wrapper used to fall silently to a base default)."""

from __future__ import annotations

from typing import Protocol

import pytest

from trl_distill.teacher import capabilities
from trl_distill.teacher.base import TeacherSource
from trl_distill.teacher.cached import CachedTeacher
from trl_distill.teacher.capabilities import CAPABILITIES
from trl_distill.teacher.cross_tokenizer import CrossTokenizerTeacher
from trl_distill.teacher.live import LiveTeacher
from trl_distill.teacher.no_teacher import NoTeacher
from trl_distill.teacher.panel import TeacherPanel
from trl_distill.teacher.privileged import PrivilegedTeacher
from trl_distill.teacher.self_distill import SelfTeacher
from trl_distill.teacher.served import ServedTeacher

KINDS = (LiveTeacher, SelfTeacher, CachedTeacher, ServedTeacher, CrossTokenizerTeacher, NoTeacher)


def bare(kind: type) -> TeacherSource:
    """An instance of `kind` with nothing loaded (its capabilities are its class's)."""
    return object.__new__(kind)


def test_the_core_has_at_most_twelve_public_members():
    core = [m for m in dir(TeacherSource) if not m.startswith("_")]
    assert len(core) <= 12, core
    assert sorted(core) == ["attach", "capability", "context", "describe", "for_batch", "name", "prepare", "refuse",
                            "refused", "release"]


def test_every_capability_is_a_protocol_listed_once():
    defined = [value for value in vars(capabilities).values()
               if isinstance(value, type) and issubclass(value, Protocol) and value is not Protocol
               and value.__module__ == capabilities.__name__]
    assert sorted(c.__name__ for c in defined) == sorted(c.__name__ for c in CAPABILITIES)
    assert len(set(CAPABILITIES)) == len(CAPABILITIES) == 16


def test_each_kind_declares_what_it_does():
    has = {kind.__name__: sorted(c.__name__ for c in CAPABILITIES if bare(kind).capability(c) is not None)
           for kind in KINDS}
    assert has == {
        "LiveTeacher": ["LogitChecked", "OwnEngine", "OwnRows", "OwnVocabulary", "Samples", "ScoresSamples",
                        "StepHooks", "WritesCache"],
        "SelfTeacher": ["OwnRows", "Samples", "ScoresSamples"],
        "CachedTeacher": ["OwnBatch", "TrainRows"],
        "ServedTeacher": ["ChecksArgs", "OwnBatch", "OwnRows", "SamplingServer", "ScoresSamples", "WritesCache"],
        "CrossTokenizerTeacher": ["LogitChecked", "OwnBatch", "OwnEngine", "OwnRows", "OwnVocabulary",
                                  "PreparesDataset", "RoutesRows", "Samples", "ScoresSamples", "StepHooks",
                                  "StudentTokenizer"],  # (not WritesCache: a cache holds the student's ids)
        "NoTeacher": [],
    }


@pytest.mark.parametrize("inner", [LiveTeacher, ServedTeacher, SelfTeacher, CachedTeacher, CrossTokenizerTeacher])
def test_a_privileged_teacher_has_every_capability_of_the_teacher_it_wraps(inner):
    """The forgotten hook: whatever `inner` can do, the wrapper can, handed through to `inner` itself unless the
    wrapper changes it (then its own method, which asks `inner`), or withholds it on purpose."""
    wrapped = bare(inner)
    teacher = PrivilegedTeacher(wrapped, "{prompt}", tokenizer=None)
    assert set(PrivilegedTeacher.adds) | set(PrivilegedTeacher.changes) | set(PrivilegedTeacher.withholds) \
        <= set(CAPABILITIES)
    for capability in CAPABILITIES:
        mine, theirs = teacher.capability(capability), wrapped.capability(capability)
        if capability in PrivilegedTeacher.withholds:
            assert mine is None
        elif capability in PrivilegedTeacher.adds:
            assert mine is teacher
        elif capability in PrivilegedTeacher.changes:
            assert mine is (None if theirs is None else teacher), capability
        else:  # handed through: the inner teacher's own
            assert mine is theirs, capability


def test_a_capability_added_later_reaches_through_a_wrapper_without_a_line_of_it():
    class Extra(Protocol):
        def extra(self) -> int: ...

    class Richer(LiveTeacher, Extra):
        def extra(self) -> int:
            return 7

    teacher = PrivilegedTeacher(bare(Richer), "{prompt}", tokenizer=None)
    assert teacher.capability(Extra).extra() == 7
    assert PrivilegedTeacher(bare(LiveTeacher), "{prompt}", tokenizer=None).capability(Extra) is None


@pytest.mark.parametrize("members", [(LiveTeacher, LiveTeacher), (LiveTeacher, CachedTeacher),
                                     (ServedTeacher, SelfTeacher), (CrossTokenizerTeacher, LiveTeacher),
                                     (ServedTeacher, ServedTeacher)])
def test_a_panel_has_every_capability_its_members_all_have(members):
    """Each capability is the panel's own (combining its members'), its only where every member has it, or withheld
    on purpose: none is left out by forgetting, and one its members all have is the panel's unless withheld."""
    panel = TeacherPanel({f"t{i}": bare(kind) for i, kind in enumerate(members)}, "sum", [0.5, 0.5])
    declared = {c for c in CAPABILITIES if c in TeacherPanel.__mro__}
    assert declared | set(TeacherPanel.withholds) == set(CAPABILITIES)
    assert not declared & set(TeacherPanel.withholds) and set(TeacherPanel.every) <= declared
    for capability in CAPABILITIES:
        every = all(member.capability(capability) is not None for member in panel.members.values())
        if capability in TeacherPanel.withholds:
            assert panel.capability(capability) is None
        elif capability in TeacherPanel.every:
            assert (panel.capability(capability) is panel) is every, capability
        else:
            assert panel.capability(capability) is panel, capability


def test_a_capability_a_teacher_lacks_is_asked_for_not_defaulted():
    """No capability's member is on the core: a caller that does not ask gets an AttributeError, not a do-nothing
    default."""
    members = {m for c in CAPABILITIES for m in (*vars(c), *getattr(c, "__annotations__", {}))
               if not m.startswith("_")}
    assert members and not members & set(dir(TeacherSource))
    with pytest.raises(ValueError, match="writes the top-k of a teacher model or a teacher server"):
        capabilities.required(bare(CachedTeacher), capabilities.WritesCache, capabilities.CACHE_REFUSAL)
    with pytest.raises(ValueError, match="writes one teacher's cache: run it once per teacher"):
        capabilities.required(TeacherPanel({"a": bare(LiveTeacher)}), capabilities.WritesCache,
                              capabilities.CACHE_REFUSAL)
    with pytest.raises(ValueError, match="this teacher has another tokenizer"):
        capabilities.required(bare(CrossTokenizerTeacher), capabilities.WritesCache, capabilities.CACHE_REFUSAL)
