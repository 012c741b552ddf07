"""Forwards that start below the root: which modules may open one (hooks.py installs them).

[Note: forwards entered below the root] The root's forward opens a forward of the sharded
model (the gather schedule's phase, the root unit gathered for it) and a unit's forward runs
inside one. Hugging Face calls parts of a model directly: ``generate()`` of an encoder-decoder
(T5, BART, Whisper) runs ``model.get_encoder()(...)`` once before its decoder steps, CLIP's
``get_text_features`` runs ``self.text_model(...)`` and then ``self.text_projection(...)``,
``model.model(...)`` gives a causal LM's hidden states. A unit called that way raised
("called outside the forward"), and a root-unit module (``text_projection``) read the root's
params released: zeros on several ranks or with params on NVMe, silently.

So two kinds of modules open a forward of their own when called outside one, as the root's
forward would (every rank must make the call, as every rank runs the root's forward):

- *containers*: modules between the root and a unit (``encoder``, ``text_model``);
- *root holders*: modules that hold root-unit params (``text_projection``, ``lm_head``, an
  embedding), only under ``torch.no_grad()`` and while the root is released. With grad the
  call stays as it was: after a container's forward with grad the root is live until its
  backward (its reads are true, its grads reduced), and a forward opened for
  ``get_input_embeddings()(ids)`` before ``model(inputs_embeds=...)`` would be followed by
  that forward before its backward (refused: one backward per forward), where one rank in
  RAM computes it right today.
"""
from __future__ import annotations

from typing import Any, List, Set, Tuple

import torch.nn as nn

__all__ = ["entry_modules"]


def entry_modules(units: List[Any]) -> Tuple[List[nn.Module], List[nn.Module]]:
    """(containers, root holders): neither the root nor a module inside a unit."""
    root = units[0].module
    inner = {id(u.module) for u in units[1:]}
    root_leaves = {id(t) for flat in units[0].flats for t in flat.leaves}
    containers: List[nn.Module] = []
    holders: List[nn.Module] = []
    seen: Set[int] = set()

    def walk(m: nn.Module) -> bool:
        """Whether ``m`` holds a unit below it; notes ``m`` as an entry."""
        if id(m) in seen:
            return id(m) in {id(c) for c in containers}
        seen.add(id(m))
        below = False
        for child in m.children():
            below = (id(child) in inner or walk(child)) or below
        if m is not root:
            if below:
                containers.append(m)
            elif any(id(v) in root_leaves for v in vars(m).values()):
                holders.append(m)
        return below

    walk(root)
    return containers, holders
