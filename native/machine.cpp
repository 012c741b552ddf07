// What this machine can run, probed once: the ISA levels and the CPU's vendor (machine.h).
//
// Compiled with baseline x86-64 flags only, as dispatch.cpp.
#include <cerrno>
#include <cpuid.h>

#include "machine.h"
#include "offload_native.h"

namespace {

bool has_f16c() {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    return (c & bit_F16C) != 0;
}

// AVX512_VBMI: CPUID leaf 7, ECX bit 1 (read directly: older compilers' __builtin_cpu_supports
// may not know the name; __get_cpuid_count needs GCC 7 or later, __cpuid_count does not).
bool has_vbmi() {
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    unsigned a, b, c, d;
    __cpuid_count(7, 0, a, b, c, d);
    return (c & (1u << 1)) != 0;
}

bool probe_isa(int isa) {
    __builtin_cpu_init();
    switch (isa) {
        case OFFLOAD_ISA_SCALAR:
            return true;
        case OFFLOAD_ISA_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
        case OFFLOAD_ISA_AVX512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("fma") && has_f16c();
        case OFFLOAD_ISA_AVX512VBMI:
            return probe_isa(OFFLOAD_ISA_AVX512) && has_vbmi();
        default:
            return false;
    }
}

// The CPU's features, probed once: CPUID traps to the hypervisor in a VM (~20 us per
// call measured here), too slow to repeat on every kernel call. This is a fact about the
// machine, not state carried between steps.
struct IsaTable {
    bool ok[OFFLOAD_ISA_AVX512VBMI + 1];
    bool intel;  // GenuineIntel: the loops prefetch by default ([Note: software prefetch])
    IsaTable() {
        for (int i = 0; i <= OFFLOAD_ISA_AVX512VBMI; ++i) ok[i] = probe_isa(i);
        unsigned a = 0, b = 0, c = 0, d = 0;
        intel = __get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547u && d == 0x49656e69u &&
                c == 0x6c65746eu;  // "Genu" "ineI" "ntel"
    }
};

const IsaTable &machine_table() {
    static const IsaTable table;  // thread-safe one-time init (C++11 magic statics)
    return table;
}

}  // namespace

namespace offload {

bool isa_supported(int isa) {
    return isa >= OFFLOAD_ISA_SCALAR && isa <= OFFLOAD_ISA_AVX512VBMI && machine_table().ok[isa];
}

int isa_best() {
    if (isa_supported(OFFLOAD_ISA_AVX512VBMI)) return OFFLOAD_ISA_AVX512VBMI;
    if (isa_supported(OFFLOAD_ISA_AVX512)) return OFFLOAD_ISA_AVX512;
    if (isa_supported(OFFLOAD_ISA_AVX2)) return OFFLOAD_ISA_AVX2;
    return OFFLOAD_ISA_SCALAR;
}

// -ENOTSUP for an ISA the CPU lacks, -EINVAL for an unknown code; else the ISA to run.
int resolve_isa(int isa) {
    if (isa == OFFLOAD_ISA_BEST) return isa_best();
    if (isa < OFFLOAD_ISA_SCALAR || isa > OFFLOAD_ISA_AVX512VBMI) return -EINVAL;
    return isa_supported(isa) ? isa : -ENOTSUP;
}

bool prefers_prefetch() { return machine_table().intel; }

}  // namespace offload
