"""``opt.state[p]["exp_avg"]`` / ``["exp_avg_sq"]`` in every store, as torch's tests and
users' monitoring code read them.

- fp32 CPU params in RAM (``HostState``): the moments are there already, in torch's layout,
  or, with ``state_dtype="bfloat16"`` / ``"int8"``, as stored (bf16 of p's shape, 1-D uint8
  packed blocks): [Note: compressed states in the host store] in host_state.py.
- Flat store in RAM: views into the flat host buffers, shaped like ``p`` on one rank;
  partitioned, this rank's slice only (1-D; absent on a rank that holds none of ``p``).
  They are the live states: the next step changes them. float32 and bfloat16 states are
  viewed as stored; int8 states (blocks that need decoding) are read on each access, as
  below, decoded to float32.
- In swap files (``offload="nvme"``): read from the swap files on each access (a new tensor,
  up to ``p``'s size in RAM and one swap read each time; never a stale copy kept in RAM), as
  the RAM store of the same params holds them: float32 or bfloat16 of ``p``'s shape (fp32 CPU
  params: int8 as the host store's 1-D uint8 packed blocks, each param's blocks its own; the
  flat store's params: int8 decoded to float32, as in its RAM). Not stored in the dict, yet
  listed: ``"exp_avg" in opt.state[p]``, ``keys()``, iteration, ``items()`` as on the RAM
  stores ([Note: states an entry reads on access] in state_entry.py). Partitioned: this
  rank's slice, as above.

Assigning one (``opt.state[p]["exp_avg"] = t``) writes ``t`` into the store, in every
store (encoded as it is stored: bf16 rounded to nearest, int8 blocks re-encoded), as torch's
next step would read a replaced state; ``t`` must have as many elements as ``p`` (or be the
packed blocks a read gives, fp32 CPU params on NVMe: written back bit for bit). A
tensor read from the swap files (or decoded from int8 blocks) is a copy, so changing it in place
would change nothing: [Note: a read copy refuses in-place changes].

[Note: a read copy refuses in-place changes]
``opt.state[p]["exp_avg"].zero_()`` (a reset of the moments after a loss spike, say) works on
torch's tensors and on the views above, and was silently dropped on a copy: a run with
``state_dtype="int8"`` (or ``offload="nvme"``) went on with the old moments where the same
code with bf16 states reset them. A copy is a ``ReadCopy`` (read_copy.py), which refuses an
in-place change, also through ``.data``, ``.detach()`` or a view, with a RuntimeError; reading,
``clone()``, arithmetic, autograd, ``torch.save`` work as before and give plain tensors.
(An inference tensor first: it also refused autograd, and not ``.data.zero_()``.) Since, a
change that can be written back is: [Note: an in-place change of a read copy is written back]
in write_back.py (the entry's ``version``, ``_versions`` here); only a stale copy (or one in
another thread, a forked child, a closed optimizer) still refuses.

``state_dict()`` never returns these views: it reads full tensors from the store.

[Note: the master in opt.state] An fp16/bf16 param with an fp32 master (the flat store, no
``master_dtype="bfloat16"``) lists ``"master"`` in ``opt.state[p]`` beside its states, as
``state_dict()`` holds it: a view of the flat buffer in RAM, a read of the swap files with
``offload="nvme"``, this rank's slice when partitioned; assigning it sets the master the next
step starts from (and writes the param from). torch.distributed.checkpoint's
``set_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` rebuilds each entry from
the keys ``opt.state[p]`` lists: before, it dropped the master and the load rebuilt it from
the rounded param, so a resumed run drifted from an uninterrupted one (Transformer Engine's
FusedAdam keeps its ``master_param`` in ``opt.state`` for the same reason).
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Optional, Tuple

import torch

from offload.optim.read_copy import read_copy
from offload.optim.state_codec import is_stored_form, to_torch_layout
from offload.optim.state_entry import MOMENTS, SwappedEntry
from offload.optim.state_versions import bump, bump_key, version_of

__all__ = ["SwappedEntry", "attach", "detach", "MASTER"]

MASTER = ("master",)
"""The key of the fp32 master that ``opt.state[p]`` lists beside a param's states: [Note: the
master in opt.state]."""


def names_of(store: Any) -> tuple:
    """The per-element states ``store`` keeps for its rule (Adam's moments for a store without one)."""
    rule = getattr(store, "rule", None)
    return rule.names if rule is not None else MOMENTS


def _checked(p: torch.Tensor, key: str, value: Any, numel: int) -> torch.Tensor:
    """``value`` as 1-D float32 CPU values for a state of ``numel`` elements, or ValueError."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"opt.state[p][{key!r}] must be a tensor, got {type(value).__name__}")
    if value.numel() != numel:
        raise ValueError(f"opt.state[p][{key!r}] holds {numel} elements here (a param of shape "
                         f"{tuple(p.shape)}), got a tensor of shape {tuple(value.shape)}")
    if value.is_complex() or not (value.is_floating_point() or value.dtype in (torch.int64, torch.int32)):
        raise TypeError(f"opt.state[p][{key!r}] must be a real floating-point tensor, got {value.dtype}")
    return value.detach().reshape(-1).to(device="cpu", dtype=torch.float32)


def _piece(store: Any, p: torch.Tensor):
    """(flat group, this rank's piece of p or None, shard-local [lo, hi)) in a flat store."""
    fg, i = store._where[p]
    piece = fg.layout.owned(i)
    if piece is None:
        return fg, None, 0, 0
    start = fg.layout.shard_range()[0]
    return fg, piece, piece.lo - start, piece.hi - start


def _read_copy(vals: torch.Tensor, param: torch.Tensor, whole: bool, fresh: bool) -> torch.Tensor:
    """``vals`` as a copy that refuses in-place changes: [Note: a read copy refuses in-place changes].
    ``fresh``: ``vals`` is a new tensor nobody else holds (a swap read, a decode), not copied again."""
    out = vals if fresh else vals.clone()
    return read_copy(out.view(param.shape) if whole else out)


def _closed_store(st: Any, param: Any) -> bool:
    # (SwappedState keeps no flag of its own: its swap store's; a read of it closed raised IndexError)
    return st is None or param is None or getattr(st, "_closed", False) or getattr(getattr(st, "store", None), "closed", False)


def _swapped_reader(store: Any, p: torch.Tensor) -> Tuple[Callable[[str], Optional[torch.Tensor]], Callable[[], bool]]:
    """(read, holds): ``read(key)`` p's state as stored (bf16 as bf16, int8 blocks decoded),
    a new tensor from the swap files; ``holds()`` whether there is one to read (no read)."""
    ref, pref = weakref.ref(store), weakref.ref(p)

    def holds() -> bool:
        st, param = ref(), pref()
        if _closed_store(st, param):
            return False
        if param.numel() == 0 or hasattr(st, "read_state"):  # SwappedState: every param, whole
            return True
        return _piece(st, param)[1] is not None and st._swap is not None

    def read(key: str) -> Optional[torch.Tensor]:
        if not holds():
            return None
        st, param = ref(), pref()
        if param.numel() == 0:  # no bytes in the swap files; torch's state holds empty moments
            return torch.zeros(param.shape, dtype=torch.float32)
        if hasattr(st, "read_state"):  # SwappedState: fp32 CPU params, whole
            return _read_copy(st.read_stored(param, key), param, False, fresh=True)  # (shaped as stored)
        fg, piece, lo, hi = _piece(st, param)
        vals = st._swap.read(st._groups.index(fg), lo, hi, (key,), stored=True)[key]
        return _read_copy(vals, param, piece.numel == param.numel(), fresh=True)  # read into new tensors

    return read, holds


def _unpacked(store: Any, p: torch.Tensor, key: str, value: Any) -> Any:
    """``value`` decoded when it is p's packed int8 blocks (what a read gives, as in the host
    store), else as it is: float32 values are encoded as a step would."""
    field = store.core.fields[store.names.index(key)]
    return to_torch_layout(field, value, p.numel()) if field.blocked and is_stored_form(field, value, p.numel()) else value


def _swapped_writer(store: Any, p: torch.Tensor) -> Callable[[str, Any], None]:
    ref, pref = weakref.ref(store), weakref.ref(p)

    def write(key: str, value: Any) -> None:
        st, param = ref(), pref()
        if _closed_store(st, param):
            raise RuntimeError("the optimizer is closed: its states cannot be set")
        if hasattr(st, "read_state"):  # SwappedState: fp32 CPU params, whole
            vals = _checked(param, key, _unpacked(st, param, key, value), param.numel())
            if param.numel() == 0:
                return
            states = list(st.read_state(param))
            states[st.names.index(key)] = vals
            st.write_state(param, *states)
            bump_key(st, param, key)
            return
        fg, piece, lo, hi = _piece(st, param)
        if piece is None or st._swap is None:
            _checked(param, key, value, 0)
            return
        st._drain()  # a step's write-back still in flight must land first
        vals = _checked(param, key, value, hi - lo)
        st._swap.write(st._groups.index(fg), lo, hi, {key: vals})
        if key in MASTER and fg.lowp_shard is not None:  # (as a load of a master: load_hooks.post_load)
            fg.lowp_shard[lo:hi].copy_(vals)
        bump_key(st, param, key)

    return write


def _flat_reader(store: Any, p: torch.Tensor) -> Tuple[Callable[[str], Optional[torch.Tensor]], Callable[[], bool]]:
    """(read, holds): decoded values of a blocked (int8) field of p's piece in the flat
    store's RAM; whether this rank holds a piece of p to read (no decode)."""
    from offload.optim.flat.load_hooks import _values

    ref, pref = weakref.ref(store), weakref.ref(p)

    def holds() -> bool:
        st, param = ref(), pref()
        return not _closed_store(st, param) and _piece(st, param)[1] is not None

    def read(key: str) -> Optional[torch.Tensor]:
        if not holds():
            return None
        st, param = ref(), pref()
        fg, piece, lo, hi = _piece(st, param)
        fresh = fg.field(key).dtype != torch.float32  # decoded into a new tensor, else the buffer itself
        return _read_copy(_values(fg, key, lo, hi), param, piece.numel == param.numel(), fresh)

    return read, holds


def _flat_writer(store: Any, p: torch.Tensor) -> Callable[[str, Any], None]:
    from offload.optim.flat.load_hooks import _store_values

    ref, pref = weakref.ref(store), weakref.ref(p)

    def write(key: str, value: Any) -> None:
        st, param = ref(), pref()
        if _closed_store(st, param):
            raise RuntimeError("the optimizer is closed: its states cannot be set")
        if param.numel() == 0:
            _checked(param, key, value, 0)
            return
        fg, piece, lo, hi = _piece(st, param)
        if piece is None:
            _checked(param, key, value, 0)  # this rank holds none of p: nothing to set
            return
        st._drain()
        _store_values(fg, key, lo, _checked(param, key, value, hi - lo))
        if key in MASTER and fg.lowp_shard is not None:  # (as a load of a master: load_hooks.post_load)
            fg.lowp_shard[lo:hi].copy_(fg.master[lo:hi])
        bump_key(st, param, key)

    return write


def _versions(store: Any, p: torch.Tensor) -> Callable[[str], Optional[tuple]]:
    """``version(key)``: [Note: state versions] of ``p``'s ``key``; None in a process forked
    from the one that made the entry (the store and its swap files are that process's)."""
    ref, pref, pid = weakref.ref(store), weakref.ref(p), os.getpid()

    def version(key: str) -> Optional[tuple]:
        st, param = ref(), pref()
        if os.getpid() != pid or st is None or param is None:
            return None
        return version_of(st, param, key)

    return version


def _flat_views(store: Any, p: torch.Tensor, st: dict, names: tuple) -> None:
    """Views of ``names`` into ``st`` (those there already stay); a view of a state the
    param's group no longer uses goes ([Note: groups of different rules] in kernels/fields.py)."""
    for key in names_of(store):
        if key not in names and dict.__contains__(st, key):
            dict.__delitem__(st, key)
    names = tuple(k for k in names if not dict.__contains__(st, k))
    if not names:
        return
    if p.numel() == 0:  # no bytes in the flat buffers; torch's state holds empty moments
        for key in names:
            dict.__setitem__(st, key, torch.zeros(p.shape, dtype=torch.float32))
        return
    fg, piece, lo, hi = _piece(store, p)
    if piece is None:
        return
    for key in names:
        if fg.field(key).blocked:
            # int8 blocks: decoded by the entry's reader on access, and so are the states
            # after them (the master of int8 states): the entry lists its dict's keys first,
            # so a view after them would be listed out of the states' order
            break
        view = fg.state(key)[lo:hi]
        dict.__setitem__(st, key, view.view(p.shape) if piece.numel == p.numel() else view)


def _group_names(opt: Any, group: dict, names: tuple) -> tuple:
    """The store's states ``names`` that ``group``'s rule uses (all of them for one rule)."""
    # (SGD's shown_rule: the group's own rule, where rule_of gives the store's union of fields)
    rule_of = getattr(opt, "shown_rule", None) or getattr(opt, "rule_of", None)
    if rule_of is None:
        return names
    used = rule_of(group).names
    return tuple(k for k in names if k in used)


def _kept_map(opt: Any) -> dict:
    """id(p) -> the states the optimizer says ``p`` still holds beyond its group's rule."""
    kept = getattr(opt, "kept_states", None)
    return kept() if kept is not None else {}


def _hidden_map(opt: Any) -> dict:
    """id(p) -> the states of its group's rule the optimizer says ``p`` does not hold (SGD:
    a buffer that never started, which torch's state has not)."""
    hidden = getattr(opt, "hidden_states", None)
    return hidden() if hidden is not None else {}


def _adjusted(base: tuple, names: tuple, extra: Any, gone: Any) -> tuple:
    """``base``, with the states ``extra`` lists and without those ``gone`` lists, in ``names``' order."""
    return tuple(k for k in names if (k in base or (extra and k in extra)) and not (gone and k in gone))


def _with_kept(kept: dict, hidden: dict, p: torch.Tensor, base: tuple, names: tuple) -> tuple:
    """``base`` adjusted for ``p`` by ``kept`` (``_kept_map``) and ``hidden`` (``_hidden_map``)."""
    extra, gone = kept.get(id(p)) if kept else None, hidden.get(id(p)) if hidden else None
    return base if not (extra or gone) else _adjusted(base, names, extra, gone)


def seen_names(opt: Any, group: dict, p: torch.Tensor, names: tuple) -> tuple:
    """The store's states ``names`` that ``p`` (of ``group``) shows in ``opt.state`` and
    state_dict(): those its group's rule uses (all of them for one rule), and those the
    optimizer says ``p`` still holds beyond them (``kept_states``: torch keeps an Adam
    param's max_exp_avg_sq after its group turned amsgrad off, and uses it again), less
    those it says ``p`` does not hold (``hidden_states``: an SGD buffer that never started)."""
    return _with_kept(_kept_map(opt), _hidden_map(opt), p, _group_names(opt, group, names), names)


def _with_master(store: Any) -> set:
    """ids of the params whose flat group keeps an fp32 master apart from them (fp16/bf16
    params without a bf16 master): their entries list it ([Note: the master in opt.state])."""
    return {id(p) for fg in getattr(store, "_groups", ()) if getattr(fg, "lowp", False) and not fg.master_lowp
            for p in fg.params}


def attach(opt: Any) -> None:
    """Put the states (views, or readers) into ``opt.state[p]`` of every param that has
    stepped (has a ``"step"``), in entries that write assignments through to the store; a
    param sees the states its group's rule uses. Runs after every step: per param, only what
    changed is redone (the group's names are worked out once per group)."""
    store = opt._store
    kind = getattr(store, "kind", None)
    if kind == "host" or store is None:
        return
    swapped = kind == "nvme" or getattr(store, "_nvme", False)
    every, kept, hidden = names_of(store), _kept_map(opt), _hidden_map(opt)
    masters = _with_master(store)
    for group in opt.param_groups:
        base = _group_names(opt, group, every)
        shown: dict = {}  # (kept, hidden) of a param -> its names: the same few for every param
        for p in group["params"]:
            st = opt.state.get(p)
            if not isinstance(st, dict) or not dict.__contains__(st, "step"):  # (dict's: no store asked per param)
                continue
            names = base
            if kept or hidden:  # (empty for most runs: nothing looked up per param)
                key = (kept.get(id(p)), hidden.get(id(p)))
                if key != (None, None):
                    names = shown.get(key) or shown.setdefault(key, _adjusted(base, every, *key))
            if masters and id(p) in masters:
                names = names + MASTER
            if swapped:
                if not isinstance(st, SwappedEntry):
                    read, holds = _swapped_reader(store, p)
                    st = opt.state[p] = SwappedEntry(st, read, names, _swapped_writer(store, p), holds,
                                                          _versions(store, p))
                st._names = names
            elif p in getattr(store, "_where", {}) or p.numel() == 0:
                if not isinstance(st, SwappedEntry):
                    read, holds = _flat_reader(store, p)
                    st = opt.state[p] = SwappedEntry(st, read, names, _flat_writer(store, p), holds,
                                                          _versions(store, p))
                if st._names != names or not any(dict.__contains__(st, k) for k in names):
                    st._names = names
                    _flat_views(store, p, st, names)


def detach(opt: Any) -> None:
    """Drop the views into the store's buffers (before they are freed); copies read before
    are stale from now on ([Note: state versions])."""
    bump(opt._store)
    if getattr(opt._store, "kind", None) == "host":
        return
    names = names_of(opt._store) + MASTER
    for p, st in opt.state.items():
        if not isinstance(p, torch.Tensor):  # (not a param's: DeepSpeedCPUAdam's sub-group states)
            continue
        for key in names:
            if isinstance(st, dict) and dict.__contains__(st, key):  # (not the states read on access)
                dict.__delitem__(st, key)  # not SwappedEntry's refusal: the store drops its own views
