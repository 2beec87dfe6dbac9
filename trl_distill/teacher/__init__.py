"""Every kind of teacher behind one interface (`base.TeacherSource`, its capabilities in `capabilities`): a live
model (ZeRO-3 under DeepSpeed), the student's own base ('self'), a top-k cache, a vLLM server, a model with another
tokenizer. Each kind is registered by name in `kinds`; `resolve.resolve_teacher` builds the run's; `support` lists
what each refuses."""

from .base import TeacherBatch, TeacherSource
from .cached import CachedTeacher
from .cross_tokenizer import CrossTokenizerTeacher
from .live import LiveTeacher
from .resolve import resolve_teacher, support_matrix
from .self_distill import SelfTeacher
from .served import ServedTeacher

__all__ = ["CachedTeacher", "CrossTokenizerTeacher", "LiveTeacher", "SelfTeacher", "ServedTeacher",
           "TeacherBatch", "TeacherSource", "resolve_teacher", "support_matrix"]
