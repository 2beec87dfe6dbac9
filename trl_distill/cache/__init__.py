"""Offline teacher signal on disk: a cache of the teacher's top-k distribution written once (`trl-distill
cache-teacher`, `writer`) and read by `teacher.cached.CachedTeacher` (`--teacher_cache DIR`). See `loss.sparse`."""

from .manifest import Manifest
from .reader import TeacherCache
from .writer import fill_teacher_cache, open_teacher_cache

__all__ = ["Manifest", "TeacherCache", "fill_teacher_cache", "open_teacher_cache"]
