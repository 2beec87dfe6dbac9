"""How completions are sampled (`Sampling`: training's settings or evaluation's), whichever engine samples them,
and where each step's completions come from (`completion_source`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled: training's settings (`from_args`), or evaluation's (greedy by default, and a
    fixed `seed` per batch so that any process count samples the same)."""

    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @classmethod
    def from_args(cls, args) -> Sampling:
        return cls(args.max_new_tokens, args.generation_temperature, args.generation_top_p, args.generation_top_k)

    def generate_kwargs(self, eos_ids: list[int]) -> dict:
        """HF `generate`'s keyword arguments."""
        if self.temperature == 0:
            return dict(max_new_tokens=self.max_new_tokens, do_sample=False, eos_token_id=eos_ids)
        return dict(max_new_tokens=self.max_new_tokens, do_sample=True, temperature=self.temperature,
                    top_p=self.top_p, top_k=self.top_k, eos_token_id=eos_ids)


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device):
    """Torch's generators start from `seed` inside, and are put back after (None: nothing changes)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


DATASET, STUDENT, TEACHER = "dataset", "student", "teacher"


def completion_source(lmbda: float, seq_kd: bool, seed: int, step: int) -> str:
    """Where the completions of optimizer step `step` come from: the student with probability `lmbda`, else the
    teacher when `seq_kd`, else the dataset. A pure function of its arguments (same on every rank and on resume)."""
    if lmbda > 0:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if torch.rand((), generator=generator).item() < lmbda:
            return STUDENT
    return TEACHER if seq_kd else DATASET
