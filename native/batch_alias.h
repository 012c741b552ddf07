// Whether the structs of a batch share memory (dispatch.cpp's offload_rule_steps only).
//
// [Note: aliased entries]
// offload_rule_steps spreads the blocks of all its structs over threads that claim them in
// any order. Two structs over the same memory (a param listed twice in a group, as torch
// allows with a warning and steps twice; one state tensor handed to two params) would then
// race: block b of the second step could run before, or while, block b of the first, and
// a step was lost in some runs (an adversarial pass, twenty-ninth session: 8 of 60 runs
// of AdamW([p, p]) at 2 threads). On one thread the items run in struct order, which is
// the result of the calls one after another; so a batch in which an array of one struct
// overlaps any array of another runs on one thread. (Overlaps of two reads, a grad shared
// by two params, are counted too: rarer than they are worth telling apart, and the cost
// is speed only.) Exact byte ranges: the views of one flat buffer side by side, as the
// flat stores hand them, do not overlap and keep their threads.
#ifndef OFFLOAD_BATCH_ALIAS_H
#define OFFLOAD_BATCH_ALIAS_H

#include <algorithm>
#include <stdint.h>
#include <vector>

#include "offload_native.h"

namespace {

// The bytes of n elements of an array of dtype (Q8: its packed blocks).
inline int64_t array_bytes(int dtype, int64_t n) {
    switch (dtype) {
        case OFFLOAD_F16:
        case OFFLOAD_BF16: return 2 * n;
        case OFFLOAD_Q8S:
        case OFFLOAD_Q8U: return (n + OFFLOAD_Q8_BLOCK - 1) / OFFLOAD_Q8_BLOCK * OFFLOAD_Q8_PACKED;
        default: return 4 * n;
    }
}

struct AliasSpan {
    uintptr_t lo, hi;
    int64_t entry;
    bool operator<(const AliasSpan &o) const { return lo < o.lo; }
};

// Whether two arrays that struct a writes (param, lowp, its states) overlap: a param that is
// its own exp_avg. Each unit would store last a different one of the two, so no bits are
// right: the struct is refused (-EINVAL) before anything runs.
inline bool struct_overlaps_itself(const offload_step_args &a) {
    if (a.n <= 0) return false;
    uintptr_t lo[2 + OFFLOAD_MAX_STATES], hi[2 + OFFLOAD_MAX_STATES];
    int m = 0;
    auto add = [&](const offload_array &x) {
        if (x.data == nullptr) return;
        lo[m] = reinterpret_cast<uintptr_t>(x.data);
        hi[m] = lo[m] + static_cast<uintptr_t>(array_bytes(x.dtype, a.n));
        ++m;
    };
    add(a.param);
    add(a.lowp);
    for (int k = 0; k < a.num_states && k < OFFLOAD_MAX_STATES; ++k) add(a.states[k]);
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < i; ++j)
            if (lo[i] < hi[j] && lo[j] < hi[i]) return true;
    return false;
}

// Whether an array of one of args[0..count) overlaps an array of another (structs of no
// elements take no part). Called after every struct was checked.
inline bool batch_aliases(const offload_step_args *args, int64_t count) {
    std::vector<AliasSpan> spans;
    spans.reserve(static_cast<size_t>(count) * 4);
    auto add = [&spans](const offload_array &a, int64_t n, int64_t entry) {
        if (a.data == nullptr) return;
        const uintptr_t lo = reinterpret_cast<uintptr_t>(a.data);
        spans.push_back(AliasSpan{lo, lo + static_cast<uintptr_t>(array_bytes(a.dtype, n)), entry});
    };
    for (int64_t i = 0; i < count; ++i) {
        const offload_step_args &a = args[i];
        if (a.n <= 0) continue;
        add(a.param, a.n, i);
        add(a.grad, a.n, i);
        add(a.lowp, a.n, i);
        for (int k = 0; k < a.num_states && k < OFFLOAD_MAX_STATES; ++k) add(a.states[k], a.n, i);
    }
    std::sort(spans.begin(), spans.end());
    // Sweep in address order. With no overlap found so far, the spans still open (reaching
    // past the current start) all belong to one struct: the one of the farthest end.
    uintptr_t open_hi = 0;
    int64_t open_entry = -1;
    for (const AliasSpan &s : spans) {
        if (s.lo < open_hi && s.entry != open_entry) return true;
        if (s.hi > open_hi) {
            open_hi = s.hi;
            open_entry = s.entry;
        }
    }
    return false;
}

}  // namespace

#endif
