"""Compressed optimizer states: the scheme, written once in plain torch (the reference).

Every backend (native SIMD units, numba, the torch reference) encodes and decodes exactly as
the functions here do; the tests hold each of them to these functions bit for bit.

[Note: block-wise 8-bit states]
A blocked state keeps ``BLOCK`` (256) elements per block: 256 one-byte codes, then the
block's absmax as a little-endian float32: ``PACKED_BLOCK`` (260) bytes per block, blocks
back to back from the start of the state (a state of n elements takes ceil(n / 256) blocks;
codes past n in the last block are the zero code and are never read). Keeping a block's
scale beside its codes makes a state one byte buffer that slices at any multiple of 256
elements, so every layer that cuts a state into shards, sub-groups or files cuts it as it
cuts an fp32 state, at block boundaries.

- The maps are bitsandbytes' dynamic ("dynamic tree") maps as torchao builds them
  (``create_dynamic_map``): 256 sorted float32 values in [-1, 1] (signed: exp_avg, Lion's
  exp_avg, SGD's momentum buffer) or [0, 1] (unsigned: exp_avg_sq, Adagrad's sum), each
  with an exact 0 and 1.
- Encode a block of float32 values x: ``absmax = max |x|`` over the block's live elements;
  if that is not finite (a NaN or inf in the block) the block is stored as absmax = NaN with
  every code the zero code (it decodes to NaN: a poisoned step poisons the block, as torch's
  fp32 state would be poisoned element by element); if absmax == 0 every code is the zero
  code. Else ``xn = x / absmax`` (IEEE float32 division) and the code is the number of
  midpoints below xn: ``code = #{i : mid[i] < xn}``, ``mid[i] = (map[i] + map[i+1]) * 0.5``
  in float32 (nearest map value, ties to the lower one).
- Decode: ``map[code] * absmax`` (float32 multiply).
- [Note: square-root code] The unsigned states (exp_avg_sq, Adagrad's sum) are squares of
  grads, so a block of them spans twice the decades its grads do, and the dynamic map gives
  128 levels to the top decade but 16 to the fourth and 2 to the seventh: coded directly,
  every value below ~3e-7 of its block's absmax became 0, and Adam's update of such an
  element, m / (sqrt(0) + eps), grew by up to the ratio of its grad to eps (bench/RESULTS.md,
  thirteenth and sixteenth sessions). An unsigned state therefore codes the square root of
  its normalized value with the unsigned map: ``code = #{i : mid[i] < sqrt(max(xn, 0))}``
  (IEEE float32 division, then IEEE square root: every backend's bits), and decodes as
  ``map[code]**2 * absmax`` (``SQRT_DECODE[code] = map[code] * map[code]`` in float32, then
  the multiply). The absmax is still the values' own. Levels reach 1e-13 of the absmax, and
  the relative step of sqrt(v) (what Adam and Adagrad divide by) is the map's own. The
  ``"unsigned"`` code, the same map without the square root, is the first int8 checkpoints'
  (``CODES``); the library reads it to convert such files and writes only ``"sqrt"``.

[Note: stochastic rounding to bfloat16]
A float32 x rounds to bfloat16 stochastically as ``(bits(x) + r) >> 16`` with r a 16-bit
random number (a carry into the kept half happens with probability fraction / 2**16, as in
torchao's ``bf16_stochastic_round``); NaN becomes 0xFFFF as in the round-to-nearest path.
r comes from a counter-based hash of the element's index, so a value depends on its
element's index, not on how a backend cuts the range into threads or vectors:
``h = lowbias32((offset + i) mod 2**32 ^ seed ^ STREAMS[key(k)])`` and r is one 16-bit half
of h. ``seed`` (uint32) and ``offset`` (the first element's index) are the caller's; array k
is the param (k = 0) or state s (k = 1 + s). The param hashes with STREAMS[0] and takes the
top half. The states go in pairs (0, 1), (2, 3): both of a pair hash with the key of the
pair's first, STREAMS[1 + s - s % 2], the first taking the top half and the second the low
half. No two arrays share random bits, and Adam's two moments cost one hash per element
instead of two: in the fused bf16 AdamW loop the second hash was ~15 % of its time at 1M
elements, 7 % of its CPU time at 100M (``random_bits16``; bench/RESULTS.md, thirteenth session).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

__all__ = ["QuantArgs", "BLOCK", "PACKED_BLOCK", "SIGNED_MAP", "UNSIGNED_MAP", "SIGNED_MID", "UNSIGNED_MID",
           "SQRT_DECODE", "CODES", "default_code", "code_tables", "recode_blocks", "encode_blocks_exact",
           "STREAMS", "stream_key", "stream_shift", "packed_nbytes", "quant_map", "encode_blocks", "decode_blocks",
           "lowbias32", "random_bits16", "round_bf16_stochastic", "round_bf16_nearest", "rounding_seed", "zero_code"]

class QuantArgs(NamedTuple):
    """How a step with low-precision states or a bfloat16 param rounds (the kernels' face)."""

    seed: int = 0
    """uint32 seed of the stochastic rounding streams (the caller derives it per step)."""
    offset: int = 0
    """The index of the call's first element in the random streams."""
    stochastic_states: bool = False
    """bfloat16 states: stochastic rounding (True) or round to nearest even (False). A
    bfloat16 param (its own master) is always rounded stochastically."""


BLOCK = 256
PACKED_BLOCK = BLOCK + 4
STREAMS = (0x00000000, 0x68E31DA4, 0xB5297A4D, 0x1B56C4E9, 0x3C6EF372)
"""Stream constants by array k (param, then states 0..3); the odd states use their pair's
(see ``stream_key``), so STREAMS[2] and STREAMS[4] are not read."""


def stream_key(k: int) -> int:
    """The stream constant array k (0: param, 1 + s: state s) hashes with."""
    return STREAMS[0] if k == 0 else STREAMS[1 + (k - 1) - (k - 1) % 2]


def stream_shift(k: int) -> int:
    """16 when array k takes the top half of its hash, 0 when the low half."""
    return 0 if k > 0 and (k - 1) % 2 else 16


def _dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``: per
    decade 10**-6 .. 10**0 the midpoints of a linspace(0.1, 1) (float32), then 0 and 1."""
    data = []
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        b = torch.linspace(0.1, 1, items)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    data.sort()
    table = torch.tensor(data, dtype=torch.float32)
    assert table.numel() == 256 and table.unique().numel() == 256
    return table


SIGNED_MAP = _dynamic_map(True)
UNSIGNED_MAP = _dynamic_map(False)
SIGNED_MID = (SIGNED_MAP[:-1] + SIGNED_MAP[1:]) * 0.5
UNSIGNED_MID = (UNSIGNED_MAP[:-1] + UNSIGNED_MAP[1:]) * 0.5


SQRT_DECODE = UNSIGNED_MAP * UNSIGNED_MAP
"""The decode table of the ``"sqrt"`` code: the unsigned map's levels squared (float32)."""

CODES = ("signed", "sqrt", "unsigned")
"""How a blocked state maps values to codes: ``"signed"`` (int8 fields: the signed map),
``"sqrt"`` (uint8 fields: the unsigned map over sqrt(xn), [Note: square-root code]) and
``"unsigned"`` (uint8 fields of the first int8 checkpoints: the unsigned map over xn; read
only, to convert them)."""


def default_code(signed: bool) -> str:
    """The code the library writes for a signed (int8) or unsigned (uint8) blocked field."""
    return "signed" if signed else "sqrt"


def _check_code(code: str) -> str:
    if code not in CODES:
        raise ValueError(f"unknown int8 state code {code!r}; expected one of {list(CODES)}")
    return code


def code_tables(code: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(decode table[256], mid[255]) float32 of a code: decode = table[code] * absmax, and
    the code of a normalized value is the count of ``mid`` below it (below its square root
    for ``"sqrt"``)."""
    _check_code(code)
    if code == "signed":
        return SIGNED_MAP, SIGNED_MID
    return (SQRT_DECODE if code == "sqrt" else UNSIGNED_MAP), UNSIGNED_MID


def quant_map(signed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(decode table[256], mid[255]) float32 of the code the library writes for a signed or
    unsigned field (``code_tables(default_code(signed))``)."""
    return code_tables(default_code(signed))


def zero_code(signed: bool) -> int:
    """The code whose map value is exactly 0 (the same for every code of a signedness)."""
    return int((quant_map(signed)[0] == 0).nonzero()[0, 0])


def packed_nbytes(numel: int) -> int:
    """Bytes a blocked state of ``numel`` elements takes: ceil(numel / 256) * 260."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return -(-int(numel) // BLOCK) * PACKED_BLOCK


def encode_blocks(x: torch.Tensor, signed: bool, code: Optional[str] = None) -> torch.Tensor:
    """The packed blocks (uint8, ``packed_nbytes(x.numel())``) of float32 ``x``, in ``code``
    (default: the one the library writes for ``signed``)."""
    x = x.detach().reshape(-1)
    if x.dtype != torch.float32:
        raise TypeError(f"encode_blocks takes float32 values, got {x.dtype}")
    code = _check_code(code or default_code(signed))
    if (code == "signed") != bool(signed):
        raise ValueError(f"code {code!r} is for {'signed' if code == 'signed' else 'unsigned'} states")
    n = x.numel()
    nb = -(-n // BLOCK)
    mid = code_tables(code)[1]
    zc = zero_code(signed)
    padded = torch.zeros(nb * BLOCK, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(nb, BLOCK)
    absmax = blocks.abs().amax(dim=1) if nb else torch.zeros(0)
    bad = ~torch.isfinite(blocks).all(dim=1)
    absmax = torch.where(bad, torch.full_like(absmax, float("nan")), absmax)
    safe = torch.where(bad | (absmax == 0), torch.ones_like(absmax), absmax)
    codes = _codes(blocks, safe, code, mid)
    codes[bad | (absmax == 0)] = zc
    codes.view(-1)[n:] = zc
    out = torch.empty(nb, PACKED_BLOCK, dtype=torch.uint8)
    out[:, :BLOCK] = codes
    out[:, BLOCK:] = absmax.contiguous().view(torch.uint8).view(nb, 4)
    return out.view(-1)


def _codes(blocks: torch.Tensor, scale: torch.Tensor, code: str, mid: torch.Tensor) -> torch.Tensor:
    """uint8 codes of float32 ``blocks`` (rows) at per-row ``scale`` (the scheme's count of
    midpoints below x / scale, or below its square root for ``"sqrt"``)."""
    xn = blocks / scale[:, None]
    if code == "sqrt":
        # IEEE float32 square root, as the kernels' sqrtps: torch's float32 sqrt on the CPU
        # is not correctly rounded (sqrt(0.19140626) gave 0.4375 for 0.43750003), so it is
        # taken in float64 and rounded once to float32. That is exact: the square root of a
        # float32 is never within 2**-51 (relative) of a float32 midpoint, and float64's
        # error is below 2**-53.
        xn = torch.sqrt(torch.clamp_min(xn, 0.0).double()).float()
    return torch.searchsorted(mid, xn.contiguous(), right=False).to(torch.uint8)


_EXACT_CHUNK = 1 << 22
"""Elements ``encode_blocks_exact`` encodes at a time (a multiple of ``BLOCK``)."""

_SCALE_TRIES = (0, -1, 1, -2, 2, -3, 3)
"""Float32 steps (ulps) around a block's estimated scale that ``encode_blocks_exact`` tries."""


def encode_blocks_exact(x: torch.Tensor, signed: bool, code: Optional[str] = None) -> torch.Tensor:
    """``encode_blocks(x)``, except for a block that it would not give back exactly (decode
    of the packed block != x) and that some other scale gives back exactly: that block is
    stored with that scale (its codes by the scheme's rule at that scale).

    [Note: exact re-encoding] What loading a state in torch's layout into an int8 field
    uses. Values that came from decoding blocks of this scheme (an int8 optimizer's
    ``state_dict()``) are decode(codes, absmax) with absmax the block's largest magnitude
    before it was coded; in a block whose largest value was negative, the signed map's most
    negative level is -0.99297, not -1, so the largest decoded magnitude is 0.99297 x the
    absmax, and re-encoding with it as the absmax would re-round every code of the block
    (one code step at most, but a state_dict round trip should change nothing: a run that
    loads its own state_dict must go on as if it had not). Such a block's scale is
    recovered as largest |x| / |extreme level| (either extreme) and up to 3 float32 steps
    around it, the first that decodes to x exactly kept. Values from anywhere else (torch's
    fp32 states) are ~1 % off their nearest level, so no scale gives them back (a block of
    a few values may be the exception: one value alone is exact at its own scale) and they
    are encoded as ``encode_blocks`` does. A step never uses this: the kernels' encode is
    ``encode_blocks``."""
    x = x.detach().reshape(-1)
    if x.numel() > _EXACT_CHUNK:  # blocks are independent: a few temporaries of a chunk, not of x
        return torch.cat([encode_blocks_exact(x[i:i + _EXACT_CHUNK], signed, code)
                          for i in range(0, x.numel(), _EXACT_CHUNK)])
    packed = encode_blocks(x, signed, code)
    code = code or default_code(signed)
    n = x.numel()
    if n == 0:
        return packed
    nb = -(-n // BLOCK)
    back = decode_blocks(packed, n, signed, code)
    padded = torch.zeros(nb * BLOCK, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(nb, BLOCK)
    same = torch.ones(nb * BLOCK, dtype=torch.bool)
    same[:n] = back == x
    retry = ~same.view(nb, BLOCK).all(dim=1) & torch.isfinite(blocks).all(dim=1)
    if not bool(retry.any()):
        return packed
    rows = retry.nonzero().view(-1)
    sub = blocks[rows]
    table, mid = code_tables(code)
    peak = sub.abs().amax(dim=1)
    out = packed.view(nb, PACKED_BLOCK)
    # the peak is the extreme level times the scale, on the side of the element coded to it
    # (the peak's own sign tells nothing when a value of the other side decodes as large)
    for level in (table[0].abs(), table[-1]):
        if not level > 0 or rows.numel() == 0:
            continue
        guess = (peak / level).view(torch.int32)
        # only blocks that decode to within ~2**-20 of themselves at the guess came from codes
        # (other values are ~1 % off): the float32 steps around it are tried for those only
        # (the peak's share and the floor cover values that decode below float32's normal range)
        scale = guess.view(torch.float32)
        safe = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
        # a block's first 16 values first: torch's states fail there (a full pass over every
        # block for each extreme made a torch state_dict's load into int8 states 3x slower)
        near = _near_codes(sub[:, :_PROBE], safe, peak, code) & (safe == scale)
        if bool(near.any()):
            at_rows = near.nonzero().view(-1)
            near[at_rows] = _near_codes(sub[at_rows], safe[at_rows], peak[at_rows], code)
        left = torch.ones(rows.numel(), dtype=torch.bool)
        for step in _SCALE_TRIES:
            live = near & left
            if not bool(live.any()):
                break
            at = (guess[live] + step).view(torch.float32)
            ok = torch.isfinite(at) & (at > 0)
            at = torch.where(ok, at, torch.ones_like(at))
            codes = _codes(sub[live], at, code, mid)
            exact = ok & (table[codes.long()] * at[:, None] == sub[live]).all(dim=1)
            if bool(exact.any()):
                hit = rows[live][exact]
                out[hit, :BLOCK] = codes[exact]
                out[hit, BLOCK:] = at[exact].contiguous().view(torch.uint8).view(-1, 4)
                left[live.nonzero().view(-1)[exact]] = False
        keep = left  # the blocks still without a scale: the other extreme's guess
        rows, sub, peak = rows[keep], sub[keep], peak[keep]
    out[-1, n - (nb - 1) * BLOCK:BLOCK] = zero_code(signed)  # padding: the zero code
    return packed


_PROBE = 16


def _near_codes(values: torch.Tensor, scale: torch.Tensor, peak: torch.Tensor, code: str) -> torch.Tensor:
    """Rows of ``values`` that decode to within ~2**-20 of themselves at ``scale`` (the peak's
    share and the floor cover values that decode below float32's normal range)."""
    table, mid = code_tables(code)
    dec = table[_codes(values, scale, code, mid).long()] * scale[:, None]
    tol = values.abs() * 2.0 ** -20 + peak[:, None] * 2.0 ** -40 + 2.0 ** -146  # (8 subnormal steps)
    return ((dec - values).abs() <= tol).all(dim=1)


def decode_blocks(packed: torch.Tensor, numel: int, signed: bool, code: Optional[str] = None) -> torch.Tensor:
    """The float32 values (``numel`` of them) of packed blocks ``packed`` (uint8) in ``code``
    (default: the one the library writes for ``signed``)."""
    code = _check_code(code or default_code(signed))
    if (code == "signed") != bool(signed):
        raise ValueError(f"code {code!r} is for {'signed' if code == 'signed' else 'unsigned'} states")
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(numel):
        raise ValueError(f"a blocked state of {numel} elements is {packed_nbytes(numel)} uint8 "
                         f"bytes, got {packed.numel()} {packed.dtype}")
    nb = -(-numel // BLOCK)
    blocks = packed.reshape(nb, PACKED_BLOCK)
    codes = blocks[:, :BLOCK].long()
    absmax = blocks[:, BLOCK:].contiguous().view(torch.float32).view(nb, 1)
    table = code_tables(code)[0]
    return (table[codes] * absmax).view(-1)[:numel].clone()


def recode_blocks(packed: torch.Tensor, signed: bool, src: str, dst: str) -> None:
    """Whole packed blocks ``packed`` (uint8, a multiple of ``PACKED_BLOCK`` bytes) from code
    ``src`` to code ``dst``, in place: each block decoded and encoded again on its own (the
    zero code of padding decodes to 0 and encodes back to it; a NaN block stays one)."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() % PACKED_BLOCK:
        raise ValueError(f"recode_blocks takes whole packed blocks (1-D uint8, a multiple of {PACKED_BLOCK} bytes), "
                         f"got {packed.numel()} {packed.dtype}")
    if src == dst:
        return
    n = packed.numel() // PACKED_BLOCK * BLOCK
    packed.copy_(encode_blocks(decode_blocks(packed, n, signed, src), signed, dst))


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 hash of uint32 values held in int64 (result in [0, 2**32))."""
    m = 0xFFFFFFFF
    x = x & m
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
    x = x ^ (x >> 16)
    return x


def random_bits16(n: int, seed: int, offset: int, stream: int) -> torch.Tensor:
    """r of array ``stream`` (0: param, 1 + s: state s) for elements 0..n-1 of a call (see
    [Note: stochastic rounding to bfloat16]), int64."""
    if not 0 <= stream < len(STREAMS):
        raise ValueError(f"stream must be in 0..{len(STREAMS) - 1}, got {stream}")
    idx = (torch.arange(n, dtype=torch.int64) + int(offset)) & 0xFFFFFFFF
    h = lowbias32(idx ^ (int(seed) & 0xFFFFFFFF) ^ stream_key(stream))
    return (h >> stream_shift(stream)) & 0xFFFF


def round_bf16_stochastic(x: torch.Tensor, seed: int, offset: int, stream: int) -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16 stochastically (the note's scheme)."""
    x = x.detach().reshape(-1).float()
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = random_bits16(x.numel(), seed, offset, stream)
    hi = ((bits + r) >> 16) & 0xFFFF
    hi = torch.where(torch.isnan(x), torch.full_like(hi, 0xFFFF), hi)
    return _as_bf16(hi)


def rounding_seed(step: int, salt: int = 0) -> int:
    """The uint32 seed of a step's stochastic rounding: a hash of the step count and a
    store's ``salt`` (a param's or flat group's index), so every step and every array gets
    fresh random bits and a rerun of the same steps gets the same ones."""
    m = 0xFFFFFFFF
    x = (int(step) * 0x9E3779B1 ^ int(salt) * 0x85EBCA77) & m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)  # lowbias32, in Python ints (called per param per step)


def round_bf16_nearest(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16, nearest even, NaN -> 0xFFFF: the native units'
    conversion (torch's vectorized ``cvtfp32_bf16``; torch's scalar path writes NaN as
    0x7FC0, so ``x.to(torch.bfloat16)`` is not the reference for NaN)."""
    x = x.detach().reshape(-1).float()
    # In int32, on the bits (a float conversion would flush subnormals under
    # torch.set_flush_denormal; the kernels' integer rounding does not): the sum wraps only
    # for NaNs, masked below, and the cast to int16 keeps the low 16 bits of the shift. 3x
    # the speed of the same arithmetic in int64 (a torch state_dict's load into bf16 states).
    bits = x.view(torch.int32)
    out = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).to(torch.int16)
    return out.masked_fill_(torch.isnan(x), -1).view(torch.bfloat16)


def _as_bf16(hi: torch.Tensor) -> torch.Tensor:
    """bfloat16 values with bit patterns ``hi`` (int64 in [0, 2**16))."""
    signed16 = torch.where(hi >= 0x8000, hi - 0x10000, hi)
    return signed16.to(torch.int16).view(torch.bfloat16)
