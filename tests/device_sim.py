"""Tensors that behave like a GPU's on this CPU-only machine, for the tests of code that must run on a device.

Inside ``with on_device():`` a tensor `to_device` made (or any tensor made with ``device=DEVICE``, or computed from
such a one) reports the device `DEVICE` (``meta``, which holds no data) and keeps its values on the host, so the
code under test computes real values. What CUDA refuses, it refuses the same way:

- ``.numpy()`` (and ``np.asarray``) of it raises CUDA's ``TypeError`` ("can't convert ... to numpy"): meta's own;
- an op mixing it with a host tensor of one or more dimensions raises CUDA's ``RuntimeError`` ("Expected all tensors
  to be on the same device"); a 0-dim host tensor is a scalar, as on CUDA; ``copy_`` and indexing with host indices
  cross, as on CUDA;
- a random op on the device with a host ``torch.Generator`` raises as CUDA does.

``.cpu()``, ``.to("cpu")``, ``.tolist()`` and ``.item()`` read the values back; ``.to(DEVICE)`` moves a host tensor
there. Autograd works through it (it runs above the dispatch level this acts at).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
_aten = torch.ops.aten
# Ops CUDA runs with host tensors among its arguments: a copy across devices, indexing with host indices.
_CROSSING = {_aten.copy_.default, _aten._to_copy.default, _aten.index.Tensor, _aten.index_put_.default,
             _aten.index_put.default, _aten._index_put_impl_.default, _aten.lift_fresh.default}


class OnDevice(torch.Tensor):
    """A tensor on `DEVICE` whose values are the host tensor `host`."""

    @staticmethod
    def __new__(cls, host: torch.Tensor, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, host.shape, strides=host.stride(), storage_offset=host.storage_offset(), dtype=host.dtype,
            device=DEVICE, requires_grad=requires_grad)

    def __init__(self, host: torch.Tensor, requires_grad: bool = False):
        self.host = host

    def __repr__(self) -> str:
        return f"OnDevice({self.host!r})"

    def tolist(self):
        return self.host.tolist()  # (torch refuses `tolist` of a subclass; CUDA's reads the values back)

    def numpy(self, *, force: bool = False):
        raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")  # CUDA's words

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _is_ours(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


def _run(func, args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    device = kwargs.get("device")
    ours = any(isinstance(a, OnDevice) for a in flat) or _is_ours(device)
    if any(type(a) is not OnDevice and isinstance(a, torch.Tensor) and a.device == DEVICE for a in flat):
        raise RuntimeError(f"device_sim: {func} got a {DEVICE} tensor without values (made past the simulator)")
    if func is _aten._to_copy.default and device is not None:  # a copy to a device says where the result lives
        ours = _is_ours(device)
    elif ours and func not in _CROSSING:
        host = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, OnDevice) and a.dim() > 0]
        if host:
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                               f"{DEVICE} and {host[0].device}! (device_sim: {func})")
        generator = kwargs.get("generator")
        if generator is not None and generator.device.type != DEVICE.type:
            raise RuntimeError(f"Expected a '{DEVICE.type}' device type for generator but found "
                               f"'{generator.device.type}'")
    if _is_ours(device):
        kwargs = {**kwargs, "device": torch.device("cpu")}
    args, kwargs = tree_map(lambda a: a.host if isinstance(a, OnDevice) else a, (args, kwargs))
    out = func(*args, **kwargs)
    if func._schema.is_mutable and out is args[0]:
        return flat[0]  # an in-place op hands back its own tensor (on the device or not)
    if not ours:
        return out
    return tree_map(lambda a: OnDevice(a) if isinstance(a, torch.Tensor) and not isinstance(a, OnDevice) else a, out)


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class _Constructors(TorchFunctionMode):
    """`torch.tensor`, `torch.as_tensor` and `Tensor.new_tensor` build on the host below the dispatcher: the device
    ones are made here."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and _is_ours(kwargs.get("device")):
            return OnDevice(func(*args, **{**kwargs, "device": "cpu"}))
        if func is torch.Tensor.new_tensor and (isinstance(args[0], OnDevice) or _is_ours(kwargs.get("device"))):
            host = args[0].host if isinstance(args[0], OnDevice) else args[0]
            return OnDevice(host.new_tensor(*args[1:], **{**kwargs, "device": "cpu"}))
        return func(*args, **kwargs)


class _Autocast(torch.autocast):
    """`torch.autocast` for the device's type (which has no autocast of its own) runs as the host's."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == DEVICE.type else device_type, *args, **kwargs)


@contextlib.contextmanager
def on_device():
    """Make tensors made with ``device=DEVICE`` device tensors (with values) while it lasts."""
    autocast, torch.autocast = torch.autocast, _Autocast
    try:
        with _Constructors(), _Mode():
            yield
    finally:
        torch.autocast = autocast


def to_device(tensor: torch.Tensor) -> OnDevice:
    """A device copy of the host `tensor` (a leaf, requiring grad as `tensor` does)."""
    return OnDevice(tensor.detach().clone(), requires_grad=tensor.requires_grad)


def host(tensor):
    """The host values of a device tensor (a host tensor as it is)."""
    return tensor.host if isinstance(tensor, OnDevice) else tensor
