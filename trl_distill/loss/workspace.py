"""Buffers the chunked loss reuses chunk after chunk, and the projections that write into them.

One chunk of a 128k-vocabulary loss makes several ``[chunk, vocab]`` tensors of ~128 MiB each. On the CPU each fresh
tensor that size is a new memory mapping whose pages fault in on first touch (glibc serves allocations over 32 MiB
with ``mmap``): measured at 4096 tokens, V = 128 000, bf16, that was about half of the loss's time. Writing each
chunk into the buffers of the chunk before (``out=`` forms of the same operations, the same values) removes it; on a
GPU, where the caching allocator reuses memory anyway, it changes nothing but the allocator's bookkeeping.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Workspace:
    """Named ``[rows, cols]`` buffers of one `fused_loss` call, each allocated once at its largest chunk."""

    def __init__(self):
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A ``[rows, cols]`` tensor of `dtype` (uninitialised), reusing the memory `name` had before."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != cols or buffer.dtype != dtype:
            buffer = self._buffers[name] = torch.empty(rows, cols, dtype=dtype, device=device)
        return buffer[:rows]

    def linear(self, name: str, x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
        """``F.linear(x, weight, bias)`` in the weight's dtype, then cast to `dtype`, written into buffers: the same
        values as ``F.linear(x, weight, bias).to(dtype)``."""
        rows, cols = x.shape[0], weight.shape[0]
        same = weight.dtype == dtype
        low = self.get(name if same else "low", rows, cols, weight.dtype, x.device)  # "low": read at once, shared
        if bias is None:
            torch.mm(x, weight.T, out=low)
        else:
            torch.addmm(bias, x, weight.T, out=low)
        if same:
            return low
        return self.get(name, rows, cols, dtype, x.device).copy_(low)

    def log_softmax(self, name: str, x: Tensor) -> Tensor:
        """``F.log_softmax(x, dim=-1)`` into the buffer `name` (which may be `x`'s own)."""
        out = self.get(name, x.shape[0], x.shape[1], x.dtype, x.device)
        return torch.log_softmax(x, -1, out=out)

    def exp(self, name: str, x: Tensor) -> Tensor:
        out = self.get(name, x.shape[0], x.shape[1], x.dtype, x.device)
        return torch.exp(x, out=out)

    def cast(self, name: str, x: Tensor, dtype: torch.dtype) -> Tensor:
        """``x.to(dtype)`` into the buffer `name` (`x` itself when it has that dtype)."""
        if x.dtype == dtype:
            return x
        return self.get(name, x.shape[0], x.shape[1], dtype, x.device).copy_(x)
