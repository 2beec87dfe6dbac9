"""How far a reader jumps to follow one training step: the step's hops, counted by running it.

A hop is a call into one of the package's functions from another file: from the HF Trainer's code into ours (an
entry: its loop into our override, its callback handler into our callback), or from one of our files into another
(the nearest frame of ours up the stack is in another file). Calls inside one file are not hops (the reader is
already there), nor are comprehensions, lambdas and property reads (an attribute's name is read, not followed). Each
`file:function` counts once, however often the step calls it. `docs/architecture.md` draws the step with these counts.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import TrainerCallback

import trl_distill

PACKAGE = Path(trl_distill.__file__).resolve().parent


def _ours(filename: str) -> str | None:
    """The file's path inside the package, or None for library code."""
    try:
        return Path(filename).resolve().relative_to(PACKAGE).as_posix()
    except ValueError:
        return None


def _is_trainer_loop(filename: str) -> bool:
    """Whether the HF Trainer's (or TRL's) own code makes the call: its loop into our override, its callback handler
    into our callback."""
    parts = Path(filename).parts
    return "transformers" in parts or "trl" in parts


def _is_property(frame, name: str) -> bool:
    """An attribute read (a property's getter): the reader sees its name, not a jump."""
    owner = frame.f_locals.get("self") if frame.f_code.co_argcount else None
    return owner is not None and isinstance(getattr(type(owner), name, None), property)


class StepHops(TrainerCallback):
    """Records the hops of one whole optimizer step: from the end of step `after` to the end of the next (that step's
    batches, teacher pass, sampling, micro-batch losses, optimizer step, and the previous step's log)."""

    def __init__(self, after: int = 1):
        self.after = after
        self.hops: dict[str, int] = {}  # "file:function" -> calls
        self._files: dict[str, str | None] = {}
        self._tracing = False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.after:
            self._tracing = True
            sys.setprofile(self._profile)
        elif self._tracing:
            sys.setprofile(None)
            self._tracing = False

    def _file(self, code) -> str | None:
        name = code.co_filename
        if name not in self._files:
            self._files[name] = _ours(name)
        return self._files[name]

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        here = self._file(code)
        if here is None or code.co_name.startswith("<") or _is_property(frame, code.co_name):
            return
        caller = frame.f_back
        entry = caller is not None and _is_trainer_loop(caller.f_code.co_filename)
        while caller is not None and self._file(caller.f_code) is None:
            caller = caller.f_back
        if caller is not None and self._file(caller.f_code) == here and not entry:
            return
        key = f"{here}:{code.co_qualname}"
        self.hops[key] = self.hops.get(key, 0) + 1

    @property
    def files(self) -> set[str]:
        return {hop.split(":")[0] for hop in self.hops}


def report(name: str, hops: StepHops) -> str:
    """One block of text: the count, the files, then each hop."""
    lines = [f"{name}: {len(hops.hops)} hops over {len(hops.files)} files"]
    lines += [f"  {hop}  x{count}" for hop, count in sorted(hops.hops.items())]
    return "\n".join(lines)
