"""An 8-lane fp32 vector for numba kernels: the native units' __m256 as an LLVM <8 x float>.

numba has no vector type, and fp32 accumulators kept in a numpy array were loaded and
stored around every FMA (LLVM cannot keep an array's elements in registers across the
loop): _numba_sumsq ran 1.3-1.7x slower than a plain double-sum loop that way. A value of
this type is one SSA register, so locals of it stay in registers, and each operation below
is one vector instruction whose rounding is spelled out (``fma_sq`` is llvm.fma.v8f32: one
rounding per lane, as _mm256_fmadd_ps; no fastmath can reorder or fuse anything).

The loads read 8 lanes (16 bf16 elements) from ``&g[i]`` without a bounds check: the
caller keeps ``i`` within the array. They take any array and reinterpret its bytes, so an
inlined branch for another dtype still compiles (it is folded away, never run).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.datamodel.models import PrimitiveModel
from numba.extending import intrinsic, register_model

__all__ = ["F32x8", "zero", "load_f32", "load_f16", "load_bf16_even", "load_bf16_odd", "fma_sq",
           "add", "lane", "with_lane"]

_F32 = ir.FloatType()
_V8 = ir.VectorType(_F32, 8)
_I32V8 = ir.VectorType(ir.IntType(32), 8)


class F32x8Type(types.Type):
    def __init__(self):
        super().__init__(name="F32x8")


F32x8 = F32x8Type()


@register_model(F32x8Type)
class _F32x8Model(PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V8)


def _splat(value):
    """An i32 constant in every lane (value: its 32 bits, as unsigned)."""
    return ir.Constant(_I32V8, [value - (1 << 32) if value >= 1 << 31 else value] * 8)


def _address(context, builder, aryty, ary, idx, idxty, pointee):
    """&ary[idx] as a pointer to ``pointee`` (align: the array's element size)."""
    data = context.make_array(aryty)(context, builder, ary).data
    i = context.cast(builder, idx, idxty, types.intp)
    return builder.bitcast(builder.gep(data, [i]), pointee.as_pointer())


def _loader(body):
    """An intrinsic ``f(g, i) -> F32x8`` from ``body(builder, address, align)``."""
    def typer(typingctx, g, i):
        if not isinstance(g, types.Array) or not isinstance(i, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            aryty, idxty = signature.args
            align = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
            return body(builder, lambda t: _address(context, builder, aryty, args[0], args[1],
                                                    idxty, t), align)
        return F32x8(g, i), codegen
    typer.__name__ = body.__name__
    typer.__doc__ = body.__doc__
    return intrinsic(typer)


@_loader
def load_f32(builder, address, align):
    """The 8 fp32 elements at g[i] (g: fp32 or its bits as uint32)."""
    return builder.load(address(_V8), align=align)


def _bf16_words(builder, address, align):
    return builder.load(address(_I32V8), align=align)  # 16 bf16 as 8 little-endian words


@_loader
def load_bf16_even(builder, address, align):
    """Elements i, i + 2, ..., i + 14 of a bf16 grad (uint16 bits) as fp32: the low halves
    of the 8 words at g[i] (the AVX2 unit's split: lane l is element i + 2l)."""
    shifted = builder.shl(_bf16_words(builder, address, align), _splat(16))
    return builder.bitcast(shifted, _V8)


@_loader
def load_bf16_odd(builder, address, align):
    """Elements i + 1, i + 3, ..., i + 15 of a bf16 grad: the words' high halves."""
    high = builder.and_(_bf16_words(builder, address, align), _splat(0xFFFF0000))
    return builder.bitcast(high, _V8)


@_loader
def load_f16(builder, address, align):
    """The 8 fp16 elements at g[i] (uint16 bits) as fp32, exactly: _numba_bits.half_to_float
    lane by lane, in integer vector ops (no F16C needed, NaN payloads kept as there)."""
    h = builder.zext(builder.load(address(ir.VectorType(ir.IntType(16), 8)), align=align),
                     _I32V8)
    sign = builder.shl(builder.and_(h, _splat(0x8000)), _splat(16))
    exp = builder.and_(builder.lshr(h, _splat(10)), _splat(0x1F))
    mant = builder.and_(h, _splat(0x3FF))
    mant_hi = builder.shl(mant, _splat(13))
    normal = builder.or_(builder.shl(builder.add(exp, _splat(112)), _splat(23)), mant_hi)
    special = builder.or_(_splat(0x7F800000), mant_hi)  # inf / NaN
    # zero / subnormal: mant * 2**-24 is exact in fp32
    scaled = builder.fmul(builder.uitofp(mant, _V8), ir.Constant(_V8, [2.0 ** -24] * 8))
    sub = builder.bitcast(scaled, _I32V8)
    bits = builder.select(builder.icmp_unsigned("==", exp, _splat(0x1F)), special, normal)
    bits = builder.select(builder.icmp_unsigned("==", exp, _splat(0)), sub, bits)
    return builder.bitcast(builder.or_(sign, bits), _V8)


@intrinsic
def zero(typingctx):
    """All lanes +0.0."""
    def codegen(context, builder, signature, args):
        return ir.Constant(_V8, None)
    return F32x8(), codegen


@intrinsic
def fma_sq(typingctx, x, acc):
    """x * x + acc lane by lane, one fp32 rounding each (llvm.fma.v8f32)."""
    if x != F32x8 or acc != F32x8:
        return None

    def codegen(context, builder, signature, args):
        # declare_intrinsic knows no vector type's suffix: spell the name out
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8] * 3),
                                            "llvm.fma.v8f32")
        return builder.call(fn, [args[0], args[0], args[1]])
    return F32x8(F32x8, F32x8), codegen


@intrinsic
def add(typingctx, a, b):
    """a + b lane by lane in fp32."""
    if a != F32x8 or b != F32x8:
        return None

    def codegen(context, builder, signature, args):
        return builder.fadd(args[0], args[1])
    return F32x8(F32x8, F32x8), codegen


@intrinsic
def lane(typingctx, v, k):
    """Lane k (0 <= k < 8) as float32."""
    if v != F32x8 or not isinstance(k, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.extract_element(args[0], args[1])
    return types.float32(F32x8, k), codegen


@intrinsic
def with_lane(typingctx, v, k, x):
    """v with lane k (0 <= k < 8) set to x (a float32)."""
    if v != F32x8 or not isinstance(k, types.Integer) or x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.insert_element(args[0], args[2], args[1])
    return F32x8(F32x8, k, types.float32), codegen
