// SGD, Adagrad, Lion and AMSGrad, written once over a unit's vector primitives: each rule is a
// "body" (its broadcast scalars, its flags as template parameters, and one vector of work),
// run by the same loop as Adam's (full vectors; the part left over staged through
// zero-padded copies and run as one full vector, so every element sees the same
// arithmetic; the streamed low-precision copy with its peel and fence, see
// [Note: streamed lowp copy] in dispatch.cpp).
//
// Include it *inside* a unit's anonymous namespace, after the unit has defined, with its
// own instruction set:
//   constexpr int64_t kLanes; constexpr uintptr_t kStreamAlign (0: never streamed);
//   VF (the fp32 vector type); vset1, vload, vstore, vadd, vsub, vmul, vdiv, vsqrt,
//   vfmadd(a, b, c) = a * b + c (one rounding where the unit has FMA, as torch's kernels
//   are built), vsign (torch's vectorized sign: 1, -1, or 0 for zeros and NaN),
//   vmax_nan(a, b) (torch.maximum's vectorized form: b where a <= b or they are equal,
//   a where a > b, and the all-ones NaN where either is NaN);
//   template <int G> VF vload_grad(const void *, int64_t);
//   template <int L, bool STREAM> void vstore_lowp(void *, int64_t, VF); vfence().
// Then expand OFFLOAD_RULE_ENTRY_POINTS(ISA) at file scope. Statement order follows torch's
// _single_tensor_sgd / _single_tensor_adagrad and lion-pytorch's update_fn; the scalars
// are folded by offload/kernels/rule_consts.py.

template <bool WD, int MOM, bool NESTEROV>
struct SgdBody {
    VF gs, wd, mom, omd, neg_lr;
    explicit SgdBody(const offload_sgd_consts &c)
        : gs(vset1(c.grad_scale)), wd(vset1(c.weight_decay)), mom(vset1(c.momentum)),
          omd(vset1(c.one_minus_dampening)), neg_lr(vset1(c.neg_lr)) {}

    template <int G, int L, bool STREAM>
    inline void vec(const RuleBuffers &b, int64_t i) const {
        VF g = vmul(vload_grad<G>(b.grad, i), gs);
        VF p = vload(b.param + i);
        if (WD) g = vfmadd(p, wd, g);  // grad.add(param, alpha=weight_decay)
        VF update = g;
        if (MOM != 0) {
            // the first step's buffer is d_p itself (torch's clone: no dampening)
            VF buf = MOM == 1 ? g : vfmadd(g, omd, vmul(vload(b.state + i), mom));
            vstore(b.state + i, buf);
            update = NESTEROV ? vfmadd(buf, mom, g) : buf;
        }
        p = vfmadd(update, neg_lr, p);  // param.add_(update, alpha=-lr)
        vstore(b.param + i, p);
        vstore_lowp<L, STREAM>(b.lowp, i, p);
    }
};

template <bool WD>
struct AdagradBody {
    VF gs, wd, eps, neg_clr;
    explicit AdagradBody(const offload_adagrad_consts &c)
        : gs(vset1(c.grad_scale)), wd(vset1(c.weight_decay)), eps(vset1(c.eps)),
          neg_clr(vset1(c.neg_clr)) {}

    template <int G, int L, bool STREAM>
    inline void vec(const RuleBuffers &b, int64_t i) const {
        VF g = vmul(vload_grad<G>(b.grad, i), gs);
        VF p = vload(b.param + i);
        if (WD) g = vfmadd(p, wd, g);
        VF s = vfmadd(g, g, vload(b.state + i));  // addcmul_(g, g, value=1)
        VF std_ = vadd(vsqrt(s), eps);
        p = vadd(p, vdiv(vmul(neg_clr, g), std_));  // addcdiv_(g, std, value=-clr)
        vstore(b.state + i, s);
        vstore(b.param + i, p);
        vstore_lowp<L, STREAM>(b.lowp, i, p);
    }
};

template <bool FROM_END1, bool FROM_END2>
struct LionBody {
    VF gs, decay, c1, c2, neg_lr;
    explicit LionBody(const offload_lion_consts &c)
        : gs(vset1(c.grad_scale)), decay(vset1(c.decay)), c1(vset1(c.coeff1)),
          c2(vset1(c.coeff2)), neg_lr(vset1(c.neg_lr)) {}

    template <int G, int L, bool STREAM>
    inline void vec(const RuleBuffers &b, int64_t i) const {
        VF g = vmul(vload_grad<G>(b.grad, i), gs);
        VF p = vmul(vload(b.param + i), decay);
        VF m = vload(b.state + i);
        VF d = vsub(g, m);
        // torch.lerp from the start (m + w * d) or from the end (g + (w - 1) * d)
        VF u = vsign(vfmadd(c1, d, FROM_END1 ? g : m));
        p = vfmadd(u, neg_lr, p);  // exact product: u is 0 or +-1
        m = vfmadd(c2, d, FROM_END2 ? g : m);
        vstore(b.state + i, m);
        vstore(b.param + i, p);
        vstore_lowp<L, STREAM>(b.lowp, i, p);
    }
};

// torch's _single_tensor_adam with amsgrad=True: Adam's arithmetic, statement for statement
// that of the units' adam_math (the same FMAs), with the running maximum of exp_avg_sq in the
// denominator. exp_avg, exp_avg_sq, max_exp_avg_sq are state, state1, state2.
template <bool L2, bool FROM_END>
struct AmsgradBody {
    VF gs, l2, decay, coeff, b2, w2, bc2s, eps, nss;
    bool bc2_one;  // [Note: a bias correction of one] (kernel.h)
    explicit AmsgradBody(const AdamConsts &c)
        : gs(vset1(c.grad_scale)), l2(vset1(c.l2)), decay(vset1(c.decay)),
          coeff(vset1(c.lerp_coeff)), b2(vset1(c.beta2)), w2(vset1(c.one_minus_beta2)),
          bc2s(vset1(c.bc2_sqrt)), eps(vset1(c.eps)), nss(vset1(c.neg_step_size)),
          bc2_one(bias_correction_one(c.bc2_sqrt)) {}

    template <int G, int L, bool STREAM>
    inline void vec(const RuleBuffers &b, int64_t i) const {
        VF g = vmul(vload_grad<G>(b.grad, i), gs);
        VF p = vload(b.param + i);
        if (L2) g = vfmadd(p, l2, g);
        VF m = vload(b.state + i);
        m = vfmadd(coeff, vsub(g, m), FROM_END ? g : m);
        const VF v = vfmadd(vmul(w2, g), g, vmul(vload(b.state1 + i), b2));
        const VF vmax = vmax_nan(vload(b.state2 + i), v);  // torch.maximum(max_exp_avg_sq, exp_avg_sq)
        const VF root = vsqrt(vmax);
        const VF denom = vadd(bc2_one ? root : vdiv(root, bc2s), eps);
        p = vadd(vmul(p, decay), vdiv(vmul(nss, m), denom));  // torch's mul_ then addcdiv_: no FMA
        vstore(b.state + i, m);
        vstore(b.state1 + i, v);
        vstore(b.state2 + i, vmax);
        vstore(b.param + i, p);
        vstore_lowp<L, STREAM>(b.lowp, i, p);
    }
};

// Elements [i, end), fewer than kLanes: staged through zero-padded copies and run as one
// full vector, then the live part copied back.
template <int G, int L, class Body>
void rule_part(const Body &body, const RuleBuffers &b, int64_t i, int64_t end) {
    const int64_t left = end - i;
    alignas(64) float p[kLanes] = {}, s[kLanes] = {}, s1[kLanes] = {}, s2[kLanes] = {},
                      g[kLanes] = {};
    alignas(64) uint16_t lowp[kLanes] = {};
    const size_t gsz = G == OFFLOAD_F32 ? 4 : 2;
    memcpy(p, b.param + i, left * 4);
    memcpy(g, static_cast<const char *>(b.grad) + i * gsz, left * gsz);
    if (b.state) memcpy(s, b.state + i, left * 4);
    if (b.state1) memcpy(s1, b.state1 + i, left * 4);
    if (b.state2) memcpy(s2, b.state2 + i, left * 4);
    RuleBuffers t{p, g, b.state ? s : nullptr, lowp, b.grad_dtype, b.lowp_dtype, 0,
                  b.state1 ? s1 : nullptr, b.state2 ? s2 : nullptr};
    body.template vec<G, L, false>(t, 0);
    memcpy(b.param + i, p, left * 4);
    if (b.state) memcpy(b.state + i, s, left * 4);
    if (b.state1) memcpy(b.state1 + i, s1, left * 4);
    if (b.state2) memcpy(b.state2 + i, s2, left * 4);
    if (L >= 0) memcpy(static_cast<uint16_t *>(b.lowp) + i, lowp, left * 2);
}

// [Note: software prefetch] in kernel.h: param, state and grad lines kPrefetchAhead elements
// on (AMSGrad's other two states too); not in the scalar unit (kLanes 1), a reference.
template <int G>
inline void rule_prefetch(const RuleBuffers &b, int64_t i, int64_t end) {
    const int64_t j = i + kPrefetchAhead;
    if (kLanes == 1 || j >= end) return;
    prefetch_write(b.param, j * 4);
    if (b.state) prefetch_write(b.state, j * 4);
    if (b.state1) prefetch_write(b.state1, j * 4);
    if (b.state2) prefetch_write(b.state2, j * 4);
    prefetch_read(b.grad, j * grad_bytes(G));
}

template <int G, int L, class Body>
void rule_loop(const Body &body, const RuleBuffers &b, int64_t begin, int64_t end) {
    int64_t i = begin;
    if constexpr (L >= 0 && kStreamAlign > 0) {
        const uintptr_t addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t *>(b.lowp) + i);
        if (b.stream_lowp && (addr & 1) == 0) {
            const uintptr_t align = kStreamAlign > 0 ? kStreamAlign : 1;
            int64_t peel = static_cast<int64_t>(((align - (addr & (align - 1))) & (align - 1)) / 2);
            if (peel > end - i) peel = end - i;
            if (peel > 0) {
                rule_part<G, L>(body, b, i, i + peel);
                i += peel;
            }
            for (const int64_t start = i; i + kLanes <= end; i += kLanes) {
                if (b.prefetch && ((i - start) & 15) == 0) rule_prefetch<G>(b, i, end);
                body.template vec<G, L, true>(b, i);
            }
            if (i < end) rule_part<G, L>(body, b, i, end);
            vfence();  // streamed stores are weakly ordered: visible before we return
            return;
        }
    }
    for (const int64_t start = i; i + kLanes <= end; i += kLanes) {
        if (b.prefetch && ((i - start) & 15) == 0) rule_prefetch<G>(b, i, end);
        body.template vec<G, L, false>(b, i);
    }
    if (i < end) rule_part<G, L>(body, b, i, end);
}

template <int G, class Body>
int rule_lowp(const Body &body, const RuleBuffers &b, int64_t begin, int64_t end) {
    switch (b.lowp_dtype) {
        case -1: rule_loop<G, -1>(body, b, begin, end); return 0;
        case OFFLOAD_F16: rule_loop<G, OFFLOAD_F16>(body, b, begin, end); return 0;
        case OFFLOAD_BF16: rule_loop<G, OFFLOAD_BF16>(body, b, begin, end); return 0;
        default: return -EINVAL;
    }
}

template <class Body>
int rule_run(const Body &body, const RuleBuffers &b, int64_t begin, int64_t end) {
    switch (b.grad_dtype) {
        case OFFLOAD_F32: return rule_lowp<OFFLOAD_F32>(body, b, begin, end);
        case OFFLOAD_F16: return rule_lowp<OFFLOAD_F16>(body, b, begin, end);
        case OFFLOAD_BF16: return rule_lowp<OFFLOAD_BF16>(body, b, begin, end);
        default: return -EINVAL;
    }
}

// Run-time flags -> the body's template parameters.
template <bool WD>
int sgd_mode(const offload_sgd_consts &c, const RuleBuffers &b, int64_t begin, int64_t end) {
    switch (c.momentum_mode) {
        case 0: return rule_run(SgdBody<WD, 0, false>(c), b, begin, end);
        case 1: return c.nesterov ? rule_run(SgdBody<WD, 1, true>(c), b, begin, end)
                                  : rule_run(SgdBody<WD, 1, false>(c), b, begin, end);
        case 2: return c.nesterov ? rule_run(SgdBody<WD, 2, true>(c), b, begin, end)
                                  : rule_run(SgdBody<WD, 2, false>(c), b, begin, end);
        default: return -EINVAL;
    }
}

inline int sgd_range(const offload_sgd_consts &c, const RuleBuffers &b, int64_t begin, int64_t end) {
    return c.use_wd ? sgd_mode<true>(c, b, begin, end) : sgd_mode<false>(c, b, begin, end);
}

inline int adagrad_range(const offload_adagrad_consts &c, const RuleBuffers &b, int64_t begin, int64_t end) {
    return c.use_wd ? rule_run(AdagradBody<true>(c), b, begin, end)
                    : rule_run(AdagradBody<false>(c), b, begin, end);
}

inline int lion_range(const offload_lion_consts &c, const RuleBuffers &b, int64_t begin, int64_t end) {
    if (c.from_end1) {
        return c.from_end2 ? rule_run(LionBody<true, true>(c), b, begin, end)
                           : rule_run(LionBody<true, false>(c), b, begin, end);
    }
    return c.from_end2 ? rule_run(LionBody<false, true>(c), b, begin, end)
                       : rule_run(LionBody<false, false>(c), b, begin, end);
}

inline int amsgrad_range(const AdamConsts &c, const RuleBuffers &b, int64_t begin, int64_t end) {
    if (c.use_l2) {
        return c.lerp_from_end ? rule_run(AmsgradBody<true, true>(c), b, begin, end)
                               : rule_run(AmsgradBody<true, false>(c), b, begin, end);
    }
    return c.lerp_from_end ? rule_run(AmsgradBody<false, true>(c), b, begin, end)
                           : rule_run(AmsgradBody<false, false>(c), b, begin, end);
}

#define OFFLOAD_RULE_ENTRY_POINTS(ISA)                                                      \
    namespace offload {                                                                     \
    int amsgrad_range_##ISA(const AdamConsts &c, const RuleBuffers &b, int64_t begin,       \
                            int64_t end) { return amsgrad_range(c, b, begin, end); }        \
    int sgd_range_##ISA(const offload_sgd_consts &c, const RuleBuffers &b, int64_t begin,   \
                        int64_t end) { return sgd_range(c, b, begin, end); }                \
    int adagrad_range_##ISA(const offload_adagrad_consts &c, const RuleBuffers &b,          \
                            int64_t begin, int64_t end) { return adagrad_range(c, b, begin, end); } \
    int lion_range_##ISA(const offload_lion_consts &c, const RuleBuffers &b, int64_t begin, \
                         int64_t end) { return lion_range(c, b, begin, end); }              \
    }
