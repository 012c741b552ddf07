// The work queue of the entry points (dispatch.cpp only): items that the caller and helper
// threads claim from a shared counter.
//
// Included by dispatch.cpp alone (baseline flags): its helpers live in an anonymous namespace.
#ifndef OFFLOAD_PARALLEL_H
#define OFFLOAD_PARALLEL_H

#include <atomic>
#include <cerrno>
#include <memory>
#include <stdint.h>
#include <thread>
#include <dlfcn.h>
#include <pthread.h>

#include "kernel.h"
#include "offload_native.h"

namespace {

// Below this many elements per thread, spawning a thread (~20-50 us) costs more than it
// saves (at ~1 G elements/s a thread does 64 K elements in ~60 us).
constexpr int64_t kMinPerThread = 1 << 16;

// Work is cut into fixed blocks that threads claim from a shared counter, rather than one
// static range per thread: on a shared machine (or beside the I/O threads of the swap
// pipeline) a slow or descheduled thread then delays one block, not half the step. The blocks do
// not depend on the thread count, so per-block results (sum of squares) combine in the
// same order whatever the thread count: results are reproducible.
#ifndef OFFLOAD_BLOCK_ELEMS
#define OFFLOAD_BLOCK_ELEMS (1 << 16)
#endif
constexpr int64_t kBlock = OFFLOAD_BLOCK_ELEMS;
// compressed steps cut ranges on the Q8 block grid ([Note: fused tiles] in compressed_tile.h)
static_assert(kBlock % offload::kTile == 0, "OFFLOAD_BLOCK_ELEMS must be a multiple of 256");

int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// Shared by the caller and its helper threads; heap-held so a helper that starts late
// (after the caller returned) touches only this, never the caller's stack.
struct WorkQueue {
    std::atomic<int64_t> next{0};
    std::atomic<int> active{0};  // helpers inside drain(): the caller waits for them
    std::atomic<int> first_error{0};
    int64_t items = 0;
};

// [Note: torch's OpenMP pool]
// torch runs its CPU ops on an OpenMP pool (the libgomp.so.1 of its wheel), whose threads
// spin for a while after each parallel op. A step right after backward (CPU params) or
// right after torch's own fused step then found the other core busy with a spinning pool
// thread, and its own helper thread got half of it: SGD's step over 25M params at two
// threads took 11.5 ms after a torch op against 7.4 ms alone (2026-12-05, this VM). So a
// parallel call runs on that pool when the process has loaded it: its threads are awake and
// nothing competes. The library does not link libgomp: it looks for one already loaded
// (dlopen RTLD_NOLOAD), and without one (no torch) it spawns its own threads as before.
// libgomp does not survive fork(): a child's first parallel region waits for the parent's
// threads, which it does not have (torch's own ops hang there, measured). A child of a
// process that loaded this library therefore never uses the pool (pthread_atfork); nor
// does one the Python side knows forked (OFFLOAD_POOL_OWN).
using GompParallel = void (*)(void (*)(void *), void *, unsigned, unsigned);

inline std::atomic<bool> &forked_since_load() {
    static std::atomic<bool> forked{false};
    return forked;
}

inline void mark_forked() { forked_since_load().store(true); }

// A child forked after this library was loaded never runs on the pool: registered at load
// (parallel.h is dispatch.cpp's alone, so this object is constructed once).
const struct ForkWatch {
    ForkWatch() { pthread_atfork(nullptr, nullptr, mark_forked); }
} fork_watch;

bool valid_pool(int pool) { return pool == OFFLOAD_POOL_AUTO || pool == OFFLOAD_POOL_OWN; }

// GOMP_parallel of the libgomp the process has loaded (nullptr: none, or forked since).
inline GompParallel loaded_omp_pool() {
    static const GompParallel fn = [] {
        void *h = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
        return h ? reinterpret_cast<GompParallel>(dlsym(h, "GOMP_parallel")) : nullptr;
    }();
    return forked_since_load().load(std::memory_order_relaxed) ? nullptr : fn;
}

template <typename Fn>
void drain(WorkQueue &q, Fn &fn) {
    for (;;) {
        int64_t item = q.next.fetch_add(1);
        if (item >= q.items) return;
        int rc = fn(item);
        if (rc != 0) {
            int expected = 0;
            q.first_error.compare_exchange_strong(expected, rc);
        }
    }
}

// One parallel call's work on the OpenMP pool: each thread of the team drains the queue.
template <typename Fn>
struct OmpJob {
    WorkQueue *q;
    Fn *fn;
    static void run(void *data) {  // on each thread of the team, the caller's included
        auto *job = static_cast<OmpJob *>(data);
        drain(*job->q, *job->fn);
    }
};

// On its own threads (no OpenMP pool, or OFFLOAD_POOL_OWN): helpers are spawned per call
// and detached; the caller works too and, once no item is left, waits only for helpers that
// claimed one. A helper the scheduler has not started yet is not waited for: on a busy machine a new thread can wait a whole scheduling
// period before its first run (measured here: 2 threads took 2x as long as 1 while the
// caller waited to join an idle helper). A late helper finds no item, so it never calls
// fn, and leaves. Ordering: a helper raises `active` before claiming (seq_cst), so a
// helper that claimed an item is counted before the caller's last failed claim. No thread
// outlives the work it claimed and none is kept between calls, so a fork() between two
// calls finds no pool to rebuild.
template <typename Fn>
int parallel_items_impl(int64_t items, int threads, Fn &fn, int pool) {
    auto q = std::make_shared<WorkQueue>();
    q->items = items;
    if (threads > 1 && items > 1 && pool == OFFLOAD_POOL_AUTO) {
        if (GompParallel omp = loaded_omp_pool()) {  // [Note: torch's OpenMP pool]
            OmpJob<Fn> job{q.get(), &fn};
            omp(&OmpJob<Fn>::run, &job, static_cast<unsigned>(threads < items ? threads : items), 0);
            return q->first_error.load();
        }
    }
    Fn *fp = &fn;
    for (int t = 1; t < threads && t < items; ++t) {
        try {
            std::thread([q, fp] {
                q->active.fetch_add(1);
                drain(*q, *fp);
                q->active.fetch_sub(1);
            }).detach();
        } catch (...) {
            break;  // fewer helpers: the caller still does every item left
        }
    }
    drain(*q, fn);
    while (q->active.load() != 0) std::this_thread::yield();
    return q->first_error.load();
}

// Runs fn(item) -> int for every item in [0, items) on up to `threads` threads (the caller
// is one of them), of the OpenMP pool or its own (pool: OFFLOAD_POOL_*). Returns the first
// nonzero result; never throws (the only allocation that can fail is the bookkeeping,
// reported as -ENOMEM).
template <typename Fn>
int parallel_items(int64_t items, int threads, Fn fn, int pool) noexcept {
    try {
        return parallel_items_impl(items, threads, fn, pool);
    } catch (...) {
        return -ENOMEM;
    }
}

// The threads worth starting for n elements of work: at most `requested`, one per
// kMinPerThread elements, at least 1.
int threads_for(int64_t n, int requested) {
    int64_t by_size = n / kMinPerThread;
    int64_t t = requested < by_size ? requested : by_size;
    return t < 1 ? 1 : static_cast<int>(t);
}

// Runs fn(begin, end, block) -> int over [0, n) in kBlock blocks on up to `threads` threads.
template <typename Fn>
int parallel_blocks(int64_t n, int threads, Fn fn, int pool) noexcept {
    auto by_block = [n, &fn](int64_t blk) -> int {
        const int64_t begin = blk * kBlock, end = begin + kBlock < n ? begin + kBlock : n;
        return fn(begin, end, blk);
    };
    return parallel_items(num_blocks(n), threads, by_block, pool);
}

}  // namespace

#endif
