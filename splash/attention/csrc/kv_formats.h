/* Element formats of the KV cache as the CPU kernels read them (splash/kv/codec.py writes them; the
 * table is splash/core/stores.py's `store_parts`). Included by mla_paged.c and dsa_index.c after the
 * C headers (math, stdint, string); `bf16` and `bf16_to_f` are theirs from here.
 *
 * FP8 e4m3 ("fn": no infinities, 0x7f / 0xff NaN) values are converted exactly (every FP8 value is a
 * float) and multiplied by their scale: 8 at a time with AVX2 (a normal value's exponent and mantissa
 * moved into float32's fields, bias 7 -> 127; a subnormal is m x 2^-9), the rest through a table. */
#ifndef SPLASH_KV_FORMATS_H
#define SPLASH_KV_FORMATS_H
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef uint16_t bf16;

/* a BF16 value as float: its 16 bits are a float's top half (exact) */
static inline float bf16_to_f(bf16 v) {
    uint32_t u = ((uint32_t)v) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float fp8_lut[256];
static int fp8_lut_ready = 0;
static void fp8_lut_init(void) {
    if (fp8_lut_ready) return;
    for (int v = 0; v < 256; v++) {
        const int sgn = v >> 7, e = (v >> 3) & 15, m = v & 7;
        float f;
        if (e == 15 && m == 7) f = NAN;
        else if (e == 0) f = ldexpf((float)m, -9);
        else f = ldexpf((float)(8 + m), e - 10);
        fp8_lut[v] = sgn ? -f : f;
    }
    fp8_lut_ready = 1;
}

/* n FP8 values times `scale` into float dst: 8 at a time with AVX2 (a normal value's exponent and
 * mantissa moved into float32's fields, bias 7 -> 127; a subnormal is m x 2^-9; 0x7f / 0xff NaN), exact:
 * the table's values. The rest through the table. */
static inline void fp8_run_f(const uint8_t *src, int64_t n, float scale, float *dst) {
    int64_t d = 0;
#if defined(__AVX2__)
    const __m256i m7f = _mm256_set1_epi32(0x7f), m80 = _mm256_set1_epi32(0x80), m7 = _mm256_set1_epi32(7);
    const __m256i bias = _mm256_set1_epi32(120 << 23), zero = _mm256_setzero_si256();
    const __m256 tiny = _mm256_set1_ps(0x1p-9f), nan = _mm256_set1_ps(NAN), sc = _mm256_set1_ps(scale);
    for (; d + 8 <= n; d += 8) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + d)));
        const __m256i mag = _mm256_and_si256(v, m7f);
        const __m256 norm = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), bias));
        const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(mag, m7)), tiny);
        const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_srli_epi32(mag, 3), zero));
        __m256 f = _mm256_blendv_ps(norm, sub, is_sub);
        f = _mm256_blendv_ps(f, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, m7f)));
        f = _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(v, m80), 24)));
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(f, sc));
    }
#endif
    for (; d < n; d++) dst[d] = fp8_lut[src[d]] * scale;
}

/* n BF16 values at a byte address (any alignment) into float / double dst */
static inline void bf16_run_f(const uint8_t *src, int64_t n, float *dst) {
    int64_t d = 0;
#if defined(__AVX2__)
    for (; d + 8 <= n; d += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * d)));
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
#endif
    for (; d < n; d++) {
        bf16 b;
        memcpy(&b, src + 2 * d, 2);
        dst[d] = bf16_to_f(b);
    }
}

static inline void bf16_run_d(const uint8_t *src, int64_t n, double *dst) {
    for (int64_t d = 0; d < n; d++) {
        bf16 b;
        memcpy(&b, src + 2 * d, 2);
        dst[d] = (double)bf16_to_f(b);
    }
}

static inline void fp8_run_d(const uint8_t *src, int64_t n, double scale, double *dst) {
    for (int64_t d = 0; d < n; d++) dst[d] = (double)fp8_lut[src[d]] * scale;
}


/* the values of an FP8 row of d values followed by a float32 scale per 128 (the indexer's keys, the
 * fp8_ds_mla latent's d_c) into float dst */
static inline void fp8_tiles_f(const uint8_t *row, int64_t d, float *dst) {
    for (int64_t d0 = 0; d0 < d; d0 += 128) {
        float sc;
        memcpy(&sc, row + d + 4 * (d0 / 128), 4);
        fp8_run_f(row + d0, (d - d0 < 128 ? d - d0 : 128), sc, dst + d0);
    }
}

static inline void fp8_tiles_d(const uint8_t *row, int64_t d, double *dst) {
    for (int64_t d0 = 0; d0 < d; d0 += 128) {
        float sc;
        memcpy(&sc, row + d + 4 * (d0 / 128), 4);
        fp8_run_d(row + d0, (d - d0 < 128 ? d - d0 : 128), (double)sc, dst + d0);
    }
}
#endif
