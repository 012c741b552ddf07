"""The flat store (``FlatState``, in ``store.py``) and its collaborators, one job each:

- ``grads.py``: where a step's grads come from (p.grad in place, the grad hook's host copy,
  the cross-rank reduction) and the has-grad agreement between ranks;
- ``sinks.py``: where updated params go (in place, staging + copy stream, all-gather);
- ``steps.py``: the host-buffer step loops (one rank; several ranks with the gather overlap);
- ``swapped.py``: the nvme backing (open / resume, params from swap, the swapped step);
- ``load_hooks.py``: state_dict export / import and the load_state_dict hooks;
- ``checkpoints.py``: save_checkpoint / load_checkpoint.

[Note: a step through the flat store] ``opt.step()`` (``offload/optim/adam.py``) drives the
store through the protocol of ``offload/optim/protocol.py``:

1. ``agree_on_grads()``: several ranks, one all-reduce settles which params have a grad on
   any rank (``GradSource.agree``); then ``grads(p)`` per param, never a collective.
2. ``prepare_grads()``: the grads move to where the kernel reads them (``GradSource.prepare``):
   the reduction into each group's shard buffer (or the end of the one started during
   backward), or, on one rank, the wait for the grad hook's host copies.
3. ``global_grad_sumsq(work)`` when clipping (``GradSource.global_sumsq``).
4. ``step(batches)``: ``ParamSink.begin``, then one of three loops: ``steps.step_local``
   (param by param, cut into sub-groups, each sent by ``ParamSink.to_param``),
   ``steps.step_partitioned`` (bucket by bucket, each all-gathered by ``BucketGathers``)
   or ``swapped.step_swapped`` (work items whose grad comes from the grad source and whose
   output from ``ParamSink.piece_output``, run by the swap pipeline); ``ParamSink.end``.
"""
