"""Offline teacher signal: cache the teacher's top-k distribution once (`trl-distill cache-teacher`), then train
students from the cache (`--teacher_cache DIR`) without loading the teacher. See `trl_distill.sparse_losses`."""

from .manifest import Manifest
from .reader import CachedTeacherCollator, TeacherCache
from .writer import fill_teacher_cache, open_teacher_cache, write_teacher_cache

__all__ = ["CachedTeacherCollator", "Manifest", "TeacherCache", "fill_teacher_cache", "open_teacher_cache",
           "write_teacher_cache"]
