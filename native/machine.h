// What this machine can run (machine.cpp), for the entry points of dispatch.cpp.
//
// Probed once per process: CPUID traps to the hypervisor in a VM (~20 us per call measured
// here), too slow to repeat on every kernel call. Facts about the machine, not state carried
// between steps.
#ifndef OFFLOAD_MACHINE_H
#define OFFLOAD_MACHINE_H

namespace offload {

// Whether the CPU (and OS) can run OFFLOAD_ISA_* level `isa`.
bool isa_supported(int isa);
// The best level it can run.
int isa_best();
// -ENOTSUP for a level the CPU lacks, -EINVAL for an unknown code; else the level to run
// (OFFLOAD_ISA_BEST: isa_best()).
int resolve_isa(int isa);
// Whether the kernels' loops prefetch by default here: on Intel CPUs ([Note: software
// prefetch] in kernel.h).
bool prefers_prefetch();

}  // namespace offload

#endif
