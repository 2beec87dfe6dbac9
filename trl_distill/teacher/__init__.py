"""Every kind of teacher behind one interface (`base.TeacherSource`): a live model (ZeRO-3 under DeepSpeed), the
student's own base ('self'), a top-k cache, a vLLM server, a model with another tokenizer. `resolve.resolve_teacher`
picks the kind; `support` lists what each refuses."""

from .base import TeacherBatch, TeacherSource
from .cached import CachedTeacher
from .cross_tokenizer import CrossTokenizerTeacher
from .live import LiveTeacher
from .resolve import KINDS, resolve_teacher, support_matrix
from .self_distill import SelfTeacher
from .served import ServedTeacher

__all__ = ["KINDS", "CachedTeacher", "CrossTokenizerTeacher", "LiveTeacher", "SelfTeacher", "ServedTeacher",
           "TeacherBatch", "TeacherSource", "resolve_teacher", "support_matrix"]
