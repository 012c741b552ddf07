// The Adam loop shared by the SIMD units: full vectors, the part left over, and the
// streamed low-precision copy ([Note: streamed lowp copy] in dispatch.cpp) with its peel to
// the first aligned address and its closing fence.
//
// Include it *inside* a unit's anonymous namespace, after the unit has defined, with its
// own instruction set:
//   constexpr int64_t kLanes;          fp32 lanes of one vector
//   constexpr uintptr_t kStreamAlign;  bytes a streamed store of the copy must be aligned to
//   struct VConsts;                    the step's scalars, broadcast
//   template <int G, int L, bool L2, bool FROM_END, bool STREAM>
//   void adam_full(const VConsts &, const AdamBuffers &, int64_t i);           kLanes at i
//   template <int G, int L, bool L2, bool FROM_END>
//   void adam_part(const VConsts &, const AdamBuffers &, int64_t i, int64_t end);  < kLanes
// Each unit compiles its own copy with its own flags (see kernel.h); elements are
// independent, so how the range is cut never changes a value.

// [Note: software prefetch] in kernel.h: the four streams' lines kPrefetchAhead elements on.
template <int G>
inline void adam_prefetch(const AdamBuffers &b, int64_t i, int64_t end) {
    const int64_t j = i + kPrefetchAhead;
    if (j >= end) return;
    prefetch_write(b.param, j * 4);
    prefetch_write(b.exp_avg, j * 4);
    prefetch_write(b.exp_avg_sq, j * 4);
    prefetch_read(b.grad, j * grad_bytes(G));
}

template <int G, int L, bool L2, bool FROM_END>
void adam_loop(const AdamConsts &c, const AdamBuffers &b, int64_t begin, int64_t end) {
    const VConsts vc(c);
    int64_t i = begin;
    if constexpr (L >= 0) {
        const uintptr_t addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t *>(b.lowp) + i);
        if (b.stream_lowp && (addr & 1) == 0) {
            int64_t peel = static_cast<int64_t>(((kStreamAlign - (addr & (kStreamAlign - 1))) & (kStreamAlign - 1)) / 2);
            if (peel > end - i) peel = end - i;
            if (peel > 0) {
                adam_part<G, L, L2, FROM_END>(vc, b, i, i + peel);
                i += peel;
            }
            for (const int64_t start = i; i + kLanes <= end; i += kLanes) {
                if (b.prefetch && ((i - start) & 15) == 0) adam_prefetch<G>(b, i, end);
                adam_full<G, L, L2, FROM_END, true>(vc, b, i);
            }
            if (i < end) adam_part<G, L, L2, FROM_END>(vc, b, i, end);
            _mm_sfence();  // streamed stores are weakly ordered: visible before we return
            return;
        }
    }
    for (const int64_t start = i; i + kLanes <= end; i += kLanes) {
        if (b.prefetch && ((i - start) & 15) == 0) adam_prefetch<G>(b, i, end);
        adam_full<G, L, L2, FROM_END, false>(vc, b, i);
    }
    if (i < end) adam_part<G, L, L2, FROM_END>(vc, b, i, end);
}
