// Issue 8: what the resident-grid probes share (`persistent_probe.cu`, `mma_ring_probe.cu`): the
// error check, the mbarrier and bulk-copy primitives of a shared-memory ring, the growing
// counter's wait, and the copy rate the roofline divides by.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

__device__ __forceinline__ unsigned sa(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t *m, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(m)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *m, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n W%=: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra W%=;\n}" ::"r"(sa(m)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *m) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(m)) : "memory");
}
// `bytes` from global memory into shared memory by the bulk-copy engine, completing on `m`
__device__ __forceinline__ void bulk_load(void *dst, const void *src, unsigned bytes, uint64_t *m) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(m)), "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(dst)),
      "l"(src), "r"(bytes), "r"(sa(m))
      : "memory");
}
// the growing counter: a CTA's n-th sync waits until it holds n x CTAs arrivals
__device__ __forceinline__ void wait_at_least(unsigned *count, unsigned target) {
  unsigned seen;
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
  } while (seen < target);
}

// The bandwidth the roofline uses: 2 GiB copied device to device, bytes read and written, in GB/s
static double copy_rate_gbps() {
  const size_t cb = (size_t)1 << 31;
  uint8_t *a, *b;
  CHECK(cudaMalloc(&a, cb));
  CHECK(cudaMalloc(&b, cb));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; i++) CHECK(cudaMemcpy(b, a, cb, cudaMemcpyDeviceToDevice));
  CHECK(cudaEventRecord(e0));
  for (int i = 0; i < 10; i++) CHECK(cudaMemcpy(b, a, cb, cudaMemcpyDeviceToDevice));
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  return 2.0 * cb * 10 / (ms / 1e3) / 1e9;
}
