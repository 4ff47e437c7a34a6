/* slotune's CPU decode kernels (bf16), built at first use by serving/kernels/cpu_kernels.py.
 *
 * slotune_gemv_bf16: y = x W^T (+ residual) for a few rows of x (decode at small
 * batch), on a copy of W packed by slotune_pack_rows8_bf16 so each thread streams one
 * contiguous run of memory: blocks of 8 output rows, within a block 32-column chunks
 * of the 8 rows side by side. bf16 dot products, fp32 sums, one rounding. Measured
 * 2026-12-03 on the `small` model's 49 linears at B=1: 52-57 GB/s against 34-35 GB/s
 * for oneDNN's prepacked GEMV in the same runs.
 *
 * slotune_gemm_bf16 (AVX2 build only): the linears of batches past the GEMV's, prefill
 * chunks included, on a second packed copy (16 weight rows column by column), vectorized
 * over output features with x broadcast: up to 12 accumulators in flight. Measured
 * 2026-12-03 on an AVX2-only EPYC, 2 threads, the 24 [4096, 768] linears: 6.2 ms at 2
 * rows, 13.9 at 8, 346 at 256, against 54, 37 and 360 ms for fp32 torch linears on
 * widened weights (torch's bf16 linears there are slower still).
 *
 * slotune_rms_norm_bf16: RMSNorm rows in fp32, rounded once (torch.rms_norm's bits), in a
 * few us where torch's op costs ~12 us hot and more between streamed weights.
 *
 * slotune_decode_attention_bf16: one decoder layer's attention for a decode step
 * (one query token per sequence), in one call instead of ~15 small torch ops:
 * rotary embedding of q and k, the new K/V row written into the cache, grouped-query
 * attention over positions 0..pos of each sequence's own slot (not the whole
 * max_len row), softmax, the weighted sum of V. Rounding follows the torch path in
 * serving/model/transformer.py step by step (rotary products rounded to bf16 as torch rounds
 * them, scores and probabilities rounded to bf16 before use), so the two agree to
 * the accumulation order.
 *
 * slotune_decode_layer_bf16: a whole decoder layer of a decode step at the GEMV's
 * batch sizes (norms, the four GEMVs, attention, SwiGLU, residual adds) in one
 * parallel region, the same steps and roundings as the layer called op by op.
 *
 * slotune_decode_step_bf16: a whole decode step past the embedding at those batch sizes
 * (every layer, the final norm, the lm_head GEMV) in one parallel region.
 *
 * Threads: OpenMP over (sequence, KV head) pairs, as many as the caller passes
 * (torch.get_num_threads(): OpenMP's own count is per calling thread, and an engine
 * step may run on a thread torch never configured). The library links libgomp.so.1,
 * the soname of torch's bundled OpenMP runtime, so once torch is loaded both share
 * one runtime and its thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

static inline float b2f(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f2b(float f) { /* round to nearest even, as torch rounds */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

/* The GEMV and whole-layer kernels are built for one of two instruction sets: AVX-512
   with bf16 dot products (VECTOR_PATH: vdpbf16ps, and the vector attention), or AVX2
   with FMA (AVX2_PATH: bf16 widened to fp32, fp32 FMAs, for the attention too). Without
   either only attention (the scalar path, which the compiler vectorizes) and RMSNorm are
   built. */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define VECTOR_PATH 1
#elif defined(__AVX2__) && defined(__FMA__)
#define AVX2_PATH 1
#endif
#if defined(VECTOR_PATH) || defined(AVX2_PATH)
#define GEMV_PATH 1
#include <immintrin.h>
#endif

/* Returns the path built: 1 AVX-512 bf16, 2 AVX2, 0 scalar only (no GEMV). */
int slotune_kernel_limits(int64_t *max_head_dim, int64_t *max_group) {
    *max_head_dim = MAX_HEAD_DIM;
    *max_group = MAX_GROUP;
#if defined(VECTOR_PATH)
    return 1;
#elif defined(AVX2_PATH)
    return 2;
#else
    return 0;
#endif
}

static void rms_row(const bf16 *xi, const bf16 *w, bf16 *oi, int64_t d, float eps) {
    float ss = 0.f;
    for (int64_t k = 0; k < d; k++) ss += b2f(xi[k]) * b2f(xi[k]);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t k = 0; k < d; k++) oi[k] = f2b(b2f(xi[k]) * r * b2f(w[k]));
}

/* x [n, d] -> out [n, d]: x * rsqrt(mean(x^2) + eps) * w, computed in fp32. */
void slotune_rms_norm_bf16(const bf16 *x, const bf16 *w, bf16 *out, int64_t n, int64_t d,
                           float eps, int nthreads) {
#pragma omp parallel for if (n >= 32) num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n; i++) rms_row(x + i * d, w, out + i * d, d, eps);
}

/* x * cos + rotate_half(x) * sin, as torch computes it in bf16: the product
   x * cos rounded, then addcmul (one more rounding). sin_signed has its first half
   negated, so rotate_half(x) * sin == swap_halves(x) * sin_signed. */
static inline void rope(const bf16 *x, const bf16 *cs, const bf16 *sn, int64_t d, bf16 *o) {
    int64_t h = d / 2;
    for (int64_t k = 0; k < d; k++) {
        float swapped = b2f(x[k < h ? k + h : k - h]);
        float a = b2f(f2b(b2f(x[k]) * b2f(cs[k])));
        o[k] = f2b(a + swapped * b2f(sn[k]));
    }
}

/* Softmax of sc[0..n) in place, probabilities rounded to bf16 (torch's bf16 softmax
   output). Scalar: the vector path has its own. */
static void softmax_scalar(float *sc, int64_t n) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
    for (int64_t t = 0; t < n; t++) {
        sc[t] = expf(sc[t] - mx);
        sum += sc[t];
    }
    float inv = 1.f / sum;
    for (int64_t t = 0; t < n; t++) sc[t] = b2f(f2b(sc[t] * inv));
}

static void attend_scalar(bf16 qr[][MAX_HEAD_DIM], const bf16 *kc, const bf16 *vc, int64_t n,
                          int64_t g, int64_t d, float scale, float *sc, int64_t stride,
                          float acc[][MAX_HEAD_DIM]) {
    for (int64_t j = 0; j < g; j++) {
        float *sj = sc + j * stride;
        float q[MAX_HEAD_DIM];
        for (int64_t k = 0; k < d; k++) q[k] = b2f(qr[j][k]);
        for (int64_t t = 0; t < n; t++) {
            const bf16 *kt = kc + t * d;
            float s = 0.f;
            for (int64_t k = 0; k < d; k++) s += q[k] * b2f(kt[k]);
            sj[t] = b2f(f2b(s * scale));
        }
        softmax_scalar(sj, n);
        for (int64_t k = 0; k < d; k++) acc[j][k] = 0.f;
        for (int64_t t = 0; t < n; t++) {
            const bf16 *vt = vc + t * d;
            float p = sj[t];
            for (int64_t k = 0; k < d; k++) acc[j][k] += p * b2f(vt[k]);
        }
    }
}

#ifdef GEMV_PATH
/* 2^f for |f| <= 1/2: a degree-6 polynomial (relative error ~2e-7) in the vector width
   whose fmadd and set1 are given (exp16 and exp8 below). */
#define EXP2_POLY(fmadd, set1, f)                                                            \
    fmadd(fmadd(fmadd(fmadd(fmadd(fmadd(set1(1.535336188319500e-4f), f,                     \
                                        set1(1.339887440266574e-3f)),                        \
                                  f, set1(9.618437357674640e-3f)),                           \
                            f, set1(5.550332471162809e-2f)),                                 \
                      f, set1(2.402264791363012e-1f)),                                       \
                f, set1(6.931472028550421e-1f)),                                             \
          f, set1(1.0f))

/* p [O * I] from w [O, I] (row-major): for each block of 8 rows, for each 32-column
   chunk, the 8 rows' 32 values one after another. O % 8 == 0, I % 32 == 0. */
void slotune_pack_rows8_bf16(const bf16 *w, bf16 *p, int64_t O, int64_t I) {
    for (int64_t o0 = 0; o0 < O; o0 += 8)
        for (int64_t i = 0; i < I; i += 32)
            for (int64_t r = 0; r < 8; r++, p += 32) memcpy(p, w + (o0 + r) * I + i, 64);
}
#endif

#ifdef VECTOR_PATH
#define VEC_MAX_GROUP 8

static inline void gemv_store(const __m512 a[8], bf16 *o, const bf16 *res) {
    for (int r = 0; r < 8; r++) {
        const float v = _mm512_reduce_add_ps(a[r]);
        o[r] = f2b(res ? v + b2f(res[r]) : v);
    }
}

/* out [M, O] = x [M, I] W^T (+ res [M, O] when res is not NULL), rounded once. p from
   slotune_pack_rows8_bf16, 64-byte aligned. Rows of x go in pairs through a block;
   the next pair re-reads it from cache. A worksharing loop: call it inside a parallel
   region (every thread of the team). */
static void gemv_for(const bf16 *x, const bf16 *p, const bf16 *res, bf16 *out, int64_t M,
                     int64_t O, int64_t I) {
#pragma omp for schedule(static)
    for (int64_t o0 = 0; o0 < O; o0 += 8) {
        const bf16 *blk = p + o0 * I;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) { /* two rows of x per pass over the block */
            const bf16 *x0 = x + m * I, *x1 = x0 + I;
            __m512 a[8], b[8];
            for (int r = 0; r < 8; r++) a[r] = b[r] = _mm512_setzero_ps();
            for (int64_t i = 0; i < I; i += 32) {
                const __m512bh xv0 = (__m512bh)_mm512_loadu_si512(x0 + i);
                const __m512bh xv1 = (__m512bh)_mm512_loadu_si512(x1 + i);
                const bf16 *c = blk + i * 8;
                for (int r = 0; r < 8; r++) {
                    const __m512bh wv = (__m512bh)_mm512_load_si512(c + 32 * r);
                    a[r] = _mm512_dpbf16_ps(a[r], xv0, wv);
                    b[r] = _mm512_dpbf16_ps(b[r], xv1, wv);
                }
            }
            gemv_store(a, out + m * O + o0, res ? res + m * O + o0 : NULL);
            gemv_store(b, out + (m + 1) * O + o0, res ? res + (m + 1) * O + o0 : NULL);
        }
        for (; m < M; m++) {
            const bf16 *xm = x + m * I;
            __m512 a[8];
            for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();
            for (int64_t i = 0; i < I; i += 32) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xm + i);
                const bf16 *c = blk + i * 8;
                for (int r = 0; r < 8; r++)
                    a[r] = _mm512_dpbf16_ps(a[r], xv, (__m512bh)_mm512_load_si512(c + 32 * r));
            }
            gemv_store(a, out + m * O + o0, res ? res + m * O + o0 : NULL);
        }
    }
}


/* exp(x) for x <= 0: 2^(x log2 e) as 2^n * p(f), |f| <= 1/2, degree-6 polynomial
   (relative error ~2e-7, below bf16's 4e-3 the result is rounded to). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.f), x); /* NaN stays NaN (max returns operand 2) */
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    const __m512 p = EXP2_POLY(_mm512_fmadd_ps, _mm512_set1_ps, f);
    return _mm512_scalef_ps(p, n);
}

static inline __m512 load16(const bf16 *p) { /* 16 bf16 -> 16 fp32 */
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void softmax_vec(float *sj, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sj + t));
    float mx = _mm512_reduce_max_ps(m);
    for (; t < n; t++) mx = sj[t] > mx ? sj[t] : mx;
    __m512 vm = _mm512_set1_ps(mx), sum = _mm512_setzero_ps();
    for (t = 0; t < n; t += 16) {
        __mmask16 k = (n - t >= 16) ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
        __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sj + t), vm)));
        _mm512_mask_storeu_ps(sj + t, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    float inv = 1.f / _mm512_reduce_add_ps(sum);
    for (t = 0; t < n; t++) sj[t] = b2f(f2b(sj[t] * inv));
}

/* D a multiple of 32 up to 128 (a compile-time constant at each call site), g <= 8.
   Scores by vdpbf16ps on the bf16 q and K rows (fp32 accumulation), P.V by fp32 FMAs. */
static inline __attribute__((always_inline)) void attend_vec(
    bf16 qr[][MAX_HEAD_DIM], const bf16 *kc, const bf16 *vc, int64_t n, int64_t g, const int D,
    float scale, float *sc, int64_t stride, float acc[][MAX_HEAD_DIM]) {
    __m512bh q[VEC_MAX_GROUP][4];
    for (int64_t j = 0; j < g; j++)
        for (int c = 0; c < D / 32; c++) q[j][c] = (__m512bh)_mm512_loadu_si512(qr[j] + 32 * c);
    for (int64_t t = 0; t < n; t++) {
        __m512bh k[4];
        for (int c = 0; c < D / 32; c++) k[c] = (__m512bh)_mm512_loadu_si512(kc + t * D + 32 * c);
        for (int64_t j = 0; j < g; j++) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < D / 32; c++) a = _mm512_dpbf16_ps(a, q[j][c], k[c]);
            sc[j * stride + t] = b2f(f2b(_mm512_reduce_add_ps(a) * scale));
        }
    }
    for (int64_t j = 0; j < g; j++) softmax_vec(sc + j * stride, n);
    __m512 a[VEC_MAX_GROUP][8];
    for (int64_t j = 0; j < g; j++)
        for (int c = 0; c < D / 16; c++) a[j][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        __m512 v[8];
        for (int c = 0; c < D / 16; c++) v[c] = load16(vc + t * D + 16 * c);
        for (int64_t j = 0; j < g; j++) {
            __m512 p = _mm512_set1_ps(sc[j * stride + t]);
            for (int c = 0; c < D / 16; c++) a[j][c] = _mm512_fmadd_ps(p, v[c], a[j][c]);
        }
    }
    for (int64_t j = 0; j < g; j++)
        for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(acc[j] + 16 * c, a[j][c]);
}
#endif

#ifdef AVX2_PATH
#define VEC_MAX_GROUP 8

static inline __m256 cvt8(const bf16 *p) { /* 8 bf16 -> 8 fp32 */
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline void gemv_store8(const __m256 *a, int n, bf16 *o, const bf16 *res) {
    for (int r = 0; r < n; r++) {
        const float v = hsum8(a[r]);
        o[r] = f2b(res ? v + b2f(res[r]) : v);
    }
}

/* gemv_for as on the AVX-512 path (same layout, arguments and worksharing), in fp32 FMAs
   on bf16 widened by interleaving with zeros: unpacking a 256-bit load of 16 bf16 with
   a zero vector puts each value in the high half of a 32-bit lane, i.e. makes it an
   fp32. The low unpack takes columns 0-3 and 8-11 of the 16, the high one 4-7 and
   12-15; x goes through the same unpacks, so lane by lane the products pair up. Each
   lane sums its two products (low, then high) across the row. A shuffle per half
   measured 5-9 % faster than the shift/mask pair (EVEN16/ODD16 below, which the GEMM
   keeps) on this AVX2 Zen 4 in cache (2026-12-03), where the FMA pipes also shift.
   AVX2 has 16 vector registers: two rows of x go through half a block (4 weight rows)
   at a time, a lone row through the whole block; each (row of x, weight row) sum takes
   its terms in the same order either way, so a row's result does not depend on the
   batch it is in. */
#define LO16(v) _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), (v)))
#define HI16(v) _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), (v)))
/* The GEMM's widening: a lane's high bf16 with its low half cleared, its low one
   shifted up. */
#define EVEN16(v) _mm256_castsi256_ps(_mm256_slli_epi32((v), 16))
#define ODD16(v) _mm256_castsi256_ps(_mm256_and_si256((v), _mm256_set1_epi32((int)0xffff0000u)))
static inline __m256i load256(const bf16 *p) { return _mm256_loadu_si256((const __m256i *)p); }

static void gemv_for(const bf16 *x, const bf16 *p, const bf16 *res, bf16 *out, int64_t M,
                     int64_t O, int64_t I) {
#pragma omp for schedule(static)
    for (int64_t o0 = 0; o0 < O; o0 += 8) {
        const bf16 *blk = p + o0 * I;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            const bf16 *x0 = x + m * I, *x1 = x0 + I;
            for (int h = 0; h < 8; h += 4) {
                __m256 a[4], b[4];
                for (int r = 0; r < 4; r++) a[r] = b[r] = _mm256_setzero_ps();
                for (int64_t i = 0; i < I; i += 32) {
                    const bf16 *c = blk + i * 8 + 32 * h;
                    for (int k = 0; k < 32; k += 16) {
                        const __m256i v0 = load256(x0 + i + k), v1 = load256(x1 + i + k);
                        const __m256 x0e = LO16(v0), x0o = HI16(v0);
                        const __m256 x1e = LO16(v1), x1o = HI16(v1);
                        for (int r = 0; r < 4; r++) {
                            const __m256i w = load256(c + 32 * r + k);
                            const __m256 we = LO16(w), wo = HI16(w);
                            a[r] = _mm256_fmadd_ps(wo, x0o, _mm256_fmadd_ps(we, x0e, a[r]));
                            b[r] = _mm256_fmadd_ps(wo, x1o, _mm256_fmadd_ps(we, x1e, b[r]));
                        }
                    }
                }
                const int64_t at = o0 + h;
                gemv_store8(a, 4, out + m * O + at, res ? res + m * O + at : NULL);
                gemv_store8(b, 4, out + (m + 1) * O + at, res ? res + (m + 1) * O + at : NULL);
            }
        }
        for (; m < M; m++) {
            const bf16 *xm = x + m * I;
            __m256 a[8];
            for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
            for (int64_t i = 0; i < I; i += 32) {
                const bf16 *c = blk + i * 8;
                for (int k = 0; k < 32; k += 16) {
                    const __m256i v = load256(xm + i + k);
                    const __m256 xe = LO16(v), xo = HI16(v);
                    for (int r = 0; r < 8; r++) {
                        const __m256i w = load256(c + 32 * r + k);
                        a[r] = _mm256_fmadd_ps(HI16(w), xo, _mm256_fmadd_ps(LO16(w), xe, a[r]));
                    }
                }
            }
            gemv_store8(a, 8, out + m * O + o0, res ? res + m * O + o0 : NULL);
        }
    }
}

/* The small GEMM of decode batches past the GEMV's (AVX2 path): out [M, O] = x [M, I] W^T
   (+ res), x given in fp32. Vectorized over output features, the classic way: for each
   input column i, 16 weights W[o0..o0+15, i] (contiguous in the cols16 copy: for each
   block of 16 rows, column by column; widened as pairs, even rows in one vector, odd in
   the other) times x[m, i] broadcast, into 2 accumulators per row of x, up to 6 rows at
   a time (12 accumulators), so each weight loaded feeds 12 FMAs. Each output's sum runs
   over i in order. O % 16 == 0. */
void slotune_pack_cols16_bf16(const bf16 *w, bf16 *p, int64_t O, int64_t I) {
    for (int64_t o0 = 0; o0 < O; o0 += 16)
        for (int64_t i = 0; i < I; i++)
            for (int64_t j = 0; j < 16; j++) *p++ = w[(o0 + j) * I + i];
}

/* A tile: mg rows of x (1..6) times nb blocks of 16 weight rows (nb * mg <= 6, at most
   12 accumulators): few rows take two blocks at once, so enough sums are in flight to
   hide the FMA latency. */
static inline __attribute__((always_inline)) void gemm_tile(
    const float *x, const bf16 *blk, const bf16 *res, bf16 *out, int64_t O, int64_t I,
    const int mg, const int nb) {
    __m256 e[2][6], o[2][6]; /* registers: every loop below is unrolled (constant bounds) */
#pragma GCC unroll 2
    for (int b = 0; b < nb; b++)
#pragma GCC unroll 6
        for (int k = 0; k < mg; k++) e[b][k] = o[b][k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < I; i++) {
        __m256 we[2], wo[2];
#pragma GCC unroll 2
        for (int b = 0; b < nb; b++) {
            const __m256i v = load256(blk + b * 16 * I + 16 * i);
            we[b] = EVEN16(v);
            wo[b] = ODD16(v);
        }
#pragma GCC unroll 6
        for (int k = 0; k < mg; k++) {
            const __m256 xb = _mm256_broadcast_ss(x + k * I + i);
#pragma GCC unroll 2
            for (int b = 0; b < nb; b++) {
                e[b][k] = _mm256_fmadd_ps(we[b], xb, e[b][k]);
                o[b][k] = _mm256_fmadd_ps(wo[b], xb, o[b][k]);
            }
        }
    }
#pragma GCC unroll 2
    for (int b = 0; b < nb; b++)
#pragma GCC unroll 6
        for (int k = 0; k < mg; k++) {
            float ev[8], ov[8];
            _mm256_storeu_ps(ev, e[b][k]);
            _mm256_storeu_ps(ov, o[b][k]);
            bf16 *ok = out + k * O + 16 * b;
            const bf16 *rk = res ? res + k * O + 16 * b : NULL;
            for (int j = 0; j < 8; j++) {
                ok[2 * j] = f2b(rk ? ev[j] + b2f(rk[2 * j]) : ev[j]);
                ok[2 * j + 1] = f2b(rk ? ov[j] + b2f(rk[2 * j + 1]) : ov[j]);
            }
        }
}

/* Rows m.. of x (mg of them) against nb blocks starting at output row o0. */
static void gemm_rows(const float *x, const bf16 *p, const bf16 *res, bf16 *out, int64_t m,
                      int64_t mg, int64_t o0, int nb, int64_t O, int64_t I) {
    const float *xm = x + m * I;
    const bf16 *blk = p + o0 * I, *rm = res ? res + m * O + o0 : NULL;
    bf16 *om = out + m * O + o0;
    if (nb == 2) {
        switch (mg) {
        case 1: gemm_tile(xm, blk, rm, om, O, I, 1, 2); return;
        case 2: gemm_tile(xm, blk, rm, om, O, I, 2, 2); return;
        default: gemm_tile(xm, blk, rm, om, O, I, 3, 2); return;
        }
    }
    switch (mg) {
    case 1: gemm_tile(xm, blk, rm, om, O, I, 1, 1); return;
    case 2: gemm_tile(xm, blk, rm, om, O, I, 2, 1); return;
    case 3: gemm_tile(xm, blk, rm, om, O, I, 3, 1); return;
    case 4: gemm_tile(xm, blk, rm, om, O, I, 4, 1); return;
    case 5: gemm_tile(xm, blk, rm, om, O, I, 5, 1); return;
    default: gemm_tile(xm, blk, rm, om, O, I, 6, 1); return;
    }
}

void slotune_gemm_bf16(const float *x, const bf16 *p, const bf16 *res, bf16 *out, int64_t M,
                       int64_t O, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o0 = 0; o0 < O; o0 += 32) { /* two blocks of 16 rows (one at a tail) */
        const int pair = o0 + 32 <= O;
        for (int64_t m = 0; m < M; m += 6) {
            const int64_t mg = M - m < 6 ? M - m : 6;
            if (pair && mg <= 3) { /* few rows: both blocks in one tile, 3 rows at a time */
                gemm_rows(x, p, res, out, m, mg, o0, 2, O, I);
                continue;
            }
            gemm_rows(x, p, res, out, m, mg, o0, 1, O, I);
            if (pair) gemm_rows(x, p, res, out, m, mg, o0 + 16, 1, O, I);
        }
    }
}

/* exp(x) for x <= 0, as exp16 on the AVX-512 path (the same polynomial); 2^n built in
   the exponent bits (n >= -126 after the clamp). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n);
    const __m256 p = EXP2_POLY(_mm256_fmadd_ps, _mm256_set1_ps, f);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* softmax_vec of the AVX-512 path, 8 at a time (exp8: the same polynomial); the tail's
   lanes masked. */
static inline void softmax_vec8(float *sj, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sj + t));
    float mv[8], mx = -INFINITY;
    _mm256_storeu_ps(mv, m);
    for (int i = 0; i < 8; i++) mx = mv[i] > mx ? mv[i] : mx;
    for (; t < n; t++) mx = sj[t] > mx ? sj[t] : mx;
    const __m256 vm = _mm256_set1_ps(mx);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 sum = _mm256_setzero_ps();
    for (t = 0; t < n; t += 8) {
        const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - t)), lane);
        const __m256 x = _mm256_maskload_ps(sj + t, k);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, vm)), _mm256_castsi256_ps(k));
        _mm256_maskstore_ps(sj + t, k, e);
        sum = _mm256_add_ps(sum, e);
    }
    const float inv = 1.f / hsum8(sum);
    for (t = 0; t < n; t++) sj[t] = b2f(f2b(sj[t] * inv));
}

/* attend_vec of the AVX-512 path in AVX2 (D a multiple of 16 up to 128, a compile-time
   constant at each call site; g <= VEC_MAX_GROUP): scores as fp32 FMAs on K rows widened
   by the GEMV's unpacks (q widened the same way once), P.V as fp32 FMAs over positions in
   order, each dimension's sum as the scalar path takes it. */
static inline __attribute__((always_inline)) void attend_avx2(
    bf16 qr[][MAX_HEAD_DIM], const bf16 *kc, const bf16 *vc, int64_t n, int64_t g, const int D,
    float scale, float *sc, int64_t stride, float acc[][MAX_HEAD_DIM]) {
    float qf[VEC_MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(32)));
    for (int64_t j = 0; j < g; j++)
        for (int c = 0; c < D / 16; c++) {
            const __m256i v = load256(qr[j] + 16 * c);
            _mm256_store_ps(qf[j] + 16 * c, LO16(v));
            _mm256_store_ps(qf[j] + 16 * c + 8, HI16(v));
        }
    for (int64_t t = 0; t < n; t++) {
        __m256 k[16];
        for (int c = 0; c < D / 16; c++) {
            const __m256i v = load256(kc + t * D + 16 * c);
            k[2 * c] = LO16(v);
            k[2 * c + 1] = HI16(v);
        }
        for (int64_t j = 0; j < g; j++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int c = 0; c < D / 8; c += 2) {
                a0 = _mm256_fmadd_ps(k[c], _mm256_load_ps(qf[j] + 8 * c), a0);
                a1 = _mm256_fmadd_ps(k[c + 1], _mm256_load_ps(qf[j] + 8 * c + 8), a1);
            }
            sc[j * stride + t] = b2f(f2b(hsum8(_mm256_add_ps(a0, a1)) * scale));
        }
    }
    for (int64_t j = 0; j < g; j++) softmax_vec8(sc + j * stride, n);
    for (int64_t j = 0; j < g; j++) {
        const float *sj = sc + j * stride;
        __m256 a[16];
        for (int c = 0; c < D / 8; c++) a[c] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m256 p = _mm256_set1_ps(sj[t]);
            for (int c = 0; c < D / 8; c++) a[c] = _mm256_fmadd_ps(p, cvt8(vc + t * D + 8 * c), a[c]);
        }
        for (int c = 0; c < D / 8; c++) _mm256_storeu_ps(acc[j] + 8 * c, a[c]);
    }
}

/* silu_mul16 of the AVX-512 path, 8 at a time, twice. */
static inline void silu_mul16(const bf16 *gate, const bf16 *up, bf16 *o) {
    for (int k = 0; k < 16; k += 8) {
        const __m256 x = cvt8(gate + k), u = cvt8(up + k), zero = _mm256_setzero_ps();
        const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
        const __m256 e = exp8(_mm256_sub_ps(zero, ax));
        const __m256 neg = _mm256_cmp_ps(x, zero, _CMP_LT_OQ);
        const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), neg);
        const __m256 s = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        float sv[8], uv[8];
        _mm256_storeu_ps(sv, s);
        _mm256_storeu_ps(uv, u);
        for (int i = 0; i < 8; i++) o[k + i] = f2b(b2f(f2b(sv[i])) * uv[i]);
    }
}
#endif

#ifdef GEMV_PATH
void slotune_gemv_bf16(const bf16 *x, const bf16 *p, const bf16 *res, bf16 *out, int64_t M,
                       int64_t O, int64_t I, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    gemv_for(x, p, res, out, M, O, I);
}
#endif

static int check_rows(const int64_t *positions, const int64_t *slots, int64_t B, int64_t S,
                      int64_t L, int64_t P) {
    for (int64_t b = 0; b < B; b++)
        if (positions[b] < 0 || positions[b] >= L || positions[b] >= P || slots[b] < 0 ||
            slots[b] >= S)
            return -2;
    return 0;
}

/* A thread's attention scratch, g * (L + 16) floats; on failure sets *failed (read by
   every thread after the next barrier) and returns NULL. */
static float *thread_scratch(int64_t g, int64_t L, int *failed) {
    float *sc = (float *)malloc(sizeof(float) * (size_t)(g * (L + 16)));
    if (sc == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
    return sc;
}

/* The vector attention of the build (D 32, 64 or 128 as a constant, g <= VEC_MAX_GROUP). */
#if defined(VECTOR_PATH)
#define ATTEND_VEC attend_vec
#elif defined(AVX2_PATH)
#define ATTEND_VEC attend_avx2
#endif

/* The decode attention of one layer as a worksharing loop over (sequence, KV head)
   pairs: call it inside a parallel region, sc a thread's own scratch of g * (L + 16)
   floats. Arguments as slotune_decode_attention_bf16's. */
static void attention_for(const bf16 *qkv, bf16 *cache, const bf16 *cos_t, const bf16 *sin_t,
                          const int64_t *positions, const int64_t *slots, bf16 *out, int64_t B,
                          int64_t H, int64_t Hkv, int64_t D, int64_t S, int64_t L, float scale,
                          float *sc) {
    const int64_t g = H / Hkv, row = (H + 2 * Hkv) * D, stride = L + 16;
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * Hkv; bh++) {
        const int64_t b = bh / Hkv, kh = bh % Hkv, pos = positions[b], slot = slots[b];
        const bf16 *cs = cos_t + pos * D, *sn = sin_t + pos * D, *src = qkv + b * row;
        bf16 *kc = cache + ((0 * S + slot) * Hkv + kh) * L * D;
        bf16 *vc = cache + ((1 * S + slot) * Hkv + kh) * L * D;
        rope(src + (H + kh) * D, cs, sn, D, kc + pos * D);
        memcpy(vc + pos * D, src + (H + Hkv + kh) * D, (size_t)D * sizeof(bf16));
        bf16 qr[MAX_GROUP][MAX_HEAD_DIM];
        float acc[MAX_GROUP][MAX_HEAD_DIM];
        for (int64_t j = 0; j < g; j++) rope(src + (kh * g + j) * D, cs, sn, D, qr[j]);
        const int64_t n = pos + 1;
#ifdef ATTEND_VEC
        if (g <= VEC_MAX_GROUP && D == 64)
            ATTEND_VEC(qr, kc, vc, n, g, 64, scale, sc, stride, acc);
        else if (g <= VEC_MAX_GROUP && D == 128)
            ATTEND_VEC(qr, kc, vc, n, g, 128, scale, sc, stride, acc);
        else if (g <= VEC_MAX_GROUP && D == 32)
            ATTEND_VEC(qr, kc, vc, n, g, 32, scale, sc, stride, acc);
        else
#endif
            attend_scalar(qr, kc, vc, n, g, D, scale, sc, stride, acc);
        for (int64_t j = 0; j < g; j++) {
            bf16 *o = out + b * H * D + (kh * g + j) * D;
            for (int64_t k = 0; k < D; k++) o[k] = f2b(acc[j][k]);
        }
    }
}

/* qkv [B, H + 2*Hkv, D] (the fused projection's output: q heads, K heads, V heads);
   cache [2, S, Hkv, L, D] (K at 0, V at 1); cos_t, sin_t [P, D] (sin_t with its first
   half negated); positions, slots [B]; out [B, H*D]. Query head h uses KV head h / g.
   Returns 0; -2 when a position is outside [0, min(L, P)) or a slot outside [0, S);
   -1 when a scratch buffer could not be allocated (nothing written in either case). */
int slotune_decode_attention_bf16(const bf16 *qkv, bf16 *cache, const bf16 *cos_t,
                                  const bf16 *sin_t, const int64_t *positions,
                                  const int64_t *slots, bf16 *out, int64_t B, int64_t H,
                                  int64_t Hkv, int64_t D, int64_t S, int64_t L, int64_t P,
                                  float scale, int nthreads) {
    if (check_rows(positions, slots, B, S, L, P)) return -2;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = thread_scratch(H / Hkv, L, &failed);
#pragma omp barrier
        if (!failed)
            attention_for(qkv, cache, cos_t, sin_t, positions, slots, out, B, H, Hkv, D, S, L,
                          scale, sc);
        free(sc);
    }
    return failed ? -1 : 0;
}

#ifdef VECTOR_PATH
/* x * sigmoid(x) rounded to bf16 (torch's bf16 silu), times up, rounded again (torch's
   bf16 mul): 16 at a time. sigmoid from exp(-|x|), so exp16 never sees x > 0. */
static inline void silu_mul16(const bf16 *gate, const bf16 *up, bf16 *o) {
    const __m512 x = load16(gate), u = load16(up);
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    /* x >= 0: x / (1 + e); x < 0: x * e / (1 + e) */
    const __m512 num = _mm512_mask_mul_ps(x, neg, x, e);
    const __m512 s = _mm512_div_ps(num, _mm512_add_ps(one, e));
    float sv[16], uv[16];
    _mm512_storeu_ps(sv, s);
    _mm512_storeu_ps(uv, u);
    for (int i = 0; i < 16; i++) o[i] = f2b(b2f(f2b(sv[i])) * uv[i]);
}
#endif

#ifdef GEMV_PATH
/* Scratch of the whole-layer calls: normed rows [M, d], qkv [M, nq], attention [M, na],
   gate|up [M, 2I], act [M, I]. */
typedef struct {
    bf16 *h, *qkv, *att, *gu, *act;
} layer_scratch;

static bf16 *scratch_alloc(layer_scratch *s, int64_t M, int64_t d, int64_t nq, int64_t na,
                           int64_t I) {
    bf16 *h = (bf16 *)malloc(sizeof(bf16) * (size_t)(M * (d + nq + na + 3 * I)));
    if (h != NULL) {
        s->h = h;
        s->qkv = h + M * d;
        s->att = s->qkv + M * nq;
        s->gu = s->att + M * na;
        s->act = s->gu + M * 2 * I;
    }
    return h;
}

/* One decoder layer run by every thread of a team (worksharing loops; their barriers
   order the steps): x_out = h + down(silu(gate) * up) of norm2(h), h = x + o(attention
   of qkv(norm1(x))). sc: the thread's attention scratch. */
static void layer_team(const bf16 *x_in, bf16 *x_out, const bf16 *norm1, const bf16 *norm2,
                       float eps1, float eps2, const bf16 *qkv_p, const bf16 *o_p,
                       const bf16 *gate_up_p, const bf16 *down_p, bf16 *cache,
                       const bf16 *cos_t, const bf16 *sin_t, const int64_t *positions,
                       const int64_t *slots, int64_t M, int64_t d, int64_t I, int64_t H,
                       int64_t Hkv, int64_t D, int64_t S, int64_t L, float scale,
                       const layer_scratch *w, float *sc) {
    const int64_t nq = (H + 2 * Hkv) * D, na = H * D;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) rms_row(x_in + m * d, norm1, w->h + m * d, d, eps1);
    gemv_for(w->h, qkv_p, NULL, w->qkv, M, nq, d);
    attention_for(w->qkv, cache, cos_t, sin_t, positions, slots, w->att, M, H, Hkv, D, S, L,
                  scale, sc);
    gemv_for(w->att, o_p, x_in, x_out, M, d, na);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) rms_row(x_out + m * d, norm2, w->h + m * d, d, eps2);
    gemv_for(w->h, gate_up_p, NULL, w->gu, M, 2 * I, d);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < M * I; c += 16) { /* I % 16 == 0: no chunk spans rows */
        const int64_t m = c / I, i = c % I;
        silu_mul16(w->gu + m * 2 * I + i, w->gu + m * 2 * I + I + i, w->act + m * I + i);
    }
    gemv_for(w->act, down_p, x_out, x_out, M, d, I);
}

/* One decoder layer of a decode step for a few rows (the GEMV's batch sizes), in one
   parallel region: the same steps, roundings and kernels as the layer run op by op
   (Block.forward with the kernels), without returning to Python between them. Weights
   from slotune_pack_rows8_bf16; d, H*D and I multiples of 32, (H + 2*Hkv)*D, d and 2*I
   of 8. x_in and x_out [M, d] may not overlap. Returns as slotune_decode_attention_bf16. */
int slotune_decode_layer_bf16(const bf16 *x_in, bf16 *x_out, const bf16 *norm1,
                              const bf16 *norm2, float eps1, float eps2, const bf16 *qkv_p,
                              const bf16 *o_p, const bf16 *gate_up_p, const bf16 *down_p,
                              bf16 *cache, const bf16 *cos_t, const bf16 *sin_t,
                              const int64_t *positions, const int64_t *slots, int64_t M,
                              int64_t d, int64_t I, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                              int64_t L, int64_t P, float scale, int nthreads) {
    if (check_rows(positions, slots, M, S, L, P)) return -2;
    layer_scratch w;
    bf16 *buf = scratch_alloc(&w, M, d, (H + 2 * Hkv) * D, H * D, I);
    if (buf == NULL) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = thread_scratch(H / Hkv, L, &failed);
#pragma omp barrier
        if (!failed)
            layer_team(x_in, x_out, norm1, norm2, eps1, eps2, qkv_p, o_p, gate_up_p, down_p,
                       cache, cos_t, sin_t, positions, slots, M, d, I, H, Hkv, D, S, L, scale,
                       &w, sc);
        free(sc);
    }
    free(buf);
    return failed ? -1 : 0;
}

/* A whole decode step past the embedding for a few rows, in one parallel region: every
   layer as slotune_decode_layer_bf16 runs it, then the final norm and the lm_head GEMV
   (bf16 logits [M, V], rounded as the lm_head's GEMV rounds them). ``layers``: per layer
   seven addresses, norm1, norm2, qkv, o, gate|up and down (rows8 copies) and its KV
   cache; every norm takes ``eps``. x_in [M, d] is not written. Returns as
   slotune_decode_attention_bf16. */
int slotune_decode_step_bf16(const bf16 *x_in, bf16 *logits, const int64_t *layers,
                             int64_t n_layers, const bf16 *norm_f, const bf16 *head_p,
                             int64_t V, float eps, const bf16 *cos_t, const bf16 *sin_t,
                             const int64_t *positions, const int64_t *slots, int64_t M,
                             int64_t d, int64_t I, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                             int64_t L, int64_t P, float scale, int nthreads) {
    if (check_rows(positions, slots, M, S, L, P)) return -2;
    layer_scratch w;
    bf16 *buf = scratch_alloc(&w, M, d, (H + 2 * Hkv) * D, H * D, I);
    bf16 *xs = (bf16 *)malloc(sizeof(bf16) * (size_t)(2 * M * d)); /* ping-pong rows */
    if (buf == NULL || xs == NULL) {
        free(buf);
        free(xs);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = thread_scratch(H / Hkv, L, &failed);
#pragma omp barrier
        if (!failed) {
            const bf16 *x = x_in;
            for (int64_t l = 0; l < n_layers; l++) {
                const int64_t *a = layers + 7 * l;
                bf16 *y = xs + (l % 2) * M * d;
                layer_team(x, y, (const bf16 *)a[0], (const bf16 *)a[1], eps, eps,
                           (const bf16 *)a[2], (const bf16 *)a[3], (const bf16 *)a[4],
                           (const bf16 *)a[5], (bf16 *)a[6], cos_t, sin_t, positions, slots,
                           M, d, I, H, Hkv, D, S, L, scale, &w, sc);
                x = y; /* the down GEMV's loop barrier: every row of y is written */
            }
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) rms_row(x + m * d, norm_f, w.h + m * d, d, eps);
            gemv_for(w.h, head_p, NULL, logits, M, V, d);
        }
        free(sc);
    }
    free(buf);
    free(xs);
    return failed ? -1 : 0;
}
#endif
