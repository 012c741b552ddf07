"""The int8 encoders (native/q8_buckets.h's bucket table, every ISA; numba) on chosen values.

The code of xn is #{i : mid[i] < xn} (quant.py). Held here, with absmax 1 (xn = the value),
on a million random floats of [-1, 1] (uniform and spread over every exponent), every
midpoint and its two float neighbours, the bucket edges (powers of two, 2^-30 and 2^-31, and
their neighbours), +-0, +-1 and subnormals; for the signed and the unsigned map (the latter
through the signed state, by pointing the backend's signed tables at it), and for a map too
dense for the bucket table (the tree search it falls back to). tools/q8_exhaustive.py runs
the same comparison on every float32 in [-1, 1]. The decoders are held to quant.decode_blocks
on every code at every position of a block; the numpy table (q8_buckets.py, numba's) to the
midpoint count directly.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import offload.kernels as K
from offload.kernels import native_backend, numba_backend, q8_buckets, quant
from offload.kernels.fields import SGD

from test_kernels import _native_or_none

NATIVE = _native_or_none()
ISAS = NATIVE.supported if NATIVE is not None else []


def _values(mid: torch.Tensor, n_random: int = 1_000_000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(15)
    uniform = torch.rand(n_random // 2, generator=gen) * 2 - 1
    spread = torch.exp2(-torch.rand(n_random - n_random // 2, generator=gen) * 40)  # 2^-40 .. 1
    spread = spread * torch.where(torch.rand(spread.numel(), generator=gen) < 0.5, -1.0, 1.0)
    edges = torch.cat([torch.exp2(-torch.arange(0, 40, dtype=torch.float32)),
                       torch.tensor([1e-45, 1e-40, 1.17549435e-38, 0.0])])
    edges = torch.cat([edges, -edges])
    points = torch.cat([mid, edges])
    near = torch.cat([points, torch.nextafter(points, torch.tensor(-2.0)),
                      torch.nextafter(points, torch.tensor(2.0))])
    vals = torch.cat([uniform, spread, near])
    return vals[vals.abs() <= 1]


def _encode(backend, vals: torch.Tensor) -> torch.Tensor:
    """Codes of vals through SGD's first-step buffer, 255 values and a 1.0 per block."""
    m = -(-vals.numel() // 255)
    g = torch.zeros(m, 256)
    padded = torch.zeros(m * 255)
    padded[:vals.numel()] = vals
    g[:, :255] = padded.view(m, 255)
    g[:, 255] = 1.0
    crule = SGD.with_state_dtype("int8")
    f = crule.fields[0]
    buf = torch.zeros(f.storage_numel(g.numel()), dtype=f.storage_dtype)
    backend.rule_step(crule, torch.zeros(g.numel()), g.view(-1), {"momentum_buffer": buf}, step=1,
                      lr=0.0, momentum=0.9, num_threads=2)
    codes = buf.view(torch.uint8).view(m, quant.PACKED_BLOCK)[:, :255].reshape(-1)
    return codes[:vals.numel()]


def _use_map(monkeypatch, table: torch.Tensor, mid: torch.Tensor):
    """The backends' signed map and midpoints become (table, mid) for this test."""
    table, mid = table.contiguous(), mid.contiguous()
    keep = (table, mid)  # the library reads raw pointers: keep the tensors alive
    ptrs = native_backend._TABLE_PTRS
    monkeypatch.setattr(native_backend, "_TABLE_PTRS", (table.data_ptr(), mid.data_ptr()) + ptrs[2:])
    monkeypatch.setitem(numba_backend._QUANT_MAPS, True, numba_backend.quant_tables(
        table.numpy(), mid.numpy(), int((table == 0).nonzero()[0, 0])))
    return keep


def _backends():
    out = [pytest.param(("native", isa), id=f"native-{isa}") for isa in ISAS]
    return out + [pytest.param(("numba", ""), id="numba")]


@pytest.fixture(params=_backends())
def backend(request, monkeypatch):
    name, isa = request.param
    if name == "native" and NATIVE is None:
        pytest.skip("native library not built")
    try:
        b = K.get_backend(name)
    except RuntimeError as exc:
        pytest.skip(f"{name}: {exc}")
    if isa:
        monkeypatch.setenv("OFFLOAD_ISA", isa)
    return b


def _dense_map() -> torch.Tensor:
    """A sorted map with an exact 0 whose midpoints crowd [0.5, 0.5 + 2^-14): two in one
    bucket at any mantissa width the table allows, so the encoder searches the tree."""
    crowd = 0.5 + torch.arange(250, dtype=torch.float32) * 2.0 ** -22
    t = torch.cat([torch.tensor([-1.0, -0.25, 0.0, 0.125]), crowd, torch.tensor([0.75, 1.0])])
    assert t.numel() == 256 and bool((t[1:] > t[:-1]).all())
    return t


def _lopsided_map() -> torch.Tensor:
    """A sorted map with an exact 0 whose midpoints in [0.5, 0.75) are 2^-10 apart and whose
    negative side is sparse: the bucket table fits it (9 mantissa bits at one positive
    exponent), the table with sign-shared keys ([Note: sign-shared keys], the AVX2 unit's)
    does not (the negative side would take as many buckets), so the AVX2 unit reads the
    plain table."""
    t = torch.cat([torch.tensor([-1.0, -0.25, 0.0, 0.125]), 0.5 + torch.arange(251, dtype=torch.float32) * 2.0**-10,
                   torch.tensor([1.0])])
    assert t.numel() == 256 and bool((t[1:] > t[:-1]).all())
    return t


def _map_of(which: str):
    if which in ("dense", "lopsided"):
        table = _dense_map() if which == "dense" else _lopsided_map()
        return table, (table[:-1] + table[1:]) * 0.5
    return quant.quant_map(which == "signed")


def _shared_buckets(mid: torch.Tensor) -> int:
    """The buckets of the table with sign-shared keys: per exponent the mantissa bits the
    plainer table gives the sign that needs more, for both signs."""
    table = q8_buckets.build(mid.numpy())
    bits = 23 - (table[:64].view(np.int32) & 31)
    return 2 * int((1 << np.maximum(bits[:32], bits[32:]).astype(np.int64)).sum())


def test_the_maps_take_the_tables_they_are_meant_to():
    for which in ("signed", "unsigned"):  # the library's maps: the AVX2 unit's shared table
        assert _shared_buckets(_map_of(which)[1]) <= q8_buckets.MAX_BUCKETS
    mid = _map_of("lopsided")[1]
    assert q8_buckets.build(mid.numpy()) is not None and _shared_buckets(mid) > q8_buckets.MAX_BUCKETS


@pytest.mark.parametrize("which", ["signed", "unsigned", "dense", "lopsided"])
def test_encoder_is_the_midpoint_count(backend, which, monkeypatch):
    if which in ("dense", "lopsided"):
        table, mid = _map_of(which)
    else:
        table, mid = quant.quant_map(which == "signed")
    keep = _use_map(monkeypatch, table, mid)  # noqa: F841 (alive through the calls)
    vals = _values(mid)
    got = _encode(backend, vals)
    want = torch.searchsorted(mid, vals, right=False).to(torch.uint8)
    bad = (got != want).nonzero().view(-1)
    assert bad.numel() == 0, (f"{bad.numel()} wrong codes; first x = {vals[bad[0]].item()!r}: "
                              f"{got[bad[0]].item()} != {want[bad[0]].item()}")


def test_the_dense_map_is_dense():
    # the fallback test above means something only if the table refuses that map: at 10
    # mantissa bits the crowd's bucket at 0.5 spans 2^-11, holding many of its midpoints
    mid = (_dense_map()[:-1] + _dense_map()[1:]) * 0.5
    in_first_bucket = ((mid >= 0.5) & (mid < 0.5 + 2.0 ** -11)).sum().item()
    assert in_first_bucket > 2


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_numpy_table_is_the_midpoint_count(signed):
    mid = quant.quant_map(signed)[1]
    table = q8_buckets.build(mid.numpy())
    assert table is not None and table.dtype == np.uint32 and table.size == 64 + q8_buckets.MAX_BUCKETS
    vals = _values(mid)
    want = torch.searchsorted(mid, vals, right=False).to(torch.uint8).numpy()
    assert (q8_buckets.code_of(table, vals.numpy()) == want).all()


def test_numpy_table_refuses_what_does_not_fit():
    table = _dense_map()
    assert q8_buckets.build(((table[:-1] + table[1:]) * 0.5).numpy()) is None
    assert q8_buckets.build(quant.SIGNED_MID.flip(0).numpy()) is None  # unsorted
    assert q8_buckets.build(quant.SIGNED_MID[:100].numpy()) is None  # not 255 midpoints


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_decoder_reads_every_code(backend, signed, monkeypatch):
    # every code at every position of a block (the AVX-512 decoder reorders 32 codes for its
    # 16-bit lookups), absmax from tiny to large, a partial last block: SGD's second step
    # with momentum 1, dampening 0, grad 0 and lr 1 leaves param = -decode(buffer)
    table, mid = quant.quant_map(signed)
    keep = _use_map(monkeypatch, table, mid)  # noqa: F841 (alive through the calls)
    n = 9 * 256 + 77
    codes = torch.stack([(torch.arange(256) * k + k) % 256 for k in (1, 3, 5, 7, 11, 13, 17, 19, 23, 29)])
    packed = torch.zeros(10, quant.PACKED_BLOCK, dtype=torch.uint8)
    packed[:, :256] = codes.to(torch.uint8)
    scales = torch.tensor([1.0, 3.7, 1e-30, 1e-40, 2.5e38, 0.5, 7.0, 1e-3, 1e3, 0.1])
    packed[:, 256:] = scales.view(-1, 1).contiguous().view(torch.uint8).view(10, 4)
    packed = packed.view(-1)[:quant.packed_nbytes(n)].clone()
    want = quant.decode_blocks(packed, n, signed)
    crule = SGD.with_state_dtype("int8")
    param = torch.zeros(n)
    backend.rule_step(crule, param, torch.zeros(n), {"momentum_buffer": packed}, step=2, lr=1.0,
                      momentum=1.0, dampening=0.0, num_threads=2)
    assert torch.equal(param, -want)
