"""The flat store (``FlatState``, in ``store.py``) and its collaborators, one job each:

- ``grads.py``: where a step's grads come from (p.grad in place, the grad hook's host copy,
  the cross-rank reduction) and the has-grad agreement between ranks;
- ``sinks.py``: where updated params go (in place, staging + copy stream, all-gather);
- ``steps.py``: the one step loop ([Note: one step loop]): work items, and the host-buffer
  state backing (``HostBacking``);
- ``swapped.py``: the nvme backing (open / resume, params from swap, ``SwapBacking``);
- ``load_hooks.py``: state_dict export / import and the load_state_dict hooks;
- ``checkpoints.py``: save_checkpoint / load_checkpoint.

[Note: a step through the flat store] ``opt.step()`` (``offload/optim/adam.py``) drives the
store through the protocol of ``offload/optim/protocol.py``:

1. ``agree_on_grads(failed, facts)``: several ranks, one all-reduce settles which params have
   a grad on any rank, GradScaler's found_inf and whether every rank may step ([Note: a step
   the ranks agree to begin] in offload/optim/step_agreement.py; ``GradSource.agree``); then
   ``grads(p)`` per param, never a collective.
2. ``prepare_grads()``: the grads move to where the kernel reads them (``GradSource.prepare``):
   the reduction into each group's shard buffer (or the end of the one started during
   backward), or, on one rank, the wait for the grad hook's host copies.
3. ``global_grad_sumsq(work)`` when clipping (``GradSource.global_sumsq``).
4. ``step(batches)``: ``ParamSink.begin``, then ``steps.run_step``: group by group,
   segment by segment (the buckets gathered as soon as they are stepped, or the whole
   shard), each piece with a grad becomes ``WorkItem``s whose grad slice comes from
   ``GradSource.piece`` and whose output from ``ParamSink.piece_output``; the state
   backing computes them (``HostBacking``: the kernel now, then the sends on the copy
   stream; ``SwapBacking``: the swap pipeline streams them all, then the sends and the
   all-gather); ``ParamSink.end``.

The store never reads its optimizer: what it needs comes in the step context ([Note: the
step context] in offload/optim/protocol.py); the optimizer calls ``begin_step`` (GradScaler's
facts in the context), ``before_load`` / ``after_load`` from its own hooks.
"""
