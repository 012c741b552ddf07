"""``offload.optim.flat_state.FlatState``: the flat store, now in ``offload/optim/flat/``
(``store.py`` and its collaborators); this module keeps the old import path working."""
from offload.optim.flat.store import FlatState

__all__ = ["FlatState"]
