"""A state read as a copy (swap files, decoded int8 blocks) that refuses in-place changes.

[Note: a read copy refuses in-place changes] in state_view.py says why a copy must refuse
them. It was an inference tensor first (``torch.inference_mode``), which refuses more than
that: autograd cannot save one for backward, so ``(opt.state[p]["exp_avg_sq"] * (w - w0) ** 2)
.sum().backward()`` (a penalty weighted by Adam's second moment) raised "Inference tensors
cannot be saved for backward", ``torch.nn.Parameter(...)`` / ``requires_grad_()`` of one
raised, while the same code on torch's states, on this library's live views, and on the
same copy before ran. And it refused only on the tensor itself: ``.data.zero_()`` and
``.detach().zero_()`` changed a tensor sharing its memory, silently lost as before.

So a copy is this subclass (``__torch_function__``): an in-place op on it, on a tensor
sharing its memory (``.data``, ``.detach()``, a view, an index) or with it as ``out=`` raises
RuntimeError; every other op runs as on a plain tensor, autograd included, and what it returns
is a plain tensor unless it shares the copy's memory. ``torch.save``, pickle and deepcopy
give plain tensors (``torch.load(weights_only=True)`` knows no other class). ``.numpy()`` and
``np.asarray`` give a read-only array over its memory (numpy then refuses writes: "assignment
destination is read-only"; an array converted to another dtype is a new one, writable); a raw
pointer (``data_ptr``, DLPack) is not guarded.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["ReadCopy", "read_copy"]

# What hands out the copy's memory as a NumPy array: made read-only.
_TO_NUMPY = frozenset({"numpy", "__array__"})
# In-place by name (``zero_``, ``add_``, ``torch.relu_``, ``nn.init.zeros_``), less the ones
# that change no values; the operators and item assignment by their dunders.
_NOT_A_CHANGE = frozenset({"requires_grad_", "share_memory_", "detach_", "rename_"})
_CHANGING_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                               "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
                               "__ilshift__", "__irshift__", "__imatmul__"})


def _tensors(x: Any) -> Iterable[Any]:
    return x if isinstance(x, (list, tuple)) else (x,)  # (torch._foreach_*_ take lists)


def _changes_a_copy(func: Any, args: tuple, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    in_place = (name in _CHANGING_DUNDERS or kwargs.get("inplace") is True  # (F.relu(t, inplace=True))
                or (name.endswith("_") and not name.endswith("__") and name not in _NOT_A_CHANGE))
    if in_place and args and any(isinstance(t, ReadCopy) for t in _tensors(args[0])):
        return True
    return any(isinstance(t, ReadCopy) for t in _tensors(kwargs.get("out")))


def _memory(t: torch.Tensor) -> int:
    """The address of ``t``'s memory (under DisableTorchFunctionSubclass)."""
    return t.untyped_storage().data_ptr() if t.layout == torch.strided else 0


def _kept(out: Any, memories: set) -> Any:
    """``out`` with the plain tensors among it that share a copy's memory made copies too."""
    if isinstance(out, (list, tuple)) and type(out) in (list, tuple):
        return type(out)(_kept(o, memories) for o in out)
    if type(out) is torch.Tensor and _memory(out) in memories:
        return out.as_subclass(ReadCopy)
    return out


def _plain(t: "ReadCopy") -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


class ReadCopy(torch.Tensor):
    """A copy of a state that refuses in-place changes (module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _changes_a_copy(func, args, kwargs):
            raise RuntimeError(
                f"{getattr(func, '__name__', func)}: this tensor is a copy of an optimizer state read from "
                "its store (offload='nvme', or int8 states decoded), so an in-place change would change only "
                "the copy; assign instead (opt.state[p][key] = opt.state[p][key] * 0.5, or = torch.zeros_like(p)), "
                "or .clone() it to get a tensor of your own")
        with torch._C.DisableTorchFunctionSubclass():  # (and no recursion through _memory)
            out = func(*args, **kwargs)
            memories = {_memory(t) for a in (*args, *kwargs.values()) for t in _tensors(a)
                        if isinstance(t, ReadCopy)}
            memories.discard(0)  # no elements: nothing to lose
            if getattr(func, "__name__", "") in _TO_NUMPY and hasattr(out, "flags") and not out.flags.owndata:
                out.flags.writeable = False  # its memory; a converted one (a dtype asked for) is the caller's
            return _kept(out, memories)

    def __repr__(self, *, tensor_contents=None) -> str:  # tensor(...), as a state read before
        return repr(_plain(self))

    def __reduce_ex__(self, proto):
        return _plain(self).__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        return _plain(self).clone()


def read_copy(values: torch.Tensor) -> ReadCopy:
    """``values`` (a tensor of the caller's own: nobody else sees it) as a read copy."""
    return values.as_subclass(ReadCopy)
