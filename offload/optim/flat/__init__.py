"""The flat store (``FlatState``, in ``store.py``) and its collaborators, one job each:

- ``grads.py``: where a step's grads come from (p.grad in place, the grad hook's host copy,
  the cross-rank reduction) and the has-grad agreement between ranks;
- ``sinks.py``: where updated params go (in place, staging + copy stream, all-gather);
- ``steps.py``: the host-buffer step loops (one rank; several ranks with the gather overlap);
- ``swapped.py``: the nvme backing (open / resume, outputs, params from swap, the swapped step);
- ``load_hooks.py``: state_dict export / import and the load_state_dict hooks;
- ``checkpoints.py``: save_checkpoint / load_checkpoint.
"""
