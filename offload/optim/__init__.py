"""Optimizers: ``Adam``, ``AdamW``, ``SGD``, ``Adagrad``, ``Lion`` (each a kernel rule on the
shared frame, ``base.RuleOptimizer``) and the functional ``adam_step`` / ``rule_step``.

[Note: how the core fits together] ``opt.step()`` (``base.py``) walks one step through these
seams:

0. The optimizer class (``base.py``; ``adam.py``, ``sgd.py``, ...) gives its rule and the
   kernel hyperparameters of each group; everything below is the same for every rule.
1. The step context (``context.py``): the optimizer owns it (``opt._ctx``) and puts into it
   what a store may know: the flags users set (``no_sync()``, ``grads_already_averaged``,
   ``state_dict_rank0_only``, ``max_grad_norm``), GradScaler's ``grad_scale`` / ``found_inf``
   (at the start of each step; ``store.begin_step()`` may agree ``found_inf`` across ranks),
   torch's current ``state`` / ``param_groups``, and the step counts (``ctx.steps``: torch's
   ``opt.state[p]["step"]``, the one place they live).
2. The store (``protocol.py`` lists its methods): ``HostState`` (fp32 CPU params, moments in
   ``opt.state``), ``SwappedState`` (the same in swap files) or ``FlatState``
   (``flat/``: device or fp16/bf16 or partitioned params). Built from explicit arguments and
   the context; it never reads its optimizer.
3. Grads and the multiplier: ``agree_on_grads`` / ``grads(p)``, then ``clip.grad_multiplier``
   (1/loss-scale times the clip coefficient; ``prepare_grads`` moves the grads first).
4. ``step_guard.store_step``: the counts advance in ``ctx.steps``, each work item carries
   its param's count, and ``store.step`` runs the update; a failure puts the counts back.
   In the flat store one loop runs it ([Note: one step loop] in ``flat/steps.py``): the grad
   source gives each work item's grad, the state backing (host buffers or swap files)
   computes it, the param sink sends the result (in place, staging + copy stream, all-gather).
5. The states themselves are typed fields (``offload/kernels/fields.py``: a ``Rule`` is a name
   and its ``StateField``s, each a name and a dtype; ``MASTER`` is the flat stores' fp32
   copy). Buffers, swap layouts, checkpoint manifests, ``state_dict()`` entries and the
   planner take their sizes and names from them; the kernel takes them by name
   (``kernel.rule_step(rule, param, grad, {name: tensor}, ...)``) and gets one typed struct
   whose constants were folded once, in Python (``kernels/adam_consts.py``, ``rule_consts.py``).
6. States in swap files live in one store, ``swapped_shards.SwappedShards``, with the rule's
   fields (fp32 params are their own master, updated in place) or those plus ``MASTER``;
   ``SwappedState`` is its one-shard face for fp32 CPU params. Its step is a swap session
   (``offload/swap/session.py``: prefetch a sub-group, compute it, write it back;
   ``swap/step.py`` commits it with the ranks' agreement, ``swap/agreement.py``), as are the
   checkpoint streaming and the group cache. Every store saves the one checkpoint format
   (``rank<r>/`` with typed fields; ``offload/zero/checkpoint.py`` reshards N -> M).
"""
from offload.optim.adam import Adam, AdamW
from offload.optim.adagrad import Adagrad
from offload.optim.base import RuleOptimizer
from offload.optim.functional import AdamHyper, RuleHyper, adam_step, rule_step
from offload.optim.lion import Lion
from offload.optim.sgd import SGD

__all__ = ["Adam", "AdamW", "SGD", "Adagrad", "Lion", "RuleOptimizer", "AdamHyper", "RuleHyper",
           "adam_step", "rule_step"]
