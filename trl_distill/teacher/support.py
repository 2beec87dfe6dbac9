"""The modes of a run that a kind of teacher may refuse, and which of them a run uses.

Each kind declares what it refuses in `TeacherSource.refused` (mode -> the one-line message); `matrix` lays every
kind against every mode for the README's support matrix, which `tests/teacher/test_support.py` checks cell by cell.
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["off-policy", "on-policy", "sampled-token", "teacher-prompt", "packing", "eval", "gradient accumulation",
               "LoRA", "cross-tokenizer"]
MODES: tuple[Mode, ...] = ("off-policy", "on-policy", "sampled-token", "teacher-prompt", "packing", "eval",
                           "gradient accumulation", "LoRA", "cross-tokenizer")

ARGS_MODES: tuple[Mode, ...] = ("on-policy", "sampled-token", "teacher-prompt", "packing", "cross-tokenizer")

TEACHER_PROMPT_REFUSAL = ("teacher_prompt gives the teacher its own prompt in place of each row's: it needs a live "
                          "teacher (of the student's tokenizer or another) or a served one, not 'self' or a cache. "
                          "Drop teacher_prompt, or name such a teacher.")
"""The modes the arguments alone decide (refused as the config is built)."""


def active_modes(args) -> list[Mode]:
    """The modes its arguments decide of a run (all but the eval split and LoRA, which the trainer's are)."""
    on = {
        "off-policy": args.lmbda < 1,
        "on-policy": args.lmbda > 0 or bool(args.seq_kd),
        "sampled-token": args.on_policy_objective == "sampled_token",
        "teacher-prompt": args.teacher_prompt is not None,
        "packing": bool(args.packing or args.padding_free),
        "gradient accumulation": args.gradient_accumulation_steps > 1,
        "cross-tokenizer": bool(args.cross_tokenizer) or args.teacher_tokenizer_name_or_path is not None,
    }
    return [mode for mode in MODES if on.get(mode)]


def run_modes(modes: tuple[Mode, ...], *, eval_dataset=None, peft: bool = False) -> list[Mode]:
    """The modes this run uses: those its arguments decide (`modes`, `settings.TeacherSettings.modes`), its eval
    split and whether the student is a PEFT model, in the order of `MODES`."""
    on = {*modes, *(["eval"] if eval_dataset is not None else []), *(["LoRA"] if peft else [])}
    return [mode for mode in MODES if mode in on]


def matrix(kinds: dict[str, type]) -> dict[str, dict[Mode, str]]:
    """``{kind label: {mode: "yes" or "refused: <message>"}}`` from each kind's `refused` table."""
    return {label: {mode: f"refused: {kind.refused[mode]}" if mode in kind.refused else "yes" for mode in MODES}
            for label, kind in kinds.items()}
