/* Decode attention on the CPU (issue 13): one new token per sequence, grouped-query heads, K and V
 * read where the paged cache keeps them (no gathered, padded copy, no mask).
 *
 * Built at first use by actors/kernels/cpu_attention.py (cc -O3 -march=native -ffast-math
 * -fopenmp) and called through ctypes. Linked against libgomp, which the loader resolves to the
 * copy torch has already loaded, so the kernel's threads are torch's own pool.
 *
 * A task is one sequence (all KV heads: each cache block is read as one contiguous span) or, when
 * there are too few sequences to keep the threads busy, one (sequence, KV head). Per task: the
 * scores of its query heads over the context, an exact softmax (max, exp, sum), the weighted sum
 * of V. Each sequence's result depends on its own inputs only, so it is the same whatever else
 * is in the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>

/* r[i] = the sum of v[i]'s 16 lanes: pairs added within 128-bit lanes, then across them. */
static inline __m512 sum16(__m512 v[16])
{
    __m512 x[8], z[4], w[2];
    for (int i = 0; i < 8; ++i)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; ++j)
        z[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 2; ++k)
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The scores of one query row over 16 consecutive keys (D a multiple of 16): each key's
   products in one vector, the 16 vectors summed lane-wise at once (not one reduction a key). */
static inline __m512 scores16(const float *q, const float *k, int64_t ktok, const int64_t D)
{
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k + i * ktok));
        for (int64_t c = 16; c < D; c += 16)
            acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + i * ktok + c), acc[i]);
    }
    return sum16(acc);
}
#endif

static inline __attribute__((always_inline)) void attend(
    const float *restrict q, const float *restrict kc, const float *restrict vc,
    const int64_t *restrict blocks, int64_t L, float *restrict out, float *restrict s,
    float *restrict o, int64_t h0, int64_t hn, int64_t G, const int64_t D, const int64_t Dv,
    int64_t BS, float scale, int64_t kblk, int64_t ktok, int64_t vblk, int64_t vtok)
{
    const int64_t R = hn * G; /* query rows of this task: heads h0 .. h0 + hn, G each */
    const float *qt = q + h0 * G * D;
    for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        const float *kb = kc + blocks[t0 / BS] * kblk + h0 * D;
        int64_t i = 0;
#ifdef __AVX512F__
        if (D % 16 == 0)
            for (; i + 16 <= n; i += 16)
                for (int64_t h = 0; h < hn; ++h)
                    for (int64_t g = 0; g < G; ++g) {
                        __m512 sc = scores16(qt + (h * G + g) * D, kb + i * ktok + h * D, ktok, D);
                        _mm512_storeu_ps(s + (h * G + g) * L + t0 + i, _mm512_mul_ps(sc, _mm512_set1_ps(scale)));
                    }
#endif
        for (; i < n; ++i) {
            for (int64_t h = 0; h < hn; ++h) {
                const float *kt = kb + i * ktok + h * D;
                for (int64_t g = 0; g < G; ++g) {
                    const float *qq = qt + (h * G + g) * D;
                    float acc = 0.f;
                    for (int64_t d = 0; d < D; ++d) acc += qq[d] * kt[d];
                    s[(h * G + g) * L + t0 + i] = acc * scale;
                }
            }
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        float *sr = s + r * L, m = sr[0], sum = 0.f;
        for (int64_t t = 1; t < L; ++t) m = sr[t] > m ? sr[t] : m;
        for (int64_t t = 0; t < L; ++t) {
            sr[t] = expf(sr[t] - m);
            sum += sr[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sr[t] *= inv;
    }
    for (int64_t j = 0; j < R * Dv; ++j) o[j] = 0.f;
    for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        const float *vb = vc + blocks[t0 / BS] * vblk + h0 * Dv;
        for (int64_t i = 0; i < n; ++i) {
            for (int64_t h = 0; h < hn; ++h) {
                const float *vt = vb + i * vtok + h * Dv;
                for (int64_t g = 0; g < G; ++g) {
                    const float p = s[(h * G + g) * L + t0 + i];
                    float *og = o + (h * G + g) * Dv;
                    for (int64_t d = 0; d < Dv; ++d) og[d] += p * vt[d];
                }
            }
        }
    }
    float *dst = out + h0 * G * Dv;
    for (int64_t j = 0; j < R * Dv; ++j) dst[j] = o[j];
}

/* q [B, H, D] and out [B, H, Dv] contiguous; kc [blocks, BS, KV, D] and vc [blocks, BS, KV, Dv]
 * with the given block and token strides (heads and dims contiguous); table [B, T] block ids;
 * lens [B] context lengths (>= 1, <= T * BS). Returns 0, or -1 when scratch memory ran out. */
int moe_decode_attention(
    const float *q, const float *kc, const float *vc, const int64_t *table, const int64_t *lens,
    float *out, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t Dv, int64_t BS, int64_t T,
    float scale, int64_t kblk, int64_t ktok, int64_t vblk, int64_t vtok, int nthreads)
{
    const int64_t G = H / KV, per_task = B >= 2 * nthreads ? KV : 1, tasks = B * KV / per_task;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : failed)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t b = task * per_task / KV, h0 = task * per_task % KV, L = lens[b];
        float *s = malloc(sizeof(float) * (per_task * G * (L + Dv)));
        if (s == NULL) {
            failed = 1;
            continue;
        }
        float *o = s + per_task * G * L;
        const float *qb = q + b * H * D;
        float *ob = out + b * H * Dv;
        const int64_t *blocks = table + b * T;
        /* the usual head sizes as constants, so each dot product and row update is unrolled */
        if (D == 32 && Dv == 32)
            attend(qb, kc, vc, blocks, L, ob, s, o, h0, per_task, G, 32, 32, BS, scale, kblk,
                   ktok, vblk, vtok);
        else if (D == 64 && Dv == 64)
            attend(qb, kc, vc, blocks, L, ob, s, o, h0, per_task, G, 64, 64, BS, scale, kblk,
                   ktok, vblk, vtok);
        else if (D == 128 && Dv == 128)
            attend(qb, kc, vc, blocks, L, ob, s, o, h0, per_task, G, 128, 128, BS, scale, kblk,
                   ktok, vblk, vtok);
        else
            attend(qb, kc, vc, blocks, L, ob, s, o, h0, per_task, G, D, Dv, BS, scale, kblk, ktok,
                   vblk, vtok);
        free(s);
    }
    return failed ? -1 : 0;
}
