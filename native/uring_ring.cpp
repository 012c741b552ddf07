// A minimal io_uring ring over raw syscalls: the ring of the `uring` engine where
// python-liburing cannot run (its 2026.3 wheels execute AVX-512 instructions and die of
// SIGILL on AVX2-only CPUs; offload/io/uring_ring.py, [Note: binding probed in a child]).
//
// No liburing and no <linux/io_uring.h>: the few kernel structs are declared here (the
// io_uring ABI is stable), so the library builds wherever the kernels build. Plain
// functions over one opaque handle; the Python side (offload/io/uring_native.py) keeps the
// queue, the reaper thread and the tickets, exactly as for python-liburing's ring, and calls
// these through ctypes (which releases the GIL). Threading: one thread at a time per ring
// (the engine's lock); the kernel's side of the rings is reached with acquire/release
// atomics, as liburing does.
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <new>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "offload_native.h"

namespace {

// The syscall numbers are the same on every architecture (io_uring came after the tables
// were unified).
constexpr long kSysSetup = 425, kSysEnter = 426, kSysRegister = 427;
constexpr uint8_t kOpRead = 22, kOpWrite = 23;  // IORING_OP_READ / IORING_OP_WRITE (Linux 5.6)
constexpr uint8_t kOpReadFixed = 4, kOpWriteFixed = 5;  // IORING_OP_READ_FIXED / WRITE_FIXED
constexpr unsigned kRegisterEventfd = 4;        // IORING_REGISTER_EVENTFD
constexpr uint32_t kFeatSingleMmap = 1u << 0;   // IORING_FEAT_SINGLE_MMAP
constexpr off_t kOffSqRing = 0, kOffCqRing = 0x8000000, kOffSqes = 0x10000000;

struct SqOffsets { uint32_t head, tail, ring_mask, ring_entries, flags, dropped, array, resv1; uint64_t user_addr; };
struct CqOffsets { uint32_t head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1; uint64_t user_addr; };
struct Params {
    uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd, resv[3];
    SqOffsets sq_off;
    CqOffsets cq_off;
};
struct Sqe {  // struct io_uring_sqe: 64 bytes; only the fields of a plain read/write are set
    uint8_t opcode, flags;
    uint16_t ioprio;
    int32_t fd;
    uint64_t off, addr;
    uint32_t len, rw_flags;
    uint64_t user_data;
    uint16_t buf_index, personality;  // buf_index: the registered buffer of a *_FIXED op
    int32_t splice_fd_in;
    uint64_t addr3, pad;
};
struct Cqe { uint64_t user_data; int32_t res; uint32_t flags; };
static_assert(sizeof(Params) == 120, "struct io_uring_params");
static_assert(sizeof(Sqe) == 64, "struct io_uring_sqe");
static_assert(sizeof(Cqe) == 16, "struct io_uring_cqe");

struct Ring {
    int fd = -1;
    uint32_t sq_entries = 0;
    uint32_t *sq_head = nullptr, *sq_tail = nullptr, *sq_mask = nullptr, *sq_array = nullptr;
    uint32_t *cq_head = nullptr, *cq_tail = nullptr, *cq_mask = nullptr;
    Sqe *sqes = nullptr;
    Cqe *cqes = nullptr;
    void *sq_map = MAP_FAILED, *cq_map = MAP_FAILED, *sqe_map = MAP_FAILED;
    size_t sq_len = 0, cq_len = 0, sqe_len = 0;
    uint32_t unsubmitted = 0;  // SQEs in the ring the kernel has not taken yet

    ~Ring() {
        if (sqe_map != MAP_FAILED) munmap(sqe_map, sqe_len);
        if (cq_map != MAP_FAILED && cq_map != sq_map) munmap(cq_map, cq_len);
        if (sq_map != MAP_FAILED) munmap(sq_map, sq_len);
        if (fd >= 0) close(fd);
    }
};

template <class T>
T *at(void *base, uint32_t offset) {
    return reinterpret_cast<T *>(static_cast<char *>(base) + offset);
}

int set_up(Ring &r, uint32_t entries) {
    Params p;
    std::memset(&p, 0, sizeof(p));
    const long fd = syscall(kSysSetup, entries, &p);
    if (fd < 0) return -errno;
    r.fd = static_cast<int>(fd);
    r.sq_entries = p.sq_entries;
    r.sq_len = p.sq_off.array + p.sq_entries * sizeof(uint32_t);
    r.cq_len = p.cq_off.cqes + p.cq_entries * sizeof(Cqe);
    const bool single = (p.features & kFeatSingleMmap) != 0;
    if (single && r.cq_len > r.sq_len) r.sq_len = r.cq_len;
    r.sq_map = mmap(nullptr, r.sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r.fd, kOffSqRing);
    if (r.sq_map == MAP_FAILED) return -errno;
    if (single) {
        r.cq_map = r.sq_map;
    } else {
        r.cq_map = mmap(nullptr, r.cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r.fd, kOffCqRing);
        if (r.cq_map == MAP_FAILED) return -errno;
    }
    r.sqe_len = p.sq_entries * sizeof(Sqe);
    r.sqe_map = mmap(nullptr, r.sqe_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r.fd, kOffSqes);
    if (r.sqe_map == MAP_FAILED) return -errno;
    r.sq_head = at<uint32_t>(r.sq_map, p.sq_off.head);
    r.sq_tail = at<uint32_t>(r.sq_map, p.sq_off.tail);
    r.sq_mask = at<uint32_t>(r.sq_map, p.sq_off.ring_mask);
    r.sq_array = at<uint32_t>(r.sq_map, p.sq_off.array);
    r.cq_head = at<uint32_t>(r.cq_map, p.cq_off.head);
    r.cq_tail = at<uint32_t>(r.cq_map, p.cq_off.tail);
    r.cq_mask = at<uint32_t>(r.cq_map, p.cq_off.ring_mask);
    r.cqes = at<Cqe>(r.cq_map, p.cq_off.cqes);
    r.sqes = static_cast<Sqe *>(r.sqe_map);
    return 0;
}

uint32_t load_acquire(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

}  // namespace

extern "C" {

int offload_uring_open(uint32_t entries, int eventfd, void **out) {
    if (out == nullptr || entries == 0) return -EINVAL;
    *out = nullptr;
    Ring *r = new (std::nothrow) Ring();
    if (r == nullptr) return -ENOMEM;
    int rc = set_up(*r, entries);
    if (rc == 0 && eventfd >= 0) {
        int32_t efd = eventfd;
        if (syscall(kSysRegister, r->fd, kRegisterEventfd, &efd, 1) < 0) rc = -errno;
    }
    if (rc != 0) {
        delete r;
        return rc;
    }
    *out = r;
    return 0;
}

int offload_uring_queue(void *ring, int n, const int32_t *writes, const int32_t *fds,
                        const uint64_t *addrs, const uint32_t *lens, const uint64_t *offsets,
                        const uint64_t *user_data, const int32_t *buf_index) {
    Ring *r = static_cast<Ring *>(ring);
    if (r == nullptr || n < 0 ||
        (n > 0 && (!writes || !fds || !addrs || !lens || !offsets || !user_data || !buf_index)))
        return -EINVAL;
    // The kernel moves sq_head as it consumes entries; we own the tail.
    uint32_t tail = *r->sq_tail;
    const uint32_t head = load_acquire(r->sq_head);
    const uint32_t mask = *r->sq_mask;
    int queued = 0;
    for (; queued < n && tail - head < r->sq_entries; ++queued, ++tail) {
        const uint32_t idx = tail & mask;
        Sqe &s = r->sqes[idx];
        std::memset(&s, 0, sizeof(s));
        const bool fixed = buf_index[queued] >= 0;
        s.opcode = writes[queued] ? (fixed ? kOpWriteFixed : kOpWrite) : (fixed ? kOpReadFixed : kOpRead);
        if (fixed) s.buf_index = static_cast<uint16_t>(buf_index[queued]);
        s.fd = fds[queued];
        s.off = offsets[queued];
        s.addr = addrs[queued];
        s.len = lens[queued];
        s.user_data = user_data[queued];
        r->sq_array[idx] = idx;
    }
    store_release(r->sq_tail, tail);
    r->unsubmitted += static_cast<uint32_t>(queued);
    return queued;
}

int offload_uring_submit(void *ring) {
    Ring *r = static_cast<Ring *>(ring);
    if (r == nullptr) return -EINVAL;
    if (r->unsubmitted == 0) return 0;
    const long n = syscall(kSysEnter, r->fd, r->unsubmitted, 0u, 0u, nullptr, 0);
    if (n < 0) return -errno;  // EAGAIN / EBUSY: the entries stay queued for the next call
    r->unsubmitted -= static_cast<uint32_t>(n) < r->unsubmitted ? static_cast<uint32_t>(n) : r->unsubmitted;
    return static_cast<int>(n);
}

int offload_uring_reap(void *ring, int max, uint64_t *user_data, int32_t *res) {
    Ring *r = static_cast<Ring *>(ring);
    if (r == nullptr || max < 0 || (max > 0 && (!user_data || !res))) return -EINVAL;
    uint32_t head = *r->cq_head;  // ours to move
    const uint32_t tail = load_acquire(r->cq_tail);
    const uint32_t mask = *r->cq_mask;
    int n = 0;
    for (; n < max && head != tail; ++n, ++head) {
        const Cqe &c = r->cqes[head & mask];
        user_data[n] = c.user_data;
        res[n] = c.res;
    }
    store_release(r->cq_head, head);
    return n;
}

int offload_uring_fd(void *ring) {
    Ring *r = static_cast<Ring *>(ring);
    return r == nullptr ? -EINVAL : r->fd;
}

void offload_uring_close(void *ring) { delete static_cast<Ring *>(ring); }

}  // extern "C"
