"""A Ctrl-C inside the NVMe param pager's own bookkeeping (offload/swap/sigint.py): landing
after a page was dropped and before it was marked on disk, it left a page of zeros marked
valid and training went on with zeros for params, silently; landing after a read and before
its pages were marked valid, the next call took the params' bytes for a write past the pager
and raised, blaming the user. Each pager call now holds a Ctrl-C until it is done: the
KeyboardInterrupt still comes, the step is dropped, and training goes on as torch's."""
from __future__ import annotations

import signal

import pytest
import torch
import torch.nn as nn

import offload
from offload.shard import gathered_params, runtime_of

HP = dict(lr=1e-2, betas=(0.85, 0.97), eps=1e-4, weight_decay=0.05)
STEPS, INTERRUPTED = 4, 1


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x).square().mean()


def _x(step):
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(step))


def _reference():
    """torch.optim.AdamW, the interrupted step left out."""
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HP)
    for step in range(STEPS):
        if step != INTERRUPTED:
            model(_x(step)).backward()
            opt.step()
            opt.zero_grad()
    return dict(model.named_parameters())


class _Madvise:
    """A region's mmap whose madvise calls ``after`` once it returned."""

    def __init__(self, mm, after) -> None:
        self.mm, self.after = mm, after

    def __getattr__(self, name):
        return getattr(self.mm, name)

    def madvise(self, *args):
        out = self.mm.madvise(*args)
        self.after()
        return out


@pytest.mark.parametrize("where", ["after_a_drop", "after_a_read"])
def test_a_ctrl_c_inside_the_pager_leaves_its_pages_as_they_are(tmp_path, where):
    model = offload.shard(_Net(), offload_params="nvme", swap_dir=str(tmp_path))
    opt = offload.AdamW(model.parameters(), **HP)
    tier = runtime_of(model).tier
    armed = []

    def ctrl_c():  # a SIGINT delivered right there: KeyboardInterrupt at the next bytecode
        if armed:
            armed.clear()
            signal.raise_signal(signal.SIGINT)

    if where == "after_a_drop":
        for a in tier._areas:
            a.region._mmap = _Madvise(a.region._mmap, ctrl_c)
    else:
        wait = tier._engine.wait
        tier._engine.wait = lambda ticket: (wait(ticket), ctrl_c())[0]
    for step in range(STEPS):
        if step == INTERRUPTED:
            armed.append(True)
            with pytest.raises(KeyboardInterrupt):
                model(_x(step)).backward()
            assert not armed  # it went off
            opt.zero_grad()
            continue
        model(_x(step)).backward()  # no "written in place outside offload" here
        opt.step()
        opt.zero_grad()
    got = gathered_params(model)
    for name, p in _reference().items():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    opt.close()
    tier.close()
