// The part of every ISA unit that is the same in all of them: picking the template
// instantiation of the unit's own `adam_loop` / `sumsq_loop` from run-time flags and dtypes,
// and the unit's two entry points (declared in kernel.h).
//
// Macros rather than shared functions on purpose: each expansion is compiled inside its
// own unit, with that unit's flags, and refers to that unit's anonymous-namespace loops, so
// no instruction set leaks across units (see kernel.h).
#ifndef OFFLOAD_UNIT_DISPATCH_H
#define OFFLOAD_UNIT_DISPATCH_H

// Expand inside the unit's anonymous namespace, after adam_loop and sumsq_loop.
#define OFFLOAD_UNIT_DISPATCH_TEMPLATES                                                     \
    template <int G, int L>                                                                 \
    void adam_flags(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end) { \
        if (c.use_l2) {                                                                     \
            if (c.lerp_from_end) adam_loop<G, L, true, true>(c, b, begin, end);             \
            else adam_loop<G, L, true, false>(c, b, begin, end);                            \
        } else {                                                                            \
            if (c.lerp_from_end) adam_loop<G, L, false, true>(c, b, begin, end);            \
            else adam_loop<G, L, false, false>(c, b, begin, end);                           \
        }                                                                                   \
    }                                                                                       \
    template <int G>                                                                        \
    int adam_lowp(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end) {  \
        switch (b.lowp_dtype) {                                                             \
            case -1: adam_flags<G, -1>(c, b, begin, end); return 0;                         \
            case OFFLOAD_F16: adam_flags<G, OFFLOAD_F16>(c, b, begin, end); return 0;       \
            case OFFLOAD_BF16: adam_flags<G, OFFLOAD_BF16>(c, b, begin, end); return 0;     \
            default: return -EINVAL;                                                        \
        }                                                                                   \
    }

// Expand at file scope, after the anonymous namespace: defines adam_range_<ISA> and
// sumsq_range_<ISA> in namespace offload.
#define OFFLOAD_UNIT_ENTRY_POINTS(ISA)                                                      \
    namespace offload {                                                                     \
    int adam_range_##ISA(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end) { \
        switch (b.grad_dtype) {                                                             \
            case OFFLOAD_F32: return adam_lowp<OFFLOAD_F32>(c, b, begin, end);              \
            case OFFLOAD_F16: return adam_lowp<OFFLOAD_F16>(c, b, begin, end);              \
            case OFFLOAD_BF16: return adam_lowp<OFFLOAD_BF16>(c, b, begin, end);            \
            default: return -EINVAL;                                                        \
        }                                                                                   \
    }                                                                                       \
    int sumsq_range_##ISA(const void *grad, int dtype, int64_t begin, int64_t end, double *out) { \
        switch (dtype) {                                                                    \
            case OFFLOAD_F32: *out = sumsq_loop<OFFLOAD_F32>(grad, begin, end); return 0;   \
            case OFFLOAD_F16: *out = sumsq_loop<OFFLOAD_F16>(grad, begin, end); return 0;   \
            case OFFLOAD_BF16: *out = sumsq_loop<OFFLOAD_BF16>(grad, begin, end); return 0; \
            default: return -EINVAL;                                                        \
        }                                                                                   \
    }                                                                                       \
    }

#endif
