// Issue 8, rounds 19-20: the resident ring of round 18 with tensor-core consumers; round 20 adds
// two of the real step's own dependencies (the top-k after the router wait, the attention's merge).
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o mma_ring_probe bench/mma_ring_probe.cu
//   ./mma_ring_probe [out.json]          (MMA_ONLY=<row name> runs one row, for a profiler)
//
// Round 18 (`persistent_probe.cu`, ring_kernel) streamed one Qwen3-30B-A3B batch-1 decode step
// (48 layers of q/k/v, a K/V read standing in for attention, o_proj, router, the 8 hit experts'
// gate/up and down; the lm_head once) through a ring of shared-memory slots filled by one
// producer warp a CTA (cp.async.bulk + mbarriers), with grid-wide syncs between the phases. The
// ring alone streamed at 108% of the copy roofline, but the consumers (a warp a row, bf16 FMAs,
// a five-shuffle reduction a row) ran barely faster than the stream, so a sync's stall was
// never repaid: 66% with six syncs a layer. Here the consumers use mma.sync m16n8k16 (bf16 in,
// fp32 accumulate): the weights are stored pre-tiled, each 16 x 16 block as one 512-byte
// fragment in the order the instruction's A operand wants it (one 16-byte shared load a lane,
// no conflicts, no ldmatrix), the input vector is B (every column the same vector), and the
// reduction over k happens inside the MMA. A CTA's share of a phase is a contiguous range of
// fragments (split-K where it cuts a 16-row block: partial sums meet in shared memory, then in
// the output through red.global.add), so every CTA streams the same bytes in every phase.
//
// Rows: the ring's stream with no arithmetic; the consumers alone (the producer copies
// nothing), without the hand-offs, and their slot arithmetic alone; the two together with no
// sync; with the growing counter's wait before all six phases a layer, and before one (q/k/v);
// with the producer also waiting for the router before the experts, before six, four (a layer
// whose q/k/v and attention share a phase and whose router is folded into o_proj's) and one;
// the same with 32 KB slots and with 16 consumer warps; and two bounds on a dependency's cost
// (no input reload after a wait; a release reduction as the arrival); round 20: the producer's
// top-k after the router wait, the attention's merge as a seventh phase, both together, and the
// merge with the experts known before the router (a perfect predictor). Before timing, one synced
// step of each kernel shape is checked against a host reference computed from the same tiled
// weights (each phase from the GPU's own input to it). Prints a table and writes JSON.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_common.cuh"

constexpr int H = 2048, QKV = 5120, ATT = 4096, E = 8, I = 768, ROUTER = 128, VOCAB = 151936;
constexpr int KV_ROWS = 1024 * 4 * 128 * 2 * 2 / (H * 2);  // 1K tokens of K and V as 2,048-wide rows
constexpr int NL = 48;
constexpr int SLOT = 16384, NSLOT = 12, FRAG = 512;  // the ring: 192 KB, 12 slots of 16 KB by default
constexpr int XMAX = E * I > ATT ? E * I : ATT;                           // widest input (bf16)
constexpr int ACC_MAX = 1280;                                             // rows a CTA touches in a phase
// one layer's outputs (floats): q/k/v, attention (4,096 read by o_proj, 512 written), h, logits,
// gate/up, down
constexpr int O_QKV = 0, O_ATT = O_QKV + QKV, O_H = O_ATT + ATT, O_LOG = O_H + H, O_GU = O_LOG + ROUTER,
              O_DN = O_GU + E * 2 * I, LB = O_DN + E * H, PARITY = NL * LB + VOCAB;
constexpr int MAXNS = 2 * NSLOT;  // mbarriers for slots down to 8 KB
constexpr int SMEM = NSLOT * SLOT + XMAX * 2 + ACC_MAX * 4 + 2 * MAXNS * 8;

struct Layer {
  const uint8_t *w[6];  // q/k/v, K/V, o_proj, router, gate/up, down (tiled)
};

struct Phase {
  const uint8_t *W;
  int rows, K, xrows;  // xrows: rows that share one input vector (the down phase: H, an expert's)
  const float *x;
  float *out;
};

__host__ __device__ inline void phase_dims(int p, int &rows, int &K, int &xrows) {
  switch (p) {  // a switch, not a table: no stack frame in the kernel
    case 0: rows = QKV, K = H; break;
    case 1: rows = KV_ROWS, K = H; break;
    case 2: rows = H, K = ATT; break;
    case 3: rows = ROUTER, K = H; break;
    case 4: rows = E * 2 * I, K = H; break;
    case 5: rows = E * H, K = I; break;
    default: rows = VOCAB, K = H;
  }
  xrows = p == 5 ? H : rows;
}
// where phase p (0-5) of a layer reads its input and writes its output, in the layer's block
__host__ __device__ inline int in_off(int p) { return p == 1 ? O_QKV : p == 2 ? O_ATT : p == 5 ? O_GU : O_H; }
__host__ __device__ inline int out_off(int p) {
  return p == 0 ? O_QKV : p == 1 ? O_ATT : p == 2 ? O_H : p == 3 ? O_LOG : p == 4 ? O_GU : O_DN;
}

__device__ Phase phase_of(const Layer *layers, const uint8_t *lm, float *outs, const float *x0, int l, int p,
                          int parity) {
  float *base = outs + (size_t)parity * PARITY, *o = base + (size_t)l * LB;
  Phase P;
  phase_dims(p, P.rows, P.K, P.xrows);
  if (p == 6) {
    P.W = lm;
    P.x = base + (size_t)(NL - 1) * LB + O_DN;
    P.out = base + (size_t)NL * LB;
  } else {
    P.W = layers[l].w[p];
    P.x = p ? o + in_off(p) : (l ? o - LB + O_DN : x0);
    P.out = o + out_off(p);
  }
  return P;
}

__device__ __forceinline__ void mma(float (&c)[4], const uint4 &a, const uint2 &b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y));
}

// A 16-row block's partial sums (two accumulator chains: consecutive MMAs do not wait on each
// other) into the CTA's shared accumulator; every column of C holds the same dot, lanes 4g hold
// rows g and g + 8.
__device__ __forceinline__ void flush(float *acc, int local_row, const float (&c)[2][4], int lane) {
  if ((lane & 3) == 0) {
    atomicAdd(acc + local_row + lane / 4, c[0][0] + c[1][0]);
    atomicAdd(acc + local_row + lane / 4 + 8, c[0][2] + c[1][2]);
  }
}

// VAR 0: the consumers' MMAs on the streamed fragments; 1: the producer copies nothing (the
// consumers' own rate on stale slots); 2: the consumers hand each slot straight back (the
// stream's own rate); 3: 1 and 2 together (the slot hand-offs alone); 4: no producer and no
// hand-offs, the consumers compute on stale slots (their arithmetic and per-phase work); 5: 4
// without the input's load and the output's atomics (the slots' arithmetic alone). SL: a slot's
// bytes (the ring stays NSLOT x SLOT). SYNC: each CTA arrives on the growing counter after every
// phase, and the consumers wait for the last phase everywhere before the phases `mask` names
// (bit p: phase p, bit 6 the lm_head). CW: consumer warps (the producer is one more). OPT bit 0:
// the consumers do not reload the input after a wait (stale input: the bound of an input that
// arrives with its flag); bit 1: the arrival is one `red.release.gpu` (no `__threadfence`); bit 2
// (round 20): after the router wait the producer warp reads the 128 router logits, picks the top
// 8 and addresses the experts' weights through the ranks it found (they sort to the stored order,
// so the bytes are the same; the dependency is the real one); bit 3 (round 20): a layer has a
// seventh phase after the attention's, with no weights: the merge of split attention, one more
// all-to-all dependency (it loads the attention's output as its input; its wait and o_proj's
// follow mask bit 2). ROUTE: the producer waits for the router phase everywhere before it issues
// a layer's expert weights.
template <bool SYNC, bool ROUTE, int VAR, int SL = SLOT, int CW = 8, int OPT = 0>
__global__ void __launch_bounds__((CW + 1) * 32, 1)
    mma_ring(const Layer *layers, const uint8_t *lm, float *outs, const float *x0, unsigned *count, int steps,
             int mask) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t *ring = smem;
  uint32_t *xs = (uint32_t *)(smem + NSLOT * SLOT);  // bf16 pairs, in the B operand's order
  float *acc = (float *)(xs + XMAX / 2);
  uint64_t *full = (uint64_t *)(acc + ACC_MAX), *empty = full + MAXNS;
  constexpr int NS = NSLOT * SLOT / SL, FPS = SL / FRAG, FPW = FPS / CW;  // FPW fragments a warp a slot
  static_assert(FPW < I / 16, "a warp's fragments of a slot cross at most one 16-row block boundary");
  const bool copy = VAR == 0 || VAR == 2, wait = VAR <= 3, mmas = VAR != 2 && VAR != 3;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, G = gridDim.x, c = blockIdx.x;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NS; i++) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, CW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = threadIdx.x; i < ACC_MAX; i += (CW + 1) * 32) acc[i] = 0.f;
  for (int i = threadIdx.x; i < NSLOT * SLOT / 16; i += (CW + 1) * 32) ((uint4 *)ring)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  constexpr bool TOPK = OPT & 4, MERGE = OPT & 8;
  constexpr int PL = MERGE ? 7 : 6;  // phases a layer
  const int per_step = PL * NL + 1;
  int slot = 0, par = 0;  // the next slot of the ring and its pass parity (the same on both sides)
  unsigned remap = 0x76543210u;  // TOPK: the stored slot of each chosen expert, 4 bits each
  for (int s = 0; s < steps; s++) {
    for (int ph = 0; ph < per_step; ph++) {
      const int l = ph < PL * NL ? ph / PL : NL - 1, pp = ph < PL * NL ? ph % PL : PL;
      const bool merge = MERGE && pp == 2;  // the null phase: phase 2's input, no rows
      const int p = pp == PL ? 6 : MERGE && pp > 2 ? pp - 1 : pp;
      Phase P = phase_of(layers, lm, outs, x0, l, p, s & 1);
      if (merge) P.rows = 0;
      const int KS = P.K / 16, F = P.rows / 16 * KS;
      const int f0 = (int)((unsigned)F * c / G), f1 = (int)((unsigned)F * (c + 1) / G), nf = f1 - f0;  // F x G < 2^32
      const int nchunks = (nf + FPS - 1) / FPS;
      const unsigned done_before = (unsigned)(s * per_step + ph) * G;  // arrivals before phase ph may start
      if (warp == CW) {  // the producer
        if (SYNC && ROUTE && p == 4 && lane == 0) wait_at_least(count, done_before);  // the router is done
        if (TOPK && p == 4) {  // the whole warp: top 8 of the 128 logits, then their ranks
          __syncwarp();
          const float *lg = outs + (size_t)(s & 1) * PARITY + (size_t)l * LB + O_LOG;
          float v[ROUTER / 32];
#pragma unroll
          for (int j = 0; j < ROUTER / 32; j++) v[j] = __ldcg(lg + lane + 32 * j);
          int picked[E];
#pragma unroll
          for (int r = 0; r < E; r++) {
            float bv = -INFINITY;
            int bi = ROUTER;
#pragma unroll
            for (int j = 0; j < ROUTER / 32; j++)
              if (v[j] > bv) bv = v[j], bi = lane + 32 * j;
#pragma unroll
            for (int off = 16; off; off >>= 1) {
              const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
              const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
              if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
            }
            picked[r] = bi;
#pragma unroll
            for (int j = 0; j < ROUTER / 32; j++)
              if (bi == lane + 32 * j) v[j] = -INFINITY;
          }
          remap = 0;
#pragma unroll
          for (int r = 0; r < E; r++) {  // the expert of rank k is stored in slot k
            int rank = 0;
#pragma unroll
            for (int q = 0; q < E; q++) rank += picked[q] < picked[r];
            remap |= (unsigned)rank << (4 * rank);
          }
        }
        if (lane == 0) {
          // fragments an expert (gate/up: 1,536 rows x 2,048; down: 2,048 rows x 768)
          const int fpe = p == 4 ? 2 * I / 16 * (H / 16) : H / 16 * (I / 16);
          for (int k = 0; wait && k < nchunks; k++) {
            const int n = min(FPS, nf - k * FPS), fi = f0 + k * FPS;
            size_t at = (size_t)fi;
            if (TOPK && (p == 4 || p == 5)) {  // a chunk that crosses into the next expert reads on:
              // right, as the ranks sort to the stored order
              const int e = fi / fpe;
              at = (size_t)((remap >> (4 * e)) & 15u) * fpe + (fi - e * fpe);
            }
            mbar_wait(empty + slot, par ^ 1);
            if (!copy)
              mbar_arrive(full + slot);
            else
              bulk_load(ring + slot * SL, P.W + at * FRAG, n * FRAG, full + slot);
            if (++slot == NS) slot = 0, par ^= 1;
          }
        }
        continue;
      }
      if (SYNC && ((mask >> p) & 1)) {
        if (threadIdx.x == 0) wait_at_least(count, done_before);
        asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");
      }
      if (ph == 0) {  // the last step is done everywhere: zero this CTA's share of its outputs
        float4 *z = (float4 *)(outs + (size_t)((s + 1) & 1) * PARITY);  // (the next step's)
        const int n4 = PARITY / 4, a = (int)((long)n4 * c / G), e = (int)((long)n4 * (c + 1) / G);
        for (int i = a + threadIdx.x; i < e; i += CW * 32) z[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
      // the input: fp32 from L2, as bf16 pairs where a lane's B fragment reads them: k-step ks,
      // lane quad t holds {x[16ks + 2t], x[16ks + 2t + 1]} and {x[16ks + 8 + 2t], x[16ks + 9 + 2t]}
      const int nx = P.xrows >= P.rows ? P.K : (P.rows / P.xrows) * I;
      if (mmas && VAR != 5 && !(OPT & 1)) {  // all of a thread's loads before its stores
        constexpr int QN = (XMAX / 2 + CW * 32 - 1) / (CW * 32);
        float2 v[QN];
#pragma unroll
        for (int j = 0; j < QN; j++) {
          const int q = threadIdx.x + j * CW * 32;
          if (q < nx / 2) v[j] = __ldcg((const float2 *)P.x + q);
        }
#pragma unroll
        for (int j = 0; j < QN; j++) {
          const int q = threadIdx.x + j * CW * 32, ks = q / 8, t = q & 3, half = (q >> 2) & 1;
          __nv_bfloat162 b2 = __floats2bfloat162_rn(v[j].x, v[j].y);
          if (q < nx / 2) xs[(ks * 4 + t) * 2 + half] = *(uint32_t *)&b2;
        }
      }
      asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");
      const int rb0 = f0 / KS, rbl = nf ? (f1 - 1) / KS : rb0;  // the first and last 16-row blocks
      // this warp's first fragment of the current slot, as (16-row block, k-step): kept by
      // increments (a division by the runtime K costs ~20 dependent instructions; one a phase)
      int rbw = (f0 + warp * FPW) / KS, ksw = f0 + warp * FPW - rbw * KS;
      const int xsh = P.xrows >= P.rows ? 30 : 7;  // the down phase: 128 blocks (2,048 rows) an expert
      // two sets of two accumulator chains: A for block rbw, B for rbw + 1 (a slot of FPS < KS
      // fragments crosses at most one block boundary). Every fragment goes through both with B's
      // operand zeroed in the set it is not in: no branch and no register moves between MMAs.
      float cA[2][4] = {}, cB[2][4] = {};
      const uint2 *xsw = (const uint2 *)xs + (lane & 3);  // this lane's B pairs
      int xbase = (rbw >> xsh) * (I / 16) * 4;             // the input of block rbw
      for (int k = 0; k < nchunks; k++) {
        const int fb = f0 + k * FPS + warp * FPW;
        if (wait) mbar_wait(full + slot, par);
        if (mmas && ksw + FPW <= KS && fb + FPW <= f1) {  // the common case: all in block rbw, all valid
          const uint4 *as = (const uint4 *)(ring + slot * SL + warp * FPW * FRAG) + lane;
          uint4 a[FPW];
          uint2 b[FPW];
#pragma unroll
          for (int i = 0; i < FPW; i++) {
            a[i] = as[i * 32];
            b[i] = xsw[xbase + (ksw + i) * 4];
          }
          __syncwarp();
          if (wait && lane == 0) mbar_arrive(empty + slot);
#pragma unroll
          for (int i = 0; i < FPW; i++) mma(cA[i & 1], a[i], b[i]);
        } else if (mmas) {
          uint4 a[FPW];
          uint2 bA[FPW], bB[FPW];
#pragma unroll
          for (int i = 0; i < FPW; i++) {
            int rb = rbw, ks = ksw + i;
            const bool next = ks >= KS;
            if (next) ks -= KS, rb++;
            a[i] = ((const uint4 *)(ring + slot * SL + (warp * FPW + i) * FRAG))[lane];
            const uint2 b = ((const uint2 *)xs)[((rb >> xsh) * (I / 16) + ks) * 4 + (lane & 3)];
            const bool valid = fb + i < f1;  // past it: stale bytes, multiplied by zero
            bA[i] = valid && !next ? b : make_uint2(0, 0);
            bB[i] = valid && next ? b : make_uint2(0, 0);
          }
          __syncwarp();
          if (wait && lane == 0) mbar_arrive(empty + slot);  // the slot's bytes are in registers
#pragma unroll
          for (int i = 0; i < FPW; i++) {
            mma(cA[i & 1], a[i], bA[i]);
            mma(cB[i & 1], a[i], bB[i]);
          }
        } else {
          __syncwarp();
          if (lane == 0) mbar_arrive(empty + slot);
        }
        if (++slot == NS) slot = 0, par ^= 1;
        int nrb = rbw;
        for (ksw += FPS; ksw >= KS; ksw -= KS) nrb++;  // the next slot's first fragment
        if (nrb != rbw) {
          for (; rbw < nrb; rbw++) {  // block rbw is done for this warp: A out, B becomes A
            if (mmas) flush(acc, (rbw - rb0) * 16, cA, lane);
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
              for (int i = 0; i < 4; i++) cA[j][i] = cB[j][i], cB[j][i] = 0.f;
          }
          xbase = (rbw >> xsh) * (I / 16) * 4;
        }
      }
      if (mmas && rbw <= rbl) flush(acc, (rbw - rb0) * 16, cA, lane);
      if (mmas && rbw + 1 <= rbl) flush(acc, (rbw + 1 - rb0) * 16, cB, lane);
      asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");
      // the CTA's partial rows into the output (blocks shared with a neighbour meet there)
      const int nrows = nf ? (rbl - rb0 + 1) * 16 : 0;
      for (int i = threadIdx.x; i < nrows; i += CW * 32) {
        if (mmas && VAR != 5) atomicAdd(P.out + rb0 * 16 + i, acc[i]);
        acc[i] = 0.f;
      }
      if (SYNC) {
        asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");
        if (threadIdx.x == 0) {
          if (OPT & 2) {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
          } else {
            __threadfence();
            atomicAdd(count, 1u);
          }
        }
      } else {
        asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");  // acc is zero before the next phase
      }
    }
  }
}

// bf16 weights of magnitude 2^-6..2^-5 with random signs: a 2,048-wide dot of unit inputs is ~1
__global__ void fill(uint32_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const uint32_t a = ((h & 1u) << 15) | 0x3c80u | ((h >> 1) & 0x7fu);
    const uint32_t b = (((h >> 8) & 1u) << 15) | 0x3c80u | ((h >> 9) & 0x7fu);
    p[i] = (b << 16) | a;
  }
}

// ---- host reference ----
static float bf16_to_f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint16_t f_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
// y = W x over the tiled layout: fragment (rb, ks), lane = 4 g + t, register r = rh + 2 kh, half h:
// row 16 rb + g + 8 rh, column 16 ks + 8 kh + 2 t + h
static std::vector<double> host_gemv(const std::vector<uint16_t> &w, int p, const std::vector<float> &x) {
  int rows, K, xrows;
  phase_dims(p, rows, K, xrows);
  std::vector<double> y(rows, 0.0);
  const int KS = K / 16;
  for (int rb = 0; rb < rows / 16; rb++) {
    const int xo = xrows >= rows ? 0 : (rb * 16 / xrows) * I;
    for (int ks = 0; ks < KS; ks++) {
      const uint16_t *f = w.data() + ((size_t)rb * KS + ks) * (FRAG / 2);
      for (int lane = 0; lane < 32; lane++)
        for (int r = 0; r < 4; r++)
          for (int h = 0; h < 2; h++) {
            const int row = rb * 16 + lane / 4 + 8 * (r & 1), col = ks * 16 + 8 * (r >> 1) + 2 * (lane & 3) + h;
            const float xv = bf16_to_f(f_to_bf16(x[xo + col]));
            y[row] += (double)bf16_to_f(f[lane * 8 + r * 2 + h]) * xv;
          }
    }
  }
  return y;
}

int main(int argc, char **argv) {
  const char *out = argc > 1 ? argv[1] : "mma_ring_probe.json";
  const char *only = getenv("MMA_ONLY");
  const int steps = 20;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  size_t per_layer[6], layer_bytes = 0;
  for (int p = 0; p < 6; p++) {
    int rows, K, xr;
    phase_dims(p, rows, K, xr);
    per_layer[p] = (size_t)rows * K * 2;
    layer_bytes += per_layer[p];
  }
  const size_t lm_bytes = (size_t)VOCAB * H * 2, total = layer_bytes * NL + lm_bytes;
  uint8_t *w;
  CHECK(cudaMalloc(&w, total));
  fill<<<1024, 256>>>((uint32_t *)w, total / 4, 12345u);
  std::vector<Layer> hl(NL);
  uint8_t *q = w;
  for (int l = 0; l < NL; l++)
    for (int p = 0; p < 6; p++) {
      hl[l].w[p] = q;
      q += per_layer[p];
    }
  const uint8_t *lm = q;
  Layer *dl;
  CHECK(cudaMalloc(&dl, sizeof(Layer) * NL));
  CHECK(cudaMemcpy(dl, hl.data(), sizeof(Layer) * NL, cudaMemcpyHostToDevice));
  float *outs, *x0;
  CHECK(cudaMalloc(&outs, (size_t)2 * PARITY * 4));
  CHECK(cudaMalloc(&x0, H * 4));
  std::vector<float> hx0(H);
  for (int i = 0; i < H; i++) hx0[i] = (i * 7919 % 13) / 6.0f - 1.0f;
  CHECK(cudaMemcpy(x0, hx0.data(), H * 4, cudaMemcpyHostToDevice));
  unsigned *count;
  CHECK(cudaMalloc(&count, 4));

  const double copy_gbps = copy_rate_gbps(), roof_ms = total / copy_gbps / 1e6;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  float ms;

  const int grid = prop.multiProcessorCount;
  typedef void (*Kern)(const Layer *, const uint8_t *, float *, const float *, unsigned *, int, int);
  struct Mode {
    int mode;
    Kern fn;
    int cw;  // consumer warps
  };
  const Mode kerns[] = {
      {0, mma_ring<false, false, 0>, 8},          {1, mma_ring<false, false, 1>, 8},
      {2, mma_ring<false, false, 2>, 8},          {3, mma_ring<false, false, 3>, 8},
      {4, mma_ring<false, false, 4>, 8},          {5, mma_ring<false, false, 5>, 8},
      {10, mma_ring<true, false, 0>, 8},          {11, mma_ring<true, true, 0>, 8},
      {20, mma_ring<false, false, 1, 32768>, 8},  {21, mma_ring<false, false, 0, 32768>, 8},
      {22, mma_ring<true, false, 0, 32768>, 8},   {23, mma_ring<true, true, 0, 32768>, 8},
      {30, mma_ring<false, false, 1, SLOT, 16>, 16}, {31, mma_ring<false, false, 0, SLOT, 16>, 16},
      {32, mma_ring<true, false, 0, SLOT, 16>, 16},  {33, mma_ring<true, true, 0, SLOT, 16>, 16},
      {40, mma_ring<false, false, 1, 32768, 16>, 16}, {41, mma_ring<false, false, 0, 32768, 16>, 16},
      {42, mma_ring<true, false, 0, 32768, 16>, 16},  {43, mma_ring<true, true, 0, 32768, 16>, 16},
      {50, mma_ring<true, false, 0, SLOT, 8, 1>, 8},  {51, mma_ring<true, true, 0, SLOT, 8, 1>, 8},
      {52, mma_ring<true, false, 0, SLOT, 8, 2>, 8},  {53, mma_ring<true, true, 0, SLOT, 8, 2>, 8},
      {60, mma_ring<true, false, 0, 32768, 16, 1>, 16}, {61, mma_ring<true, true, 0, 32768, 16, 1>, 16},
      {62, mma_ring<true, false, 0, 32768, 16, 2>, 16}, {63, mma_ring<true, true, 0, 32768, 16, 2>, 16},
      {70, mma_ring<true, true, 0, SLOT, 8, 4>, 8},     {71, mma_ring<true, true, 0, SLOT, 8, 12>, 8},
      {72, mma_ring<true, true, 0, 32768, 16, 4>, 16},  {73, mma_ring<true, true, 0, 32768, 16, 12>, 16},
      {74, mma_ring<true, false, 0, SLOT, 8, 8>, 8},    {75, mma_ring<true, false, 0, 32768, 16, 8>, 16},
      {76, mma_ring<true, false, 0, 32768, 16, 9>, 16}, {77, mma_ring<true, true, 0, 32768, 16, 13>, 16}};
  for (const Mode &m : kerns) CHECK(cudaFuncSetAttribute(m.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  struct Row {
    const char *name;
    int mode, mask;
  };
  const Row rowsv[] = {{"mma_stream_only", 2, 0},          {"mma_consumers_only", 1, 0},
                       {"mma_handoffs_only", 3, 0},        {"mma_consumers_no_handoff", 4, 0},
                       {"mma_slot_arithmetic_only", 5, 0}, {"mma_no_sync", 0, 0},
                       {"mma_syncs_6", 10, 0x7f},          {"mma_syncs_1", 10, 0x41},
                       {"mma_syncs_6_route_wait", 11, 0x7f}, {"mma_syncs_4_route_wait", 11, 0x75},
                       {"mma_syncs_1_route_wait", 11, 0x41}, {"mma32k16w_syncs_4_route_wait", 43, 0x75},
                       {"mma32k16w_syncs_1_route_wait", 43, 0x41}};
  std::vector<Row> rowsx(rowsv, rowsv + sizeof(rowsv) / sizeof(rowsv[0]));
  const Row opts[] = {{"noreload_syncs_6", 50, 0x7f},         {"noreload_syncs_6_route_wait", 51, 0x7f},
                      {"noreload_syncs_4_route_wait", 51, 0x75}, {"release_syncs_6", 52, 0x7f},
                      {"release_syncs_6_route_wait", 53, 0x7f}, {"release_syncs_4_route_wait", 53, 0x75},
                      {"32k16w_noreload_syncs_6", 60, 0x7f},    {"32k16w_noreload_syncs_4_route_wait", 61, 0x75},
                      {"32k16w_release_syncs_6", 62, 0x7f},     {"32k16w_release_syncs_4_route_wait", 63, 0x75}};
  rowsx.insert(rowsx.end(), opts, opts + sizeof(opts) / sizeof(opts[0]));
  // round 20: the real step's own dependencies (the top-k after the router wait, the attention's merge)
  const Row real[] = {{"merge_syncs_7", 74, 0x7f},
                      {"topk_syncs_6_route_wait", 70, 0x7f},
                      {"topk_merge_syncs_7_route_wait", 71, 0x7f},
                      {"topk_merge_syncs_5_route_wait", 71, 0x75},
                      {"32k16w_topk_syncs_4_route_wait", 72, 0x75},
                      {"32k16w_topk_merge_syncs_5_route_wait", 73, 0x75},
                      // the experts known before the router (a perfect predictor), and the no-reload bounds
                      {"32k16w_merge_syncs_5", 75, 0x75},
                      {"32k16w_merge_syncs_7", 75, 0x7f},
                      {"32k16w_noreload_merge_syncs_5", 76, 0x75},
                      {"32k16w_noreload_topk_merge_syncs_5_route_wait", 77, 0x75}};
  rowsx.insert(rowsx.end(), real, real + sizeof(real) / sizeof(real[0]));
  const char *shapes[3] = {"mma32k", "mma16w", "mma32k16w"};
  for (int v = 0; v < 3; v++) {
    const int m = 20 + 10 * v;
    static char names[3][5][48];
    const char *what[5] = {"consumers_only", "no_sync", "syncs_6", "syncs_1", "syncs_6_route_wait"};
    const int modes[5] = {m, m + 1, m + 2, m + 2, m + 3}, masks[5] = {0, 0, 0x7f, 0x41, 0x7f};
    for (int j = 0; j < 5; j++) {
      snprintf(names[v][j], sizeof(names[v][j]), "%s_%s", shapes[v], what[j]);
      rowsx.push_back({names[v][j], modes[j], masks[j]});
    }
  }
  auto launch = [&](int mode, int mask, int n) {
    CHECK(cudaMemsetAsync(count, 0, 4));
    CHECK(cudaMemsetAsync(outs, 0, (size_t)PARITY * 4));  // parity 0; a step zeroes the other
    for (const Mode &m : kerns)
      if (m.mode == mode) m.fn<<<grid, (m.cw + 1) * 32, SMEM>>>(dl, lm, outs, x0, count, n, mask);
  };

  // correctness: one synced step, each checked phase against the host from the GPU's own input
  double worst = 0;
  for (int mode : {10, 22, 32, 42, 52, 62, 71, 73, 75}) {
    launch(mode, 0x7f, 1);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<float> ho(PARITY);
    CHECK(cudaMemcpy(ho.data(), outs, (size_t)PARITY * 4, cudaMemcpyDeviceToHost));
    struct Check {
      int l, p;
      double rel;
    };
    std::vector<Check> checks = {{0, 0, 0}, {0, 1, 0}, {0, 2, 0}, {0, 3, 0},
                                 {0, 4, 0}, {0, 5, 0}, {1, 0, 0}, {NL - 1, 6, 0}};
    for (auto &ck : checks) {
      int rows, K, xr;
      phase_dims(ck.p, rows, K, xr);
      const size_t bytes = (size_t)rows * K * 2;
      std::vector<uint16_t> hw(bytes / 2);
      CHECK(cudaMemcpy(hw.data(), ck.p == 6 ? lm : hl[ck.l].w[ck.p], bytes, cudaMemcpyDeviceToHost));
      std::vector<float> x;
      if (ck.p == 0 && ck.l == 0)
        x = hx0;
      else if (ck.p == 0)
        x.assign(ho.begin() + (size_t)(ck.l - 1) * LB + O_DN, ho.begin() + (size_t)(ck.l - 1) * LB + O_DN + E * H);
      else if (ck.p == 6)
        x.assign(ho.begin() + (size_t)(NL - 1) * LB + O_DN, ho.begin() + (size_t)(NL - 1) * LB + O_DN + E * H);
      else
        x.assign(ho.begin() + (size_t)ck.l * LB + in_off(ck.p), ho.begin() + (size_t)ck.l * LB + in_off(ck.p) + XMAX);
      const std::vector<double> ref = host_gemv(hw, ck.p, x);
      const float *got = ho.data() + (ck.p == 6 ? (size_t)NL * LB : (size_t)ck.l * LB + out_off(ck.p));
      double err = 0, mag = 0;
      for (int r = 0; r < rows; r++) {
        err = fmax(err, fabs(got[r] - ref[r]));
        mag = fmax(mag, fabs(ref[r]));
      }
      ck.rel = mag > 0 ? err / mag : (err > 0 ? 1.0 : 0.0);
      if (mag == 0) ck.rel = 1.0;  // an all-zero reference would check nothing
      worst = fmax(worst, ck.rel);
      printf("check (kernel %d) layer %d phase %d: max |err| / max |ref| = %.2e (max |ref| %.3g)\n", mode, ck.l,
           ck.p, ck.rel, mag);
    }
  }
  const bool ok = worst < 2e-3;
  printf("correctness: %s (worst %.2e, tolerance 2e-3)\n", ok ? "ok" : "FAILED", worst);

  const int NROWS = (int)rowsx.size();
  const Row *rows = rowsx.data();
  std::vector<double> step_ms(NROWS);
  for (int r = 0; r < NROWS; r++) {
    step_ms[r] = 0;
    if (only && strcmp(only, rows[r].name)) continue;
    launch(rows[r].mode, rows[r].mask, 2);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    float best = 1e30f;
    for (int rep = 0; rep < 3; rep++) {
      CHECK(cudaEventRecord(e0));
      launch(rows[r].mode, rows[r].mask, steps);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      best = ms < best ? ms : best;
    }
    step_ms[r] = best / steps;
  }
  printf("device %s, %d CTAs of 288 (8 consumer warps) or 544 threads, %d bytes of shared memory each\n", prop.name,
         grid, SMEM);
  printf("copy %.0f GB/s; bytes a step %.3f GB (48 layers x %.1f MB + lm_head %.0f MB); roofline %.3f ms\n", copy_gbps,
         total / 1e9, layer_bytes / 1e6, lm_bytes / 1e6, roof_ms);
  printf("| variant | ms a step | of roofline | GB/s |\n|---|---:|---:|---:|\n");
  for (int r = 0; r < NROWS; r++)
    if (step_ms[r] > 0)
      printf("| %s | %.3f | %.0f%% | %.0f |\n", rows[r].name, step_ms[r], 100 * roof_ms / step_ms[r],
             total / (step_ms[r] / 1e3) / 1e9);
  FILE *f = fopen(out, "w");
  if (f) {
    fprintf(f, "{\"device\": \"%s\", \"copy_GBps\": %.1f, \"bytes_per_step\": %zu, \"roofline_ms\": %.4f,", prop.name,
            copy_gbps, total, roof_ms);
    fprintf(f, " \"ctas\": %d, \"threads_8_consumer_warps\": %d, \"correct\": %s, \"worst_rel_err\": %.3e,", grid,
            288, ok ? "true" : "false", worst);
    fprintf(f, " \"rows\": [");
    for (int r = 0, k = 0; r < NROWS; r++)
      if (step_ms[r] > 0)
        fprintf(f, "%s{\"variant\": \"%s\", \"ms_per_step\": %.4f, \"roofline_fraction\": %.4f}", k++ ? ", " : "",
                rows[r].name, step_ms[r], roof_ms / step_ms[r]);
    fprintf(f, "]}\n");
    fclose(f);
  }
  return ok ? 0 : 2;
}
