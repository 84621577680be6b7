/* Products of a few bf16 rows with a weight, for CPU decode steps (splash/model/gemm.py).
 *
 * A batch-1 decode step is mostly matrix-vector products; torch runs a bf16 [1, k] x [k, n] at 3-10 GB/s
 * of weights on the development hosts (no bf16 GEMV of its own, `mv`/`addmv` through a generic loop),
 * where reading the weight once is the whole cost. These loops read each weight element once per call
 * for all m <= 8 rows, in float sums, and round each output to bf16 once, as torch does.
 *
 * gemv_bf16: y[r, j] = sum_i x[r, i] W[j, i]       (a linear layer: W [n, k], rows ldw apart)
 * heads_bf16: y[r, h, c] = sum_i x[r, h, i] W[h, i, c]  (MLA's per-head W_UK / W_UV: W [H, a, b] dense)
 * Threads: OpenMP over blocks of outputs (the process's libgomp, as mla_paged.c); one below SMALL.
 * With AVX512-BF16 the dot products run on bf16 pairs (vdpbf16ps); elsewhere bf16 is widened on load and
 * the compiler vectorises the float loops. Both return 1 for m > 8 (the caller keeps torch's GEMM). */
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;
#define MAX_ROWS 8

static inline float b2f(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f2b(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 64);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#define JB 4 /* weight rows per block of gemv_bf16 */
#define SMALL (1 << 15) /* weight elements below which a call runs on one thread (no fork/join) */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
/* R rows of x against JB rows of W: JB x R accumulators of 16 floats over k (masked tail). Out-of-range
 * weight rows repeat the last one (their sums are dropped). */
#define DOT_BLOCK(R)                                                                                     \
    static void dot_block_##R(const bf16 *W, int64_t j0, int64_t jn, int64_t k, int64_t ldw,            \
                              const bf16 *x, int64_t ldx, bf16 *y, int64_t ldy) {                        \
        const bf16 *w[JB];                                                                               \
        for (int jj = 0; jj < JB; jj++) w[jj] = W + (j0 + (jj < jn ? jj : jn - 1)) * ldw;              \
        __m512 a[JB][R];                                                                                 \
        for (int jj = 0; jj < JB; jj++)                                                                  \
            for (int r = 0; r < R; r++) a[jj][r] = _mm512_setzero_ps();                                  \
        for (int64_t d = 0; d < k; d += 32) {                                                            \
            const __mmask32 mk = k - d >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (k - d)) - 1u);      \
            __m512bh xv[R];                                                                              \
            for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mk, x + r * ldx + d); \
            for (int jj = 0; jj < JB; jj++) {                                                            \
                const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mk, w[jj] + d);                   \
                for (int r = 0; r < R; r++) a[jj][r] = _mm512_dpbf16_ps(a[jj][r], wv, xv[r]);           \
            }                                                                                            \
        }                                                                                                \
        for (int jj = 0; jj < jn; jj++)                                                                  \
            for (int r = 0; r < R; r++) y[r * ldy + j0 + jj] = f2b(_mm512_reduce_add_ps(a[jj][r]));     \
    }
DOT_BLOCK(1)
DOT_BLOCK(2)
DOT_BLOCK(4)

static void gemv_block(const bf16 *W, int64_t j0, int64_t jn, int64_t k, int64_t ldw, const bf16 *x,
                       int64_t m, int64_t ldx, bf16 *y, int64_t ldy) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) dot_block_4(W, j0, jn, k, ldw, x + r * ldx, ldx, y + r * ldy, ldy);
    for (; r + 2 <= m; r += 2) dot_block_2(W, j0, jn, k, ldw, x + r * ldx, ldx, y + r * ldy, ldy);
    for (; r < m; r++) dot_block_1(W, j0, jn, k, ldw, x + r * ldx, ldx, y + r * ldy, ldy);
}
#else
static void gemv_block(const bf16 *W, int64_t j0, int64_t jn, int64_t k, int64_t ldw, const bf16 *x,
                       int64_t m, int64_t ldx, bf16 *y, int64_t ldy) {
    float wf[k > 0 ? k : 1];
    for (int64_t j = j0; j < j0 + jn; j++) {
        const bf16 *w = W + j * ldw;
        for (int64_t i = 0; i < k; i++) wf[i] = b2f(w[i]);
        for (int64_t r = 0; r < m; r++) {
            const bf16 *xr = x + r * ldx;
            float a = 0;
            _Pragma("omp simd reduction(+ : a)") for (int64_t i = 0; i < k; i++) a += wf[i] * b2f(xr[i]);
            y[r * ldy + j] = f2b(a);
        }
    }
}
#endif

int gemv_bf16(const bf16 *W, int64_t n, int64_t k, int64_t ldw, const bf16 *x, int64_t m, int64_t ldx,
              bf16 *y, int64_t ldy, int64_t nthreads) {
    if (m > MAX_ROWS || m < 1) return 1;
    const int64_t units = (n + JB - 1) / JB;
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (n * k >= SMALL)")
    for (int64_t u = 0; u < units; u++) {
        const int64_t j0 = u * JB;
        gemv_block(W, j0, n - j0 < JB ? n - j0 : JB, k, ldw, x, m, ldx, y, ldy);
    }
    return 0;
}

#define CB 128 /* output columns per block of heads_bf16 */

int heads_bf16(const bf16 *x, int64_t xr, int64_t xh, const bf16 *W, int64_t h, int64_t a, int64_t b,
               int64_t m, bf16 *y, int64_t yr, int64_t yh, int64_t nthreads) {
    if (m > MAX_ROWS || m < 1) return 1;
    const int64_t nb = (b + CB - 1) / CB;
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (h * a * b >= SMALL)")
    for (int64_t u = 0; u < h * nb; u++) {
        const int64_t hd = u / nb, c0 = (u % nb) * CB, cn = b - c0 < CB ? b - c0 : CB;
        float acc[MAX_ROWS][CB], wf[CB];
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < CB; c++) acc[r][c] = 0;
        for (int64_t i = 0; i < a; i++) {
            const bf16 *w = W + (hd * a + i) * b + c0;
            if (m == 1) {
                const float xv = b2f(x[hd * xh + i]);
                _Pragma("omp simd") for (int64_t c = 0; c < cn; c++) acc[0][c] += xv * b2f(w[c]);
                continue;
            }
            _Pragma("omp simd") for (int64_t c = 0; c < cn; c++) wf[c] = b2f(w[c]);
            for (int64_t r = 0; r < m; r++) {
                const float xv = b2f(x[r * xr + hd * xh + i]);
                float *ar = acc[r];
                _Pragma("omp simd") for (int64_t c = 0; c < cn; c++) ar[c] += xv * wf[c];
            }
        }
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < cn; c++) y[r * yr + hd * yh + c0 + c] = f2b(acc[r][c]);
    }
    return 0;
}
