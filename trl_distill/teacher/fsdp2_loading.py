"""A frozen teacher sharded with FSDP2 on its own mesh, beside an FSDP2 student, and loaded partitioned.

accelerate prepares every model with the Accelerator's one FSDP plugin, so the teacher does not go through
`accelerator.prepare`: it is built on `meta` (its buffers, which are small and computed at construction, stay real),
each decoder layer and then the whole model are `fully_shard`ed over a mesh of every rank, and only then is memory
allocated: each rank its own rows (FSDP2 shards dim 0: rank r holds rows ``[r·c, (r+1)·c)``, c = ceil(rows / N)).
Those rows are filled with ``pread`` from their byte range in the ``.safetensors`` files, the reader the ZeRO-3
teacher uses (`zero3_loading`): a rank reads 1/N of the checkpoint and never holds the whole model.

Inference only: with ``reshard_after_forward`` each layer's weights are gathered for its forward and freed after
it, and so are the input embeddings (a group of their own unless tied to the lm_head). The root's own weights (final
norm, lm_head) stay gathered after a forward, which is where the loss reads the lm_head; `release_root` frees them once
the step's losses are done.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from .zero3_loading import (
    HostStaging,
    construction_args,
    fill_buffers,
    parameter_layout,
    read_segments,
    refuse_missing,
    safetensors_index,
)

logger = logging.getLogger(__name__)


def layer_classes(model: nn.Module) -> set[type]:
    """The classes each sharded on their own: the model's `_no_split_modules` (its decoder layers), as accelerate's
    transformer-based auto-wrap picks them."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(module) for module in model.modules() if type(module).__name__ in names}


def shard(model: nn.Module, mesh, reshard_after_forward: bool = True) -> nn.Module:
    """`fully_shard` each decoder layer, the input embeddings (unless tied to the lm_head: a shared weight stays in
    one group), then the model (its root group: final norm, lm_head), over `mesh`. The root stays gathered after a
    forward, for the loss to read the lm_head, until `release_root`; the embeddings are freed after their forward."""
    from torch.distributed.fsdp import fully_shard

    classes = layer_classes(model)
    for module in list(model.modules()):
        if type(module) in classes:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embeddings is not None and (head is None or head.weight is not embeddings.weight):
        fully_shard(embeddings, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def local_rows(param) -> tuple[torch.Tensor, int]:
    """This rank's rows of an FSDP2 parameter (`Shard(0)` over a 1-D mesh) and the first row they hold."""
    local = param.to_local()
    mesh = param.device_mesh
    rows_per_rank = math.ceil(param.shape[0] / mesh.size()) if len(param.shape) else 0
    return local, mesh.get_local_rank() * rows_per_rank


def load_sharded(directory: str, init_kwargs: dict, mesh, device: torch.device, reshard_after_forward: bool = True):
    """Build the teacher of the local safetensors checkpoint `directory` sharded over `mesh`, each rank reading and
    holding only its rows. None (nothing loaded) when the checkpoint's names or shapes are not the model's (the
    caller loads it whole, then shards it); `ExternalError` when its names are the model's but some parameter has
    none. Collective: every rank calls it."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    entries = safetensors_index(directory)
    config, dtype, model_kwargs = construction_args(directory, init_kwargs)
    with init_empty_weights(include_buffers=False):  # parameters on meta: nothing allocated, nothing initialised
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    refuse_missing(directory, model, entries)
    layout = parameter_layout(config.model_type, {n: tuple(p.shape) for n, p in model.named_parameters()}, entries)
    if layout is None:
        return None
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}  # `to_empty` leaves them unset
    shard(model, mesh, reshard_after_forward)
    model.to_empty(device=device)  # each rank allocates its own rows only
    staging = HostStaging(device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, first_row = local_rows(param)
            if local.numel():
                read_segments(local.view(-1), layout[name], entries, first_row * math.prod(param.shape[1:]), staging)
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        fill_buffers(model, entries)
    return model


def release_root(model: nn.Module) -> None:
    """Free the root group's gathered weights (embeddings, norm, lm_head) that a forward left gathered."""
    model.reshard()


def teacher_bytes(model: nn.Module) -> tuple[int, int]:
    """``(bytes this rank holds, bytes of the whole teacher)`` of an FSDP2-sharded model's parameters."""
    held = total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        held += local.numel() * local.element_size()
        total += param.numel() * param.element_size()
    return held, total
