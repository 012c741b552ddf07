"""offload.kernels.fields: the typed state fields every layer sizes its buffers from."""
import pytest
import torch

from offload.kernels.fields import (ADAM, MASTER, Rule, StateField, bytes_per_element, dtype_from_name,
                                    dtype_name, fields_bytes)


def test_adam_fields_are_torch_state_dict_keys_in_fp32():
    assert ADAM.names == ("exp_avg", "exp_avg_sq")
    assert all(f.dtype == torch.float32 and f.itemsize == 4 for f in ADAM.fields)
    assert [f.name for f in ADAM.with_master()] == ["master", "exp_avg", "exp_avg_sq"]
    assert bytes_per_element(ADAM.fields) == 8
    assert bytes_per_element(ADAM.with_master()) == 12


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2),
                                        (torch.int8, 1), (torch.uint8, 1)])
def test_field_bytes_follow_the_dtype(dtype, size):
    f = StateField("m", dtype)
    assert f.itemsize == size
    assert f.nbytes(4097) == 4097 * size
    assert fields_bytes([f, MASTER], 7) == 7 * (size + 4)
    assert StateField.from_description(f.describe()) == f
    assert dtype_from_name(dtype_name(dtype)) == dtype


def test_bad_fields_are_refused():
    with pytest.raises(ValueError, match="identifier"):
        StateField("exp avg")
    with pytest.raises(ValueError, match="float64"):
        StateField("m", torch.float64)
    with pytest.raises(ValueError, match="duplicate"):
        Rule("r", (StateField("m"), StateField("m")))
    with pytest.raises(ValueError, match="master"):
        Rule("r", (MASTER,))
    with pytest.raises(ValueError, match="numel"):
        MASTER.nbytes(-1)
    with pytest.raises(ValueError, match="unknown state dtype"):
        dtype_from_name("float8")
