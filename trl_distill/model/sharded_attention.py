"""Under sequence parallelism: the attention of both models on each rank's shard of positions.

accelerate registers DeepSpeed's `UlyssesSPAttentionHF` for the student alone (one instance, the student's head
counts and micro-batch size). `ShardedAttention` takes its place for every model: one Ulysses exchange per shape
(batch rows, heads, key/value heads, head size), so the teacher (other heads, the step pass's larger batches) goes
through the same all-to-all on the same shard. It is on while the student trains; evaluation batches are whole rows
on every rank (the Trainer shards only the train loader), and there it calls the attention itself.
"""

from __future__ import annotations

import torch

from ..compat import attention_override, core_attention


def sp_group_and_rank():
    """The sequence-parallel process group of this rank, its size and this rank's place in it (the groups
    `deepspeed.runtime.sequence_parallel.parallel_state_sp` built when accelerate prepared the student)."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    group = mpu.get_sequence_parallel_group()
    return group, torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


class ShardedAttention:
    """transformers' attention function for one implementation, each call exchanged across the sequence-parallel
    group while `enabled()`; records the global sequence length each call attended over (`seen`)."""

    def __init__(self, core, implementation: str, enabled):
        self.core, self.implementation, self.enabled = core, implementation, enabled
        self.layers: dict[tuple, object] = {}
        self.seen: list[tuple[int, int]] = []  # (local, global) positions per call, while recording
        self.recording = False
        self.replaced = None  # the registry's own entry it took the place of (None: the class-level default)

    def uninstall(self) -> None:
        """Put back the registry entry it replaced (its trainer's training is over); returns None."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if attention_override(self.implementation) is self:
            if self.replaced is None:
                del ALL_ATTENTION_FUNCTIONS[self.implementation]
            else:
                ALL_ATTENTION_FUNCTIONS[self.implementation] = self.replaced

    def _layer(self, module, query, key):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        shape = (query.shape[0], query.shape[1], key.shape[1], query.shape[3])
        if shape not in self.layers:
            group, _, _ = sp_group_and_rank()
            config = getattr(module, "config", None)
            layer = UlyssesSPAttentionHF(
                attn=self.core, batch_size=shape[0], attn_head_count=shape[1], attn_head_size=shape[3],
                kv_head_count=shape[2], num_hidden_layers=getattr(config, "num_hidden_layers", 1),
                process_group=group, seq_length_is_variable=True)
            layer.core_attn_implementation = self.implementation
            self.layers[shape] = layer
        return self.layers[shape]

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        if not self.enabled():
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        if not _is_block_mask(attention_mask):
            attention_mask = None  # built for the local shard; causal masking comes from the gathered positions
        layer = self._layer(module, query, key)
        if self.recording:
            self.seen.append((query.shape[2], query.shape[2] * layer.world_size))
        return layer(module, query, key, value, attention_mask, *args, **kwargs)


def _is_block_mask(mask) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention
        return False
    return isinstance(mask, BlockMask)


def install_sharded_attention(implementation: str, enabled) -> ShardedAttention:
    """Put a `ShardedAttention` in place of `implementation` in transformers' attention registry, on while
    `enabled()` (its student trains); `ShardedAttention.uninstall` puts back what it replaced."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # the implementation itself, not accelerate's wrapper of it
    sharded = ShardedAttention(core_attention(implementation), implementation, enabled)
    sharded.replaced = attention_override(implementation)
    ALL_ATTENTION_FUNCTIONS[implementation] = sharded
    return sharded
