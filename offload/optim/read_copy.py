"""A state read as a copy (swap files, decoded int8 blocks) whose in-place changes are written
back to its store, or refused.

[Note: a read copy refuses in-place changes] in state_view.py says why a copy must not take
them silently; [Note: an in-place change of a read copy is written back] in write_back.py when
it writes them back and when it refuses. It was an inference tensor first (``torch.inference_mode``), which refuses more than
that: autograd cannot save one for backward, so ``(opt.state[p]["exp_avg_sq"] * (w - w0) ** 2)
.sum().backward()`` (a penalty weighted by Adam's second moment) raised "Inference tensors
cannot be saved for backward", ``torch.nn.Parameter(...)`` / ``requires_grad_()`` of one
raised, while the same code on torch's states, on this library's live views, and on the
same copy before ran. And it refused only on the tensor itself: ``.data.zero_()`` and
``.detach().zero_()`` changed a tensor sharing its memory, silently lost as before.

So a copy is this subclass (``__torch_function__``): an in-place op on it, on a tensor
sharing its memory (``.data``, ``.detach()``, a view, an index) or with it as ``out=`` is
checked first (RuntimeError, nothing changed, when it cannot be written back: a stale copy,
another thread...), then run and the whole copy written back; every other op runs as on a plain tensor, autograd included, and what it returns
is a plain tensor unless it shares the copy's memory. ``torch.save``, pickle and deepcopy
give plain tensors (``torch.load(weights_only=True)`` knows no other class). ``.numpy()`` and
``np.asarray`` give a read-only array over its memory (numpy then refuses writes: "assignment
destination is read-only"; an array converted to another dtype is a new one, writable); a raw
pointer (``data_ptr``, DLPack) is not guarded.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["ReadCopy", "plain", "read_copy"]

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


def _changed_copies(func: Any, args: tuple, kwargs: dict) -> list:
    """The read copies ``func`` changes in place (as ``args[0]`` of an in-place op, or ``out=``)."""
    name = getattr(func, "__name__", "")
    in_place = (name in _CHANGING_DUNDERS or kwargs.get("inplace") is True  # (F.relu(t, inplace=True))
                or (name.endswith("_") and not name.endswith("__") and name not in _NOT_A_CHANGE))
    changed = [t for t in _tensors(args[0]) if isinstance(t, ReadCopy)] if in_place and args else []
    return changed + [t for t in _tensors(kwargs.get("out")) if isinstance(t, ReadCopy)]


def _check_writable(func: Any, changed: list) -> None:
    """RuntimeError, before anything changes, unless every copy in ``changed`` can be written back."""
    backs = {id(b): b for b in (getattr(t, "_write_back", None) for t in changed)}
    if None in backs.values():
        why = "it has no store to write back to"
    elif len({(id(b._entry()), b.key) for b in backs.values()}) < len(backs):
        why = "two copies of one state changed by one op"  # (the second write-back would undo the first)
    else:
        why = next(filter(None, (b.refusal() for b in backs.values())), None)
    if why is not None:
        raise RuntimeError(
            f"{getattr(func, '__name__', func)}: this tensor is a copy of an optimizer state read from "
            f"its store (offload='nvme', or int8 states decoded) and this in-place change cannot be written back: "
            f"{why}; assign instead (opt.state[p][key] = opt.state[p][key] * 0.5, or = torch.zeros_like(p)), "
            "or .clone() it to get a tensor of your own")


def _memory(t: torch.Tensor) -> int:
    """The address of ``t``'s memory (under DisableTorchFunctionSubclass)."""
    return t.untyped_storage().data_ptr() if t.layout == torch.strided else 0


def _kept(out: Any, backs: dict) -> Any:
    """``out`` with the plain tensors among it that share a copy's memory (``backs``: memory ->
    that copy's write-back) made copies too, with the same write-back."""
    if isinstance(out, (list, tuple)) and type(out) in (list, tuple):
        return type(out)(_kept(o, backs) for o in out)
    if type(out) is torch.Tensor and _memory(out) in backs:
        back = backs[_memory(out)]
        out = out.as_subclass(ReadCopy)
        out._write_back = back
    return out


def plain(t: "ReadCopy") -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


class ReadCopy(torch.Tensor):
    """A copy of a state: an in-place change is written back to its store, or refused (module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        changed = _changed_copies(func, args, kwargs)
        if changed:
            _check_writable(func, changed)
        with torch._C.DisableTorchFunctionSubclass():  # (and no recursion through _memory)
            out = func(*args, **kwargs)
            backs = {_memory(t): getattr(t, "_write_back", None) for a in (*args, *kwargs.values())
                     for t in _tensors(a) if isinstance(t, ReadCopy)}
            backs.pop(0, None)  # no elements: nothing to lose
            if getattr(func, "__name__", "") in _TO_NUMPY and hasattr(out, "flags") and not out.flags.owndata:
                out.flags.writeable = False  # its memory; a converted one (a dtype asked for) is the caller's
            out = _kept(out, backs)
        for back in {id(b): b for b in (t._write_back for t in changed)}.values():
            back.write()  # (outside: the writer's own ops on the copy's memory are plain ones)
        return out

    def __repr__(self, *, tensor_contents=None) -> str:  # tensor(...), as a state read before
        return repr(plain(self))

    def __reduce_ex__(self, proto):
        return plain(self).__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        return plain(self).clone()


def read_copy(values: torch.Tensor) -> ReadCopy:
    """``values`` (a tensor of the caller's own: nobody else sees it) as a read copy."""
    return values.as_subclass(ReadCopy)
