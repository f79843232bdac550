// Hopper warpgroup MMA (wgmma) helpers: shared-memory matrix descriptors for 128-byte-swizzled
// K-major tiles, the m64n256k16 / m64n128k16 / m64n32k16 / m64n16k16 bf16 → fp32 instructions, and
// their fences. Used by the kernels that multiply from shared memory at the tensor cores' full rate
// (moe_grouped_gemm_wgmma.cu; mma.sync tops out near 270 TFLOP/s there, moe_grouped_gemm.cu's
// measurements) and by the MLA decode (attention_decode_wgmma.cu).
//
// Tile layout (K-major, 128-byte swizzle): a tile is R rows of 64 bf16 (128 bytes), stored row
// after row from a 1024-byte-aligned base; the 16-byte chunk c (k = 8c … 8c + 7) of row r sits at
// byte r·128 + ((c ^ (r mod 8))·16). Eight rows make one 1024-byte swizzle atom; the descriptor's
// stride byte offset steps from one 8-row atom to the next. A k16 slice kk (0 … 3) of the tile is
// the same descriptor with its start address advanced by 32·kk bytes (the hardware applies the
// XOR to the address bits, so the advanced start reads the right chunks of every row).
//
// MN-major tiles (128-byte swizzle; the operand's rows run along k, its MN elements are
// contiguous, as in a [k][n] weight or the [rows][m] activations of a weight gradient): 64 MN
// elements (128 bytes) per line, one line per k. A 128-wide operand is two such atoms,
// [atom][k line][128 bytes], each 64 lines deep for a 64-deep k step; the 16-byte chunk c
// (mn = 64·atom + 8c … +7) of line k sits at (64·atom + k)·128 + ((c ^ (k mod 8))·16), the same
// swizzle as above with lines counted the same way. The descriptor's stride byte offset steps
// from one 8-deep k group to the next (1024 bytes), its leading byte offset from one atom to the
// next (8192 bytes for 64-deep atoms); a k16 slice kk is the start advanced by 16 lines
// (2048·kk bytes, still 1024-byte aligned). wgmma reads such an operand with its transpose bit
// set (the instruction's imm-trans-a / imm-trans-b).
//
// Accumulators of m64nNk16 (fp32), thread t of the warpgroup (warp w = t / 32, lane l): d[j],
// j < N/2, is row 16w + l/4 + 8·((j / 2) mod 2), column 8·(j / 4) + 2·(l mod 4) + (j mod 2): the
// mma.sync m16n8 C fragment of each 8-column block, stacked.
//
// Ordering: shared memory written by ordinary stores or cp.async must be made visible to the
// async proxy wgmma reads through (fence_proxy_async, then a barrier) before the wgmma is issued;
// wgmma_fence orders the warpgroup's register accesses before the first wgmma of a batch;
// wgmma_commit closes a batch and wgmma_wait<n> waits until at most n batches are in flight (a
// stage's shared memory may be overwritten, and the accumulators read, only after that).
#pragma once
#include <cstdint>

namespace dm::cuda::wgmma {

// Descriptor of a K-major, 128-byte-swizzled tile at shared address `smem` (1024-byte aligned,
// or advanced from such a base by a k16 slice's 32·kk bytes).
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t desc = 0;
  desc |= uint64_t((addr >> 4) & 0x3FFFu);          // start address, bits 0–13
  desc |= uint64_t(1u) << 16;                        // leading byte offset (unused when swizzled)
  desc |= uint64_t((1024u >> 4) & 0x3FFFu) << 32;    // stride byte offset: one 8-row atom
  desc |= uint64_t(1u) << 62;                        // layout: 128-byte swizzle
  return desc;
}

// Descriptor of an MN-major, 128-byte-swizzled tile at `smem` (1024-byte aligned); atom_bytes:
// the distance from one 64-wide MN atom to the next.
__device__ __forceinline__ uint64_t smem_desc_sw128_mn(const void* smem, uint32_t atom_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t desc = 0;
  desc |= uint64_t((addr >> 4) & 0x3FFFu);              // start address, bits 0–13
  desc |= uint64_t((atom_bytes >> 4) & 0x3FFFu) << 16;  // leading byte offset: next MN atom
  desc |= uint64_t((1024u >> 4) & 0x3FFFu) << 32;       // stride byte offset: next 8-deep k group
  desc |= uint64_t(1u) << 62;                           // layout: 128-byte swizzle
  return desc;
}

// A descriptor moved `bytes` further on in shared memory (a multiple of 16): the start address
// sits in the low 14 bits as address / 16, and shared addresses stay below 256 KB, so the sum
// never carries into the other fields. Lets a kernel build one descriptor per tile and step
// through its k slices and atoms with one add each.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// d (+)= A·Bᵀ for a 64 × 128 tile over 16 k: A [64 rows][16 k] and B [128 rows][16 k] in shared
// memory (descriptors above), K-major, or MN-major where kTransA / kTransB is 1. accumulate =
// false: d = A·Bᵀ.
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void mma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a,
                                                    uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
}

// d (+)= A·Bᵀ for a 64 × 256 tile over 16 k (128 fp32 accumulators a thread; the operand
// conventions of mma_m64n128k16_bf16 with B 256 rows, i.e. 32 eight-row atoms 1024 bytes apart).
// The wide expert products (moe_grouped_gemm_wgmma.cu): per byte of B loaded, twice the MMA work
// of the 128-wide tile.
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void mma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a,
                                                    uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "
      "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "
      "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
      "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "
      "%123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
}

// d (+)= A·Bᵀ for a 64 × 32 tile over 16 k (16 fp32 accumulators a thread; same operand
// conventions as mma_m64n128k16_bf16, B with 32 rows). Used where the N side is a handful of
// attention heads (attention_decode_wgmma.cu).
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void mma_m64n32k16_bf16(float (&d)[16], uint64_t desc_a, uint64_t desc_b,
                                                   bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, "
      "1, %19, %20;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
}

// The same for a 64 × 16 tile (8 accumulators a thread).
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void mma_m64n16k16_bf16(float (&d)[8], uint64_t desc_a, uint64_t desc_b,
                                                   bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, %12;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
}

}  // namespace dm::cuda::wgmma
