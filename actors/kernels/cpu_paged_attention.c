/* Attention on the CPU over the paged KV cache: the new tokens of each sequence (one
 * for a decode step, a prompt chunk for a prefill, any mix in one call), grouped-query heads, K
 * and V read where the paged cache keeps them (no gathered, padded copy, no mask tensor).
 *
 * Built at first use by actors/kernels/cpu_attention.py (cc -O3 -march=native -ffast-math
 * -fopenmp) and called through ctypes. Linked against libgomp, which the loader resolves to the
 * copy torch has already loaded, so the kernel's threads are torch's own pool.
 *
 * A task is up to QCHUNK consecutive new tokens of one sequence with all its KV heads (each
 * cache block read as one contiguous span) or, when there are too few tasks to keep the threads
 * busy, with one KV head. Per task: the scores of its query rows over the keys each may see
 * (causal: new token j of a sequence of context length L and n new tokens sees keys
 * 0 .. L - n + j), an exact softmax (max, exp, sum), the weighted sum of V. Each token's result
 * depends on its own inputs only, so it is the same whatever else is in the batch.
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

/* dst[r][d0 .. d0 + 16 NV] = the sum over keys t < len of p[r][t] V[t][off .. off + 16 NV], for
   4 rows; V's keys read from the sequence's blocks (block ids `blocks`). */
static inline __attribute__((always_inline)) void pv4(
    const float *const p[4], const float *vc, const int64_t *blocks, int64_t len, int64_t BS,
    int64_t vblk, int64_t vtok, int64_t off, const int NV, float *const dst[4], int64_t d0)
{
    __m512 acc[4][4];
    for (int r = 0; r < 4; ++r)
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const int64_t n = len - t0 < BS ? len - t0 : BS;
        const float *vb = vc + blocks[t0 / BS] * vblk + off;
        for (int64_t i = 0; i < n; ++i) {
            __m512 v[4];
            for (int j = 0; j < NV; ++j) v[j] = _mm512_loadu_ps(vb + i * vtok + 16 * j);
            for (int r = 0; r < 4; ++r) {
                const __m512 pr = _mm512_set1_ps(p[r][t0 + i]);
                for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(pr, v[j], acc[r][j]);
            }
        }
    }
    for (int r = 0; r < 4; ++r)
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(dst[r] + d0 + 16 * j, acc[r][j]);
}
#endif

#define QCHUNK 16
#define SCORES_ROW(L) (((L) + 15) / 16 * 16) /* a row of scratch scores: whole 16-key tiles */

/* Software prefetch of n token rows of `floats` floats, `stride` floats apart: towards L1, or
   L2 where `far`. */
static inline void prefetch_rows(const float *p, int64_t n, int64_t stride, int64_t floats, int far)
{
    for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < floats; f += 16) {
            if (far)
                __builtin_prefetch(p + i * stride + f, 0, 2);
            else
                __builtin_prefetch(p + i * stride + f, 0, 3);
        }
}

/* The rows of one task: tokens j0 .. j0 + jn of a sequence (row jj sees its first vis0 + jj
 * keys), KV heads h0 .. h0 + hn, G query heads each; row r = (jj * hn + h) * G + g. q and out
 * point at token j0's head 0; tokens are H * D (out: H * Dv) apart. Scratch s holds R rows of
 * Ls scores (L = vis0 + jn - 1, the longest row's keys, rounded up to whole tiles of 16), o
 * R * Dv outputs. */
static inline __attribute__((always_inline)) void attend(
    const float *restrict q, const float *restrict kc, const float *restrict vc,
    const int64_t *restrict blocks, int64_t vis0, int64_t jn, float *restrict out,
    float *restrict s, float *restrict o, int64_t h0, int64_t hn, int64_t G, int64_t H,
    const int64_t D, const int64_t Dv, int64_t BS, float scale, int64_t kblk, int64_t ktok,
    int64_t vblk, int64_t vtok)
{
    const int64_t R = jn * hn * G, L = vis0 + jn - 1, Ls = SCORES_ROW(L), rows_tok = hn * G;
    /* all of a short context's K and V towards L2 at once (a long one would push itself out);
       with the per-block prefetches below, 64 contexts of 176 tokens with a cold cache take
       0.32-0.39 ms instead of 0.53-0.62 */
    const int all = hn * (D + Dv) * (int64_t)sizeof(float) * L <= (256 << 10);
    for (int64_t t0 = 0; all && t0 < L; t0 += BS) {
        prefetch_rows(kc + blocks[t0 / BS] * kblk + h0 * D, L - t0 < BS ? L - t0 : BS, ktok,
                      hn * D, 1);
        prefetch_rows(vc + blocks[t0 / BS] * vblk + h0 * Dv, L - t0 < BS ? L - t0 : BS, vtok,
                      hn * Dv, 1);
    }
    for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        const float *kb = kc + blocks[t0 / BS] * kblk + h0 * D;
        /* the cache is cold in a real step (the other layers ran since): ask for the next
           block's keys, and this block's values for the sums of p V, while these are scored */
        if (t0 + BS < L)
            prefetch_rows(kc + blocks[t0 / BS + 1] * kblk + h0 * D,
                          L - t0 - BS < BS ? L - t0 - BS : BS, ktok, hn * D, 0);
        prefetch_rows(vc + blocks[t0 / BS] * vblk + h0 * Dv, n, vtok, hn * Dv, 1);
        int64_t i = 0;
#ifdef __AVX512F__
        /* whole 16-key tiles of the block, also where the task needs only the first keys of one
           (the rest are in the block's storage, scored and never used): which path scores a key
           depends on its place in its block only, not on the chunk, so a token gets the same
           bits whatever chunk it is in */
        if (D % 16 == 0)
            for (; i < n && i + 16 <= BS; i += 16)
                for (int64_t jj = 0; jj < jn; ++jj) {
                    if (t0 + i >= vis0 + jj) /* none of these 16 keys is visible to token jj */
                        continue;
                    for (int64_t h = 0; h < hn; ++h)
                        for (int64_t g = 0; g < G; ++g) {
                            const int64_t r = (jj * hn + h) * G + g;
                            __m512 sc = scores16(q + jj * H * D + (h * G + g) * D,
                                                 kb + i * ktok + h * D, ktok, D);
                            _mm512_storeu_ps(s + r * Ls + t0 + i, _mm512_mul_ps(sc, _mm512_set1_ps(scale)));
                        }
                }
#endif
        for (; i < n; ++i) {
            const int64_t t = t0 + i;
            for (int64_t jj = t - vis0 + 1 > 0 ? t - vis0 + 1 : 0; jj < jn; ++jj)
                for (int64_t h = 0; h < hn; ++h) {
                    const float *kt = kb + i * ktok + h * D;
                    for (int64_t g = 0; g < G; ++g) {
                        const float *qq = q + jj * H * D + (h * G + g) * D;
                        float acc = 0.f;
                        for (int64_t d = 0; d < D; ++d) acc += qq[d] * kt[d];
                        s[((jj * hn + h) * G + g) * Ls + t] = acc * scale;
                    }
                }
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        const int64_t len = vis0 + r / rows_tok;
        float *sr = s + r * Ls, m = sr[0], sum = 0.f;
        for (int64_t t = 1; t < len; ++t) m = sr[t] > m ? sr[t] : m;
        for (int64_t t = 0; t < len; ++t) {
            sr[t] = expf(sr[t] - m);
            sum += sr[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sr[t] *= inv;
    }
#ifdef __AVX512F__
    if (Dv % 16 == 0) {
        /* each (token, KV head): its G rows' sums of p V held in registers, 4 rows x up to 64
           dims at a time (V read once a group of 4, no load and store of partial rows) */
        for (int64_t jj = 0; jj < jn; ++jj)
            for (int64_t h = 0; h < hn; ++h)
                for (int64_t g0 = 0; g0 < G; g0 += 4) {
                    const float *p[4];
                    float *dst[4];
                    for (int64_t k = 0; k < 4; ++k) {
                        const int64_t g = g0 + k < G ? g0 + k : g0; /* missing rows: row g0 again */
                        p[k] = s + ((jj * hn + h) * G + g) * Ls;
                        dst[k] = g0 + k < G ? out + jj * H * Dv + (h * G + g) * Dv : o;
                    }
                    for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
                        const int64_t off = (h0 + h) * Dv + d0, left = Dv - d0;
                        if (left >= 64)
                            pv4(p, vc, blocks, vis0 + jj, BS, vblk, vtok, off, 4, dst, d0);
                        else if (left >= 32)
                            pv4(p, vc, blocks, vis0 + jj, BS, vblk, vtok, off, 2, dst, d0);
                        else
                            pv4(p, vc, blocks, vis0 + jj, BS, vblk, vtok, off, 1, dst, d0);
                        if (left > 32 && left < 64) /* 48: the last 16 */
                            pv4(p, vc, blocks, vis0 + jj, BS, vblk, vtok, off + 32, 1, dst, d0 + 32);
                    }
                }
        return;
    }
#endif
    for (int64_t j = 0; j < R * Dv; ++j) o[j] = 0.f;
    for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        const float *vb = vc + blocks[t0 / BS] * vblk + h0 * Dv;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t t = t0 + i;
            /* the rows that see key t: tokens jj with vis0 + jj > t */
            for (int64_t r = (t - vis0 + 1 > 0 ? t - vis0 + 1 : 0) * rows_tok; r < R; r += rows_tok)
                for (int64_t h = 0; h < hn; ++h) {
                    const float *vt = vb + i * vtok + h * Dv;
                    for (int64_t g = 0; g < G; ++g) {
                        const float p = s[(r + h * G + g) * Ls + t];
                        float *og = o + (r + h * G + g) * Dv;
                        for (int64_t d = 0; d < Dv; ++d) og[d] += p * vt[d];
                    }
                }
        }
    }
    for (int64_t jj = 0; jj < jn; ++jj)
        for (int64_t j = 0; j < rows_tok * Dv; ++j)
            out[jj * H * Dv + j] = o[jj * rows_tok * Dv + j];
}

/* q [N, H, D] and out [N, H, Dv] contiguous, the new tokens of sequence b at rows
 * qstart[b] .. qstart[b] + nq[b]; kc [blocks, BS, KV, D] and vc [blocks, BS, KV, Dv] with the
 * given block and token strides (heads and dims contiguous), the new tokens' K and V already
 * written; table [B, T] block ids; lens [B] context lengths including the new tokens
 * (nq[b] <= lens[b] <= T * BS, nq[b] >= 1). Returns 0, or -1 when scratch memory ran out. */
int moe_paged_attention(
    const float *q, const float *kc, const float *vc, const int64_t *table, const int64_t *lens,
    const int64_t *nq, const int64_t *qstart, float *out, int64_t B, int64_t H, int64_t KV,
    int64_t D, int64_t Dv, int64_t BS, int64_t T, float scale, int64_t kblk, int64_t ktok,
    int64_t vblk, int64_t vtok, int nthreads)
{
    const int64_t G = H / KV;
    int64_t *cum = malloc(sizeof(int64_t) * (B + 1)); /* chunks before sequence b */
    if (cum == NULL)
        return -1;
    cum[0] = 0;
    for (int64_t b = 0; b < B; ++b)
        cum[b + 1] = cum[b] + (nq[b] + QCHUNK - 1) / QCHUNK;
    const int64_t per_task = cum[B] >= 2 * nthreads ? KV : 1, splits = KV / per_task;
    const int64_t tasks = cum[B] * splits;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t chunk = task / splits, h0 = task % splits * per_task;
        int64_t lo = 0, hi = B; /* the sequence b with cum[b] <= chunk < cum[b + 1] */
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (cum[mid] <= chunk)
                lo = mid;
            else
                hi = mid;
        }
        const int64_t b = lo, j0 = (chunk - cum[b]) * QCHUNK;
        const int64_t jn = nq[b] - j0 < QCHUNK ? nq[b] - j0 : QCHUNK;
        const int64_t vis0 = lens[b] - nq[b] + 1 + j0, L = vis0 + jn - 1;
        const int64_t R = jn * per_task * G;
        float *s = malloc(sizeof(float) * (R * (SCORES_ROW(L) + Dv)));
        if (s == NULL) {
            failed = 1;
            continue;
        }
        float *o = s + R * SCORES_ROW(L);
        const float *qb = q + ((qstart[b] + j0) * H + h0 * G) * D;
        float *ob = out + ((qstart[b] + j0) * H + h0 * G) * Dv;
        const int64_t *blocks = table + b * T;
        /* the usual head sizes as constants, so each dot product and row update is unrolled */
        if (D == 32 && Dv == 32)
            attend(qb, kc, vc, blocks, vis0, jn, ob, s, o, h0, per_task, G, H, 32, 32, BS, scale,
                   kblk, ktok, vblk, vtok);
        else if (D == 64 && Dv == 64)
            attend(qb, kc, vc, blocks, vis0, jn, ob, s, o, h0, per_task, G, H, 64, 64, BS, scale,
                   kblk, ktok, vblk, vtok);
        else if (D == 128 && Dv == 128)
            attend(qb, kc, vc, blocks, vis0, jn, ob, s, o, h0, per_task, G, H, 128, 128, BS, scale,
                   kblk, ktok, vblk, vtok);
        else
            attend(qb, kc, vc, blocks, vis0, jn, ob, s, o, h0, per_task, G, H, D, Dv, BS, scale,
                   kblk, ktok, vblk, vtok);
        free(s);
    }
    free(cum);
    return failed ? -1 : 0;
}
