// Programmatic dependent launch (PDL, sm_90): a kernel launched with it may start while the
// kernel before it on the stream is still running, and waits (griddepcontrol.wait, pdl_wait in
// pdl.cuh) for that kernel's completion and memory before it touches anything the kernel wrote.
// Why: a decode step is ~400 short kernels, and each one's launch, ramp-up and drain cost more
// than its bytes (Kimi-Linear-48B at 1 x 32K: 2.99 ms a step against a 1.56 ms HBM floor, ~3.7
// us over the floor per kernel). With PDL the next kernel's blocks are resident while the last
// wave of the previous one finishes, and a GEMV streams its weights (which no kernel of the step
// writes) before it waits for its input vector. The training step's own element, norm, conv,
// AttnRes, MoE dispatch and grouped-product kernels launch the same way (757 of the gpu_1b
// step's 1782 kernel boundaries were ours→ours, 1.56 µs apart on average).
//
// The rules every kernel launched through launch_pdl keeps (pdl.cuh): every thread waits
// (pdl_wait_then_launch_dependents) before it reads data another kernel writes or writes global
// memory, and lets its dependent launch only after that wait; no block returns before it. Kernels
// launched the old way are ordered as before; a PDL kernel after a cuBLAS kernel or a copy waits
// for all of it.
// What follows from it (the two-launches-back rule): a kernel that has started knows that the
// launch before it has passed its wait, so every launch two or more back in the stream has
// completed and its writes are visible. Such data (the slot table of the step, a KV or state
// cache an earlier step wrote, the routing two launches back) may be read before the wait; only
// the last launch's outputs need it.
#pragma once
#include <cstdint>

namespace dm::cuda {

// DM_PDL (env_flag, default 1) until set_pdl_enabled is called. Read at each launch: graphs keep
// the launches they captured, so compare the two modes with fresh decoders.
bool pdl_enabled();
void set_pdl_enabled(bool on);

// Whether a decode step of `rows` rows asks the weights the routing does not choose (the shared
// expert's rows) into L2 before the MoE kernels' PDL wait. DM_DECODE_L2_PREFETCH
// = auto (default: one row only), 1, 0. Measured on the H200 (48B, twenty-third session, with the
// fused KDA step then prefetching its gate rows the same way; it now loads them into registers):
// one row 2.518/2.532 vs 2.540/2.541 ms at 32K, four rows 5.773/5.801 vs 5.733/5.734 (the
// prefetches then compete with four rows' routed experts for the same bandwidth).
bool decode_l2_prefetch(int64_t rows);

}  // namespace dm::cuda
