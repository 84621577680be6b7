/* Absorbed-MLA attention straight over the paged latent cache, for CPU ranks.
 *
 * One call attends n query rows, each over the keys of its own request that this rank holds: the
 * request's page table (a row of tables[B, W]; -1 = page not held here) and the row's position (keys
 * at positions <= it are visible). Nothing is gathered, padded or masked: the loops visit exactly the
 * visible keys, which is what the torch path (gather whole pages, mask by position) cannot do.
 *
 * Per (row, block of heads): pass 1 scores every visible key against the block's heads (the key is
 * read once for all of them), a softmax per head, pass 2 accumulates p * c_kv four keys at a time.
 * Scores, softmax and sums are in float (double for double inputs); bf16 is converted on load.
 * Threads: OpenMP over (row, head block) units; the caller's process already has torch's libgomp,
 * which this library then shares (one thread pool).
 *
 * Layout: queries as q_lat [n, h, dc] and q_pe [n, h, dr], any row/head strides (last dim dense);
 * kv [pages, P, D = dc + dr] (one layer of the pool); out [n, h, dc]; lse [n, h] (acc type)
 * or NULL. A row that sees no key gets out 0 and lse -inf.
 *
 * FP8 caches (the *_fp8 entry points; splash/kv/codec.py writes the rows): kv is bytes [pages, P, rb],
 * fmt 1 (fp8_e4m3): D FP8 e4m3 values times one per-layer scale; fmt 2 (fp8_ds_mla): dc FP8 values, a
 * float32 scale per 128 of them, then dr BF16 values. Each key row is dequantised as it is loaded, into
 * the same buffer the plain kernels convert bf16 into: nothing else of the pool is ever decoded.
 * A BF16 cache under float32/float64 queries (--kv-cache-dtype bfloat16, *_bf16kv, fmt 3) loads alike.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_formats.h"

#define SERIAL_WORK (1 << 18) /* multiply-adds of a call below which it runs on one thread */

static inline bf16 f_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                      /* round to nearest even */
    return (bf16)(u >> 16);
}

/* the first n (D or dc: never fewer than dc) values of one FP8 key row (fmt 1 or 2, above) into dst, in
 * type A (float or double) */
#define FP8_ROW(NAME, A, RUN, TILES, BF16_RUN)                                                          \
    static inline void NAME(const uint8_t *row, int64_t n, int64_t dc, int fmt, double tscale, A *dst) { \
        if (fmt == 1) {                                                                                 \
            RUN(row, n, (A)tscale, dst);                                                                \
            return;                                                                                     \
        }                                                                                               \
        TILES(row, dc, dst);                                                                            \
        if (n > dc) BF16_RUN(row + dc + 4 * ((dc + 127) / 128), n - dc, dst + dc);                      \
    }
FP8_ROW(fp8_row_f, float, fp8_run_f, fp8_tiles_f, bf16_run_f)
FP8_ROW(fp8_row_d, double, fp8_run_d, fp8_tiles_d, bf16_run_d)

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
/* bf16 with AVX512-BF16: both passes as dot products of bf16 pairs (vdpbf16ps) with float sums.
 * Pass 1: scores of 4 heads x 4 keys per block (16 accumulators over D, D % 32 == 0).
 * Pass 2: out[j][d] = sum_k p[j][k] * c_kv[k][d] over pairs of keys: each pair of keys is interleaved
 * once per 16 dims and reused by 8 heads, whose accumulators stay in registers (dc % 16 == 0).
 * The probabilities are normalised, then rounded to bf16, as the torch path (softmax -> bf16 -> bmm). */
static void bf16_fast_unit(const bf16 *q, const bf16 *kv, const int64_t *tbl, int64_t pos, int64_t h0,
                           int64_t hh, int64_t D, int64_t dc, int64_t P, float scale, bf16 *out,
                           float *lse, float *work, int64_t *slots) {
    const int64_t m = pos + 1;
    int64_t cnt = 0;
    const int64_t npages = (m + P - 1) / P;
    for (int64_t pg = 0; pg < npages; pg++) {
        const int64_t id = tbl[pg];
        if (id < 0) continue;
        const int64_t nk = (pg == npages - 1) ? m - pg * P : P;
        for (int64_t t = 0; t < nk; t++) slots[cnt++] = id * P + t;
    }
    bf16 *o = out + h0 * dc;
    if (cnt == 0) {
        memset(o, 0, sizeof(bf16) * hh * dc);
        if (lse)
            for (int64_t j = 0; j < hh; j++) lse[h0 + j] = -INFINITY;
        return;
    }
    float *s = work; /* [hh, cnt] */
    const bf16 *qh = q; /* the unit's heads, [hh, D] */
    for (int64_t c = 0; c < cnt; c += 4) {
        const bf16 *k[4];
        for (int u = 0; u < 4; u++) k[u] = kv + slots[c + u < cnt ? c + u : c] * D;
        for (int64_t j = 0; j < hh; j += 4) {
            const bf16 *qq[4];
            for (int i = 0; i < 4; i++) qq[i] = qh + (j + i < hh ? j + i : j) * D;
            __m512 a[4][4];
            for (int i = 0; i < 4; i++)
                for (int u = 0; u < 4; u++) a[i][u] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32) {
                __m512bh kk[4], qv[4];
                for (int u = 0; u < 4; u++) kk[u] = (__m512bh)_mm512_loadu_si512((const void *)(k[u] + d));
                for (int i = 0; i < 4; i++) qv[i] = (__m512bh)_mm512_loadu_si512((const void *)(qq[i] + d));
                for (int i = 0; i < 4; i++)
                    for (int u = 0; u < 4; u++) a[i][u] = _mm512_dpbf16_ps(a[i][u], qv[i], kk[u]);
            }
            for (int i = 0; i < 4 && j + i < hh; i++)
                for (int u = 0; u < 4 && c + u < cnt; u++) s[(j + i) * cnt + c + u] = _mm512_reduce_add_ps(a[i][u]) * scale;
        }
    }
    const int64_t npairs = (cnt + 1) / 2;
    uint32_t *pp = (uint32_t *)(s + hh * cnt); /* [hh, npairs] bf16 pairs of probabilities */
    for (int64_t j = 0; j < hh; j++) {
        float *sj = s + j * cnt, mx = -INFINITY, tot = 0;
        for (int64_t c = 0; c < cnt; c++) mx = sj[c] > mx ? sj[c] : mx;
        for (int64_t c = 0; c < cnt; c++) {
            sj[c] = expf(sj[c] - mx);
            tot += sj[c];
        }
        const float inv = 1.0f / tot;
        for (int64_t c = 0; c < npairs; c++) {
            const uint32_t lo = f_to_bf16(sj[2 * c] * inv);
            const uint32_t hi = 2 * c + 1 < cnt ? f_to_bf16(sj[2 * c + 1] * inv) : 0;
            pp[j * npairs + c] = lo | (hi << 16);
        }
        if (lse) lse[h0 + j] = mx + logf(tot);
    }
    const __m512i inter = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                           38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    /* keys in blocks that stay in cache while every 16-dim chunk of every head passes over them */
    float *acc = (float *)(pp + hh * npairs); /* [hh, dc] */
    memset(acc, 0, sizeof(float) * hh * dc);
    for (int64_t c0 = 0; c0 < npairs; c0 += 32) {
        const int64_t c1 = c0 + 32 < npairs ? c0 + 32 : npairs;
        for (int64_t d = 0; d < dc; d += 16) {
            for (int64_t j = 0; j < hh; j += 8) {
                __m512 a[8];
                const uint32_t *pj[8];
                for (int i = 0; i < 8; i++) {
                    a[i] = j + i < hh ? _mm512_loadu_ps(acc + (j + i) * dc + d) : _mm512_setzero_ps();
                    pj[i] = pp + (j + i < hh ? j + i : j) * npairs;
                }
                for (int64_t c = c0; c < c1; c++) {
                    const __m256i k0 = _mm256_loadu_si256((const void *)(kv + slots[2 * c] * D + d));
                    const __m256i k1 = 2 * c + 1 < cnt
                        ? _mm256_loadu_si256((const void *)(kv + slots[2 * c + 1] * D + d))
                        : _mm256_setzero_si256();
                    const __m512bh kp = (__m512bh)_mm512_permutex2var_epi16(
                        _mm512_castsi256_si512(k0), inter, _mm512_castsi256_si512(k1));
                    for (int i = 0; i < 8; i++)
                        a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32((int)pj[i][c]), kp);
                }
                for (int i = 0; i < 8 && j + i < hh; i++) _mm512_storeu_ps(acc + (j + i) * dc + d, a[i]);
            }
        }
    }
    for (int64_t j = 0; j < hh; j++)
        for (int64_t d = 0; d < dc; d += 16)
            _mm256_storeu_si256((void *)(o + j * dc + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + j * dc + d)));
}
#define BF16_FAST 1
#else
#define BF16_FAST 0
#endif

#define HB 16 /* heads per unit at most (scores of HB heads share each key load) */

/* DEFINE(name, T, KT, A, LOAD, STORE, FAST, KROW): T query/output type, KT key storage type (T, or bytes of
 * an FP8 cache), A accumulation type; KROW(k, n, dst): the first n values of key row k into dst (A). */
#define PLAIN_ROW(k, n, dst)                                                                            \
    for (int64_t d_ = 0; d_ < (n); d_++) (dst)[d_] = LOAD((k)[d_])
#define DEFINE(NAME, T, KT, A, LOAD, STORE, FAST, KROW)                                                  \
    static void NAME##_unit(const T *q, const KT *kv, const int64_t *tbl, int64_t pos, int64_t h0,       \
                            int64_t hh, int64_t h, int64_t D, int64_t dc, int64_t P, A scale, T *out,    \
                            A *lse, A *work, int64_t *slots, int64_t rb, int fmt, double tscale) {      \
        const int64_t m = pos + 1; /* keys at positions 0..pos, those on held pages visible */           \
        A *qf = work;              /* [hh, D] */                                                        \
        A *acc = qf + hh * D;      /* [hh, dc] */                                                       \
        A *kf = acc + hh * dc;     /* [4, D] converted keys */                                           \
        A *s = kf + 4 * D;         /* [hh, m] scores, then probabilities */                             \
        for (int64_t j = 0; j < hh; j++)                                                                \
            for (int64_t d = 0; d < D; d++) qf[j * D + d] = LOAD(q[j * D + d]);                        \
        A mx[HB], sum[HB];                                                                              \
        for (int64_t j = 0; j < hh; j++) mx[j] = -INFINITY;                                             \
        int64_t cnt = 0; /* visible keys, in position order */                                         \
        const int64_t npages = (m + P - 1) / P;                                                         \
        for (int64_t pg = 0; pg < npages; pg++) {                                                       \
            const int64_t id = tbl[pg];                                                                 \
            if (id < 0) continue;                                                                       \
            const int64_t nk = (pg == npages - 1) ? m - pg * P : P;                                     \
            for (int64_t t = 0; t < nk; t++) {                                                          \
                const KT *k = kv + (id * P + t) * rb;                                                   \
                slots[cnt] = id * P + t;                                                                \
                KROW(k, D, kf);                                                                         \
                int64_t j = 0;                                                                          \
                for (; j + 4 <= hh; j += 4) {                                                           \
                    const A *q0 = qf + j * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;                  \
                    A a0 = 0, a1 = 0, a2 = 0, a3 = 0;                                                   \
                    _Pragma("omp simd reduction(+ : a0, a1, a2, a3)") for (int64_t d = 0; d < D; d++) { \
                        const A x = kf[d];                                                              \
                        a0 += q0[d] * x;                                                                \
                        a1 += q1[d] * x;                                                                \
                        a2 += q2[d] * x;                                                                \
                        a3 += q3[d] * x;                                                                \
                    }                                                                                   \
                    s[j * m + cnt] = a0 * scale;                                                        \
                    s[(j + 1) * m + cnt] = a1 * scale;                                                  \
                    s[(j + 2) * m + cnt] = a2 * scale;                                                  \
                    s[(j + 3) * m + cnt] = a3 * scale;                                                  \
                }                                                                                       \
                for (; j < hh; j++) {                                                                   \
                    const A *q0 = qf + j * D;                                                           \
                    A a0 = 0;                                                                           \
                    _Pragma("omp simd reduction(+ : a0)") for (int64_t d = 0; d < D; d++) a0 +=         \
                        q0[d] * kf[d];                                                                  \
                    s[j * m + cnt] = a0 * scale;                                                        \
                }                                                                                       \
                for (j = 0; j < hh; j++)                                                                \
                    if (s[j * m + cnt] > mx[j]) mx[j] = s[j * m + cnt];                                 \
                cnt++;                                                                                  \
            }                                                                                           \
        }                                                                                               \
        T *o = out + h0 * dc;                                                                           \
        if (cnt == 0) {                                                                                 \
            for (int64_t j = 0; j < hh * dc; j++) o[j] = STORE((A)0);                                   \
            if (lse)                                                                                    \
                for (int64_t j = 0; j < hh; j++) lse[h0 + j] = -INFINITY;                               \
            return;                                                                                     \
        }                                                                                               \
        for (int64_t j = 0; j < hh; j++) {                                                              \
            A *sj = s + j * m, tot = 0, mj = mx[j];                                                     \
            for (int64_t c = 0; c < cnt; c++) {                                                         \
                sj[c] = (A)exp(sj[c] - mj);                                                             \
                tot += sj[c];                                                                           \
            }                                                                                           \
            sum[j] = tot;                                                                               \
        }                                                                                               \
        memset(acc, 0, sizeof(A) * hh * dc);                                                            \
        for (int64_t c = 0; c < cnt; c += 4) {                                                          \
            const int64_t g = cnt - c < 4 ? cnt - c : 4;                                                \
            for (int64_t u = 0; u < 4; u++) {                                                           \
                if (u < g) {                                                                            \
                    const KT *k = kv + slots[c + u] * rb;                                               \
                    KROW(k, dc, kf + u * D);                                                            \
                } else {                                                                                \
                    for (int64_t d = 0; d < dc; d++) kf[u * D + d] = (A)0;                              \
                }                                                                                       \
            }                                                                                           \
            const A *k0 = kf, *k1 = kf + D, *k2 = kf + 2 * D, *k3 = kf + 3 * D;                         \
            for (int64_t j = 0; j < hh; j++) {                                                          \
                const A *sj = s + j * m + c;                                                            \
                const A p0 = sj[0], p1 = g > 1 ? sj[1] : 0, p2 = g > 2 ? sj[2] : 0, p3 = g > 3 ? sj[3] : 0; \
                A *aj = acc + j * dc;                                                                   \
                _Pragma("omp simd") for (int64_t d = 0; d < dc; d++) aj[d] +=                           \
                    p0 * k0[d] + p1 * k1[d] + p2 * k2[d] + p3 * k3[d];                                  \
            }                                                                                           \
        }                                                                                               \
        for (int64_t j = 0; j < hh; j++) {                                                              \
            const A inv = (A)1 / sum[j];                                                                \
            for (int64_t d = 0; d < dc; d++) o[j * dc + d] = STORE(acc[j * dc + d] * inv);              \
            if (lse) lse[h0 + j] = mx[j] + (A)log(sum[j]);                                              \
        }                                                                                               \
    }                                                                                                   \
                                                                                                        \
    int NAME(const T *ql, int64_t ql_n, int64_t ql_h, const T *qp, int64_t qp_n, int64_t qp_h,            \
             const KT *kv, const int64_t *tables, int64_t tstride, const int64_t *row_seq,                \
             const int64_t *row_pos, int64_t n, int64_t h, int64_t dc, int64_t dr, int64_t P, double scale, \
             T *out, A *lse, int64_t nthreads, int64_t rb, int64_t fmt, double tscale) {                \
        const int64_t D = dc + dr;                                                                      \
        if (n <= 0) return 0;                                                                           \
        if (rb <= 0) rb = D;                                                                            \
        fp8_lut_init();                                                                                 \
        int64_t maxpos = 0;                                                                             \
        for (int64_t r = 0; r < n; r++)                                                                 \
            if (row_pos[r] > maxpos) maxpos = row_pos[r];                                               \
        /* split the heads when there are too few rows to keep every thread busy */                     \
        int64_t split = (h + HB - 1) / HB;                                                              \
        while (n * split < 2 * nthreads && split < h) split++;                                          \
        const int64_t per = (h + split - 1) / split;                                                    \
        split = (h + per - 1) / per;                                                                    \
        const int64_t units = n * split;                                                                \
        const size_t words = (size_t)(2 * per * D + 2 * per * dc + 4 * D + 2 * per * (maxpos + 3));          \
        int err = 0;                                                                                    \
        /* a few rows over short contexts: one thread (a fork/join costs more than the work) */          \
        const int serial = n * h * (maxpos + 1) * D < SERIAL_WORK;                                      \
        _Pragma("omp parallel num_threads(nthreads) if (!serial)") {                                    \
            A *work = (A *)malloc(sizeof(A) * words);                                                   \
            int64_t *slots = (int64_t *)malloc(sizeof(int64_t) * (size_t)(maxpos + 1));                 \
            T *qbuf = (T *)malloc(sizeof(T) * (size_t)(per * D));                                       \
            if (!work || !slots || !qbuf) {                                                                                \
                _Pragma("omp atomic write") err = 1;                                                    \
            }                                                                                           \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t u = 0; u < units; u++) {               \
                if (!work || !slots || !qbuf) continue;                                                                    \
                const int64_t r = u / split, h0 = (u % split) * per;                                    \
                const int64_t hh = h0 + per <= h ? per : h - h0;                                        \
                for (int64_t j = 0; j < hh; j++) { /* the unit's queries, [hh, dc + dr] contiguous */    \
                    memcpy(qbuf + j * D, ql + r * ql_n + (h0 + j) * ql_h, sizeof(T) * (size_t)dc);       \
                    memcpy(qbuf + j * D + dc, qp + r * qp_n + (h0 + j) * qp_h, sizeof(T) * (size_t)dr);  \
                }                                                                                       \
                if (FAST && fmt == 0)                                                                   \
                    FAST_CALL(qbuf, kv, tables + row_seq[r] * tstride, row_pos[r], h0, hh, D, dc, \
                              P, scale, out + r * h * dc, lse ? lse + r * h : NULL, work, slots);         \
                else                                                                                    \
                    NAME##_unit(qbuf, kv, tables + row_seq[r] * tstride, row_pos[r], h0, hh, h,  \
                                D, dc, P, (A)scale, out + r * h * dc, lse ? lse + r * h : NULL, work, slots, \
                                rb, (int)fmt, tscale);                                                  \
            }                                                                                           \
            free(work);                                                                                 \
            free(slots);                                                                                \
            free(qbuf);                                                                                 \
        }                                                                                               \
        return err;                                                                                     \
    }

#define ID(x) (x)
#if BF16_FAST
#define FAST_CALL(q, kv, t, pos, h0, hh, D, dc, P, sc, out, lse, work, slots) \
    bf16_fast_unit((const bf16 *)(q), (const bf16 *)(kv), t, pos, h0, hh, D, dc, P, (float)(sc), (bf16 *)(out), \
                   (float *)(lse), (float *)(work), slots)
#define BF16_OK (D % 32 == 0 && dc % 16 == 0)
#else
#define FAST_CALL(...) ((void)0)
#define BF16_OK 0
#endif
#define FP8_F(k, n, dst) fp8_row_f((k), (n), dc, fmt, tscale, (dst))
#define FP8_D(k, n, dst) fp8_row_d((k), (n), dc, fmt, tscale, (dst))
#define LOAD ID
DEFINE(mla_paged_f64, double, double, double, ID, ID, 0, PLAIN_ROW)
DEFINE(mla_paged_f32, float, float, float, ID, ID, 0, PLAIN_ROW)
DEFINE(mla_paged_f64_fp8, double, uint8_t, double, ID, ID, 0, FP8_D)
DEFINE(mla_paged_f32_fp8, float, uint8_t, float, ID, ID, 0, FP8_F)
#define BF16KV_F(k, n, dst) bf16_run_f((const uint8_t *)(k), (n), (dst))
#define BF16KV_D(k, n, dst) bf16_run_d((const uint8_t *)(k), (n), (dst))
DEFINE(mla_paged_f64_bf16kv, double, bf16, double, ID, ID, 0, BF16KV_D)
DEFINE(mla_paged_f32_bf16kv, float, bf16, float, ID, ID, 0, BF16KV_F)
#undef LOAD
#define LOAD bf16_to_f
DEFINE(mla_paged_bf16, bf16, bf16, float, bf16_to_f, f_to_bf16, BF16_OK, PLAIN_ROW)
DEFINE(mla_paged_bf16_fp8, bf16, uint8_t, float, bf16_to_f, f_to_bf16, 0, FP8_F)
#undef LOAD
