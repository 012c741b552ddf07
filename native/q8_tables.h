// The per-call tables of Q8 states (kernel.h's Q8Tables) built from the caller's map and
// midpoints. Included by dispatch.cpp only (compiled without wider instruction sets).
#ifndef OFFLOAD_Q8_TABLES_H
#define OFFLOAD_Q8_TABLES_H

#include <memory>
#include <stdint.h>
#include <string.h>

#include "kernel.h"
#include "q8_buckets.h"

namespace {

using offload::Q8Buckets;
using offload::Q8Tables;
using offload::Q8Vbmi;

// The midpoints in Eytzinger order: level k (1..8) node j at tree[2^(k-1) + j] is
// mid[j * 2^(9-k) + 2^(8-k) - 1] (quant_scalar.h's q8_code_one walks it).
inline void build_tree(const float *mid, float *tree) {
    tree[0] = 0.0f;  // unused
    for (int k = 1; k <= 8; ++k)
        for (int j = 0; j < (1 << (k - 1)); ++j)
            tree[(1 << (k - 1)) + j] = mid[j * (1 << (9 - k)) + (1 << (8 - k)) - 1];
}

// The code whose map value is 0 (both maps have one); -1 if none.
inline int find_zero_code(const float *map) {
    for (int i = 0; i < 256; ++i)
        if (map[i] == 0.0f) return i;
    return -1;
}

// The tables that depend on the midpoints only (the bucket table and the VBMI unit's).
struct Q8MidTables {
    Q8Buckets buckets;
    Q8Buckets shared;  // the same codes, sign-shared keys ([Note: sign-shared keys])
    Q8Vbmi vbmi;
};

// The tables of midpoints mid. Building them takes ~50 us, longer than a small tensor's
// step, so each thread keeps those of the last two maps it saw (the signed and the
// unsigned), keyed by their midpoints' bytes. The pointer stays valid through the caller's
// step (its workers only read it).
inline const Q8MidTables *cached_mid_tables(const float *mid) {
    struct Slot {
        float mid[255];
        Q8MidTables tables;
        bool used = false;
    };
    thread_local std::unique_ptr<Slot[]> slots(new Slot[2]);
    thread_local int next = 0;
    for (int i = 0; i < 2; ++i) {
        if (slots[i].used && memcmp(slots[i].mid, mid, sizeof slots[i].mid) == 0) {
            next = i ^ 1;  // least recently used: a step's two maps never evict each other
            return &slots[i].tables;
        }
    }
    Slot &s = slots[next];
    next ^= 1;
    memcpy(s.mid, mid, sizeof s.mid);
    build_q8_buckets(mid, s.tables.buckets);
    build_q8_buckets_shared(mid, s.tables.shared);
    build_q8_vbmi(mid, s.tables.buckets, s.tables.vbmi);
    s.used = true;
    return &s.tables;
}

// The tables of one call's two maps (index 0: signed, 1: unsigned), built on first use.
struct Q8Built {
    alignas(64) float tree[2][256];
    alignas(64) uint16_t halves[2][512];
    alignas(64) uint8_t map_bytes[2][4][256];
    int zero[2] = {-1, -1};
    const Q8MidTables *mid_tables[2] = {nullptr, nullptr};

    // Q8Tables of map m; false if the map has no exact 0 (no zero code to pad with).
    bool tables(int m, const float *map, const float *mid, Q8Tables &out) {
        if (zero[m] < 0 && !build(m, map, mid)) return false;
        const Q8MidTables &t = *mid_tables[m];
        out = Q8Tables{map, halves[m], tree[m], static_cast<uint8_t>(zero[m]),
                       t.buckets.ok ? &t.buckets : nullptr, map_bytes[m], t.vbmi.ok ? &t.vbmi : nullptr,
                       m == 1,  // the unsigned map (Q8U) codes square roots
                       t.shared.ok ? &t.shared : nullptr};
        return true;
    }

  private:
    bool build(int m, const float *map, const float *mid) {
        zero[m] = find_zero_code(map);
        if (zero[m] < 0) return false;
        build_tree(mid, tree[m]);
        for (int i = 0; i < 256; ++i) {
            uint32_t bits;
            memcpy(&bits, map + i, 4);
            halves[m][i] = static_cast<uint16_t>(bits);
            halves[m][256 + i] = static_cast<uint16_t>(bits >> 16);
            for (int j = 0; j < 4; ++j) map_bytes[m][j][i] = static_cast<uint8_t>(bits >> (8 * j));
        }
        mid_tables[m] = cached_mid_tables(mid);
        return true;
    }
};

}  // namespace

#endif
