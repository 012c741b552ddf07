"""offload.shard.device.set_version under both signatures of torch's private
``_unsafe_set_version_counter``: tuples of tensors and versions (today's torch) and one
tensor and an int (torch 2.6, where every stage-3 forward failed with a TypeError)."""
import pytest
import torch

from offload.shard import device


@pytest.fixture
def tuple_form_restored():
    saved = list(device._TUPLE_FORM)
    yield
    device._TUPLE_FORM[:] = saved


def test_sets_the_counter_with_todays_torch(tuple_form_restored):
    t = torch.zeros(3)
    t.add_(1)
    before = t._version
    device.set_version(t, before + 5)
    assert t._version == before + 5
    device.set_version(t, before)
    assert t._version == before


def test_falls_back_to_the_one_tensor_form_of_torch_2_6(monkeypatch, tuple_form_restored):
    real = torch._C._autograd._unsafe_set_version_counter
    calls = []

    def old_signature(t, version):  # torch 2.6: (Tensor, int); a tuple is a TypeError
        if not isinstance(t, torch.Tensor) or not isinstance(version, int):
            raise TypeError("_unsafe_set_version_counter(): incompatible function arguments")
        calls.append(version)
        try:
            real((t,), (version,))
        except TypeError:
            real(t, version)

    monkeypatch.setattr(torch._C._autograd, "_unsafe_set_version_counter", old_signature)
    device._TUPLE_FORM[:] = [True]
    t = torch.zeros(2)
    device.set_version(t, 7)
    device.set_version(t, 9)
    assert t._version == 9 and calls == [7, 9]
    assert device._TUPLE_FORM == [False]  # found once, then called directly
