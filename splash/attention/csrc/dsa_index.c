/* The DSA lightning indexer's top-k straight over the paged index-key cache, for CPU ranks.
 *
 * Row r (query rows[r] of q [N, H, d] / w [N, H], position positions[rows[r]]) scores every key that
 * its request's page table (tables[row_seq[r]], W entries, -1 = page not held here) holds at
 * positions <= its own:  I[s] = sum_h w[h] * ReLU(q[h] . key[s]),  and keeps the k best by (score
 * descending, position ascending) - exactly sparse.top_keys' rule, ReLU's exact zero ties going to the
 * earlier key. Out per row, k each: the selected keys' scores, global positions (page j of the table
 * holds positions [j*P, (j+1)*P)) and local slots (page id * P + offset), IN POSITION ORDER, then
 * -inf / -1 / -1 padding when the row sees fewer than k keys.
 *
 * Row and table indices and page ids are checked (return 2 when out of range; 1: out of memory).
 *
 * Nothing is gathered: keys are read where they lie in the pool [pages * P, d]. Scores are in the
 * score type A (float, or double for double models) with the keys converted on load (bf16 -> float;
 * an FP8 cache's row [d FP8 e4m3 bytes, a float32 scale per 128] -> value x its group's scale, exact, as
 * DeepSeek's fp8 index applies the key scale: a power of two commutes with ReLU and the weighted sum);
 * the dot products are a small GEMM per (row, block of keys), vectors across heads (queries
 * transposed to [d, H]), so no per-head horizontal sums. Each score is stored as an order-preserving
 * unsigned key; the k-th best is found by a radix select (O(m), exact ties counted; a long row's only
 * among the keys in a band guessed from a sample), then one scan in position order emits the keys above
 * it and the earliest of those equal to it.
 *
 * Work: consecutive rows with the same table form a group (one request: its keys are walked once per
 * block of RB rows, each key block reused by every row of the block); a group's key range is cut into
 * chunks so that even one decode row with a long context spreads over every thread. Scoring items
 * (row block, key chunk) then selections (one row each) run as two OpenMP loops, in waves that bound
 * the score buffer (`budget` entries, unless one block alone needs more). Threads: OpenMP, sharing
 * torch's libgomp pool as mla_paged.c does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_formats.h"

#ifndef VBYTES /* vector bytes (tests build other widths; GCC splits wider ones into native vectors) */
#if defined(__AVX512F__)
#define VBYTES 64
#else
#define VBYTES 32
#endif
#endif
typedef float vf __attribute__((vector_size(VBYTES)));
typedef int32_t vfi __attribute__((vector_size(VBYTES)));
typedef double vd __attribute__((vector_size(VBYTES)));
typedef int64_t vdi __attribute__((vector_size(VBYTES)));

/* Order-preserving unsigned keys of scores (larger score, larger key; -0 is made +0 first, so the two
 * zeros tie as they compare equal in torch). */
static inline uint32_t key_f(float s) {
    uint32_t u;
    s += 0.0f;
    memcpy(&u, &s, 4);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}
static inline float unkey_f(uint32_t u) {
    u = (u & 0x80000000u) ? u & 0x7fffffffu : ~u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint64_t key_d(double s) {
    uint64_t u;
    s += 0.0;
    memcpy(&u, &s, 8);
    return (u >> 63) ? ~u : u | (1ull << 63);
}
static inline double unkey_d(uint64_t u) {
    u = (u >> 63) ? u & ~(1ull << 63) : ~u;
    double f;
    memcpy(&f, &u, 8);
    return f;
}

#define RB 4        /* rows of one request scored together (each key block read once for all) */
#define NR 10       /* keys per register block */
#define MINCH 512   /* keys per scoring item at least */
#define MAXCH 8192  /* ... and at most */
#define SAMPLE 512  /* scores sampled to guess the k-th (rows of 16 * SAMPLE keys or more) */

typedef struct {
    int64_t pg, id, start; /* a held page: global page index, local page id, its first key's index */
} run_t;

typedef struct {
    int64_t g, r0, r1; /* rows [r0, r1) of group g */
} block_t;

typedef struct {
    int64_t b, c0, c1; /* keys [c0, c1) of block b */
} item_t;

/* The first run holding key index i (runs[e].start <= i < runs[e + 1].start; a sentinel ends them). */
static int64_t find_run(const run_t *runs, int64_t nruns, int64_t i) {
    int64_t lo = 0, hi = nruns - 1; /* answer in [lo, hi] */
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (runs[mid].start <= i)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The pages a group's table is walked over: those up to its rows' last position (at most W); *mx: that
 * position (-1: no row has one). */
static int64_t group_pages(const int64_t *positions, const int64_t *rows, int64_t r0, int64_t r1, int64_t P,
                           int64_t W, int64_t *mx) {
    int64_t m = -1;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t p = positions[rows ? rows[r] : r];
        if (p > m) m = p;
    }
    *mx = m;
    return m < 0 ? 0 : (m / P + 1 < W ? m / P + 1 : W);
}

/* DEFINE(NAME, T, A, V, VI, U, UBITS, CONV, KEY, UNKEY, ROW, KROW): T pool type, A score type, V / VI
 * its vector / same-width integer vector, U the score key type of UBITS bits; CONV: keys are converted
 * into a buffer first (T != A) by KROW(row, d, dst); ROW(d): T elements per key row. */
#define DEFINE(NAME, T, A, V, VI, U, UBITS, CONV, KEY, UNKEY, ROW, KROW)                                             \
    enum { NAME##_L = (int)(sizeof(V) / sizeof(A)) };                                                        \
                                                                                                             \
    /* scores of NR keys against one row: qt [d, Hp] (heads padded with zero weights), wp [Hp] */           \
    static inline void NAME##_micro1(const A *qt, const A *wp, int64_t Hp, int64_t d, const A *const *kp,   \
                                     A *sc) {                                                                \
        V tot[NR];                                                                                           \
        for (int j = 0; j < NR; j++) tot[j] = (V){0};                                                        \
        for (int64_t h = 0; h < Hp; h += NAME##_L) {                                                         \
            V acc[NR];                                                                                       \
            for (int j = 0; j < NR; j++) acc[j] = (V){0};                                                    \
            const A *qp = qt + h;                                                                            \
            for (int64_t dd = 0; dd < d; dd++) {                                                             \
                V qa;                                                                                        \
                memcpy(&qa, qp + dd * Hp, sizeof(V));                                                        \
                for (int j = 0; j < NR; j++) acc[j] += qa * kp[j][dd];                                       \
            }                                                                                                \
            V wv;                                                                                            \
            memcpy(&wv, wp + h, sizeof(V));                                                                  \
            const V z = {0};                                                                                 \
            for (int j = 0; j < NR; j++) tot[j] += wv * (V)((VI)acc[j] & (VI)(acc[j] > z));                  \
        }                                                                                                    \
        for (int j = 0; j < NR; j++) {                                                                       \
            A s = 0;                                                                                         \
            for (int l = 0; l < NAME##_L; l++) s += tot[j][l];                                               \
            sc[j] = s;                                                                                       \
        }                                                                                                    \
    }                                                                                                        \
                                                                                                             \
    /* the same with two head vectors per pass (6 keys x 2 vectors of accumulators) */                       \
    static inline void NAME##_micro2(const A *qt, const A *wp, int64_t Hp, int64_t d, const A *const *kp,   \
                                     A *sc) {                                                                \
        enum { K2 = NR / 2 };                                                                                \
        V tot[K2];                                                                                           \
        for (int j = 0; j < K2; j++) tot[j] = (V){0};                                                        \
        for (int64_t h = 0; h < Hp; h += 2 * NAME##_L) {                                                     \
            V a0[K2], a1[K2];                                                                                \
            for (int j = 0; j < K2; j++) a0[j] = a1[j] = (V){0};                                             \
            const A *qp = qt + h;                                                                            \
            for (int64_t dd = 0; dd < d; dd++) {                                                             \
                V q0, q1;                                                                                    \
                memcpy(&q0, qp + dd * Hp, sizeof(V));                                                        \
                memcpy(&q1, qp + dd * Hp + NAME##_L, sizeof(V));                                             \
                for (int j = 0; j < K2; j++) {                                                               \
                    const A x = kp[j][dd];                                                                   \
                    a0[j] += q0 * x;                                                                         \
                    a1[j] += q1 * x;                                                                         \
                }                                                                                            \
            }                                                                                                \
            V w0, w1;                                                                                        \
            memcpy(&w0, wp + h, sizeof(V));                                                                  \
            memcpy(&w1, wp + h + NAME##_L, sizeof(V));                                                       \
            const V z = {0};                                                                                 \
            for (int j = 0; j < K2; j++) {                                                                   \
                tot[j] += w0 * (V)((VI)a0[j] & (VI)(a0[j] > z));                                             \
                tot[j] += w1 * (V)((VI)a1[j] & (VI)(a1[j] > z));                                             \
            }                                                                                                \
        }                                                                                                    \
        for (int j = 0; j < K2; j++) {                                                                       \
            A s = 0;                                                                                         \
            for (int l = 0; l < NAME##_L; l++) s += tot[j][l];                                               \
            sc[j] = s;                                                                                       \
        }                                                                                                    \
    }                                                                                                        \
                                                                                                             \
    /* The k-th largest (k in [1, m]) of x[0..m) by radix select; *need: how many keys equal to it the     \
     * top k hold (the rest of the top k is strictly larger). buf: m scratch entries. */                     \
    static U NAME##_kth(const U *x, int64_t m, int64_t k, U *buf, int64_t *need) {                           \
        const U *c = x;                                                                                      \
        int64_t nc = m, rank = k;                                                                            \
        U prefix = 0;                                                                                        \
        int shift = UBITS;                                                                                   \
        int32_t hist[2048];                                                                                  \
        while (shift > 0) {                                                                                  \
            const int b = shift >= 11 ? 11 : shift;                                                          \
            shift -= b;                                                                                      \
            const U mask = (U)(((U)1 << b) - 1);                                                             \
            memset(hist, 0, sizeof(int32_t) * ((size_t)mask + 1));                                           \
            for (int64_t i = 0; i < nc; i++) hist[(c[i] >> shift) & mask]++;                                 \
            int64_t cum = 0, bucket = (int64_t)mask;                                                         \
            for (; bucket > 0; bucket--) {                                                                   \
                if (cum + hist[bucket] >= rank) break;                                                       \
                cum += hist[bucket];                                                                         \
            }                                                                                                \
            rank -= cum;                                                                                     \
            prefix |= (U)bucket << shift;                                                                    \
            if (hist[bucket] != nc) { /* keep the bucket's keys (in place once in buf) */                    \
                int64_t j = 0;                                                                               \
                for (int64_t i = 0; i < nc; i++)                                                             \
                    if ((U)((c[i] >> shift) & mask) == (U)bucket) buf[j++] = c[i];                           \
                c = buf;                                                                                     \
                nc = j;                                                                                      \
            }                                                                                                \
        }                                                                                                    \
        *need = rank;                                                                                        \
        return prefix;                                                                                       \
    }                                                                                                        \
                                                                                                             \
    /* ascending LSD radix sort of a[0..n) (tmp: n entries; an even number of byte passes ends in a) */   \
    static void NAME##_sort(U *a, U *tmp, int64_t n) {                                                      \
        for (int shift = 0; shift < UBITS; shift += 8) {                                                    \
            int64_t cnt[257] = {0};                                                                         \
            for (int64_t i = 0; i < n; i++) cnt[((a[i] >> shift) & 255) + 1]++;                            \
            for (int b = 0; b < 256; b++) cnt[b + 1] += cnt[b];                                             \
            for (int64_t i = 0; i < n; i++) tmp[cnt[(a[i] >> shift) & 255]++] = a[i];                      \
            U *t = a;                                                                                       \
            a = tmp;                                                                                        \
            tmp = t;                                                                                        \
        }                                                                                                   \
    }                                                                                                       \
                                                                                                            \
    /* The top k of the candidates x[idx[c]] (idx NULL: x[c]), c in [0, nc), in index order: every key     \
     * above the k-th key v and the first `need` equal to it (ties go to the earlier key), into sel;       \
     * returns how many (k when the candidates hold them). The one tie rule of both selections. */         \
    static inline int64_t NAME##_take(const U *x, const int64_t *idx, int64_t nc, int64_t k, U v,          \
                                      int64_t need, int64_t *sel) {                                        \
        int64_t o = 0;                                                                                     \
        for (int64_t c = 0; c < nc && o < k; c++) {                                                        \
            const int64_t i = idx ? idx[c] : c;                                                            \
            const U u = x[i];                                                                              \
            const int64_t take = (u > v) | ((u == v) & (need > 0));                                        \
            need -= take & (u == v);                                                                       \
            sel[o] = i;                                                                                    \
            o += take;                                                                                     \
        }                                                                                                  \
        return o;                                                                                          \
    }                                                                                                      \
                                                                                                           \
    /* The indices of the top k (k < m) of x[0..m) by (key descending, index ascending), ascending,        \
     * into sel; returns k. Rows of 16 * SAMPLE keys or more first guess the k-th key from a sample: it    \
     * lies, most likely, between the sample quantiles 4 standard deviations either side of its rank; one  \
     * pass counts the keys above that band and lists the band's keys and every index at or above it, so   \
     * the k-th is selected from the band alone and only the listed indices are scanned (the whole row     \
     * when the guess missed). buf, cidx: m entries; smp: 2 * SAMPLE. */                                   \
    static int64_t NAME##_select(const U *x, int64_t m, int64_t k, U *buf, int64_t *cidx, U *smp,          \
                                 int64_t *sel) {                                                           \
        int64_t need;                                                                                      \
        if (m >= 16 * SAMPLE) {                                                                            \
            for (int64_t i = 0; i < SAMPLE; i++) smp[i] = x[(i * m) / SAMPLE + (m / SAMPLE) / 2];          \
            NAME##_sort(smp, smp + SAMPLE, SAMPLE);                                                        \
            const double f = (double)k / (double)m;                                                        \
            const int64_t rs = (k * SAMPLE) / m, margin = (int64_t)(4.0 * sqrt(SAMPLE * f * (1 - f))) + 2; \
            const int64_t up = rs - margin, down = rs + margin + 1;                                        \
            const U hi = up < 1 ? (U) ~(U)0 : smp[SAMPLE - up]; /* the up-th largest sample */             \
            const U lo = down > SAMPLE ? (U)0 : smp[SAMPLE - down];                                        \
            int64_t above = 0, nb = 0, nc = 0;                                                             \
            for (int64_t i = 0; i < m; i++) {                                                              \
                const U u = x[i];                                                                          \
                const int64_t over = u > hi, in = (u >= lo) & !over;                                       \
                above += over;                                                                             \
                buf[nb] = u;                                                                               \
                nb += in;                                                                                  \
                cidx[nc] = i;                                                                              \
                nc += over | in;                                                                           \
            }                                                                                              \
            if (above < k && k <= above + nb) {                                                            \
                const U v = NAME##_kth(buf, nb, k - above, buf, &need);                                    \
                return NAME##_take(x, cidx, nc, k, v, need, sel);                                          \
            }                                                                                              \
        }                                                                                                  \
        const U v = NAME##_kth(x, m, k, buf, &need);                                                       \
        return NAME##_take(x, NULL, m, k, v, need, sel);                                                   \
    }                                                                                                      \
                                                                                                           \
    int NAME(const A *q, int64_t q_n, int64_t q_h, const A *w, int64_t w_n, int64_t N, const int64_t *rows, \
             const int64_t *positions, const T *kv, int64_t num_pages, int64_t P, const int64_t *tables,    \
             int64_t tstride, int64_t W, int64_t nt, const int64_t *row_seq, int64_t n, int64_t H, int64_t d, \
             int64_t k, A *out_sc, int64_t *out_pos, int64_t *out_slot, int64_t budget, int64_t nthreads) {  \
        if (n <= 0 || k <= 0) return 0;                                                                      \
        fp8_lut_init();                                                                                      \
        if (nthreads < 1) nthreads = 1;                                                                      \
        for (int64_t r = 0; r < n; r++) { /* rows and tables in range (an id past the pool: below) */        \
            const int64_t src = rows ? rows[r] : r;                                                          \
            if (src < 0 || src >= N || (row_seq && (row_seq[r] < 0 || row_seq[r] >= nt))) return 2;          \
        }                                                                                                    \
        const int64_t L = NAME##_L, Hp = (H + L - 1) / L * L;                                                \
        const int two = (Hp / L) % 2 == 0;                                                                   \
        int err = 0;                                                                                         \
        /* groups of consecutive rows on one table, their held pages as runs of keys */                      \
        int64_t ng = 0;                                                                                      \
        for (int64_t r = 0; r < n; r++)                                                                      \
            if (r == 0 || (row_seq && row_seq[r] != row_seq[r - 1])) ng++;                                   \
        int64_t *gfirst = malloc(sizeof(int64_t) * (size_t)(ng + 1));                                        \
        int64_t *grun = malloc(sizeof(int64_t) * (size_t)(ng + 1)); /* first run of each group */            \
        int64_t *mrow = malloc(sizeof(int64_t) * (size_t)n);        /* keys each row sees */                 \
        int64_t *roff = malloc(sizeof(int64_t) * (size_t)n);        /* its scores' offset in the wave */    \
        int64_t *rgrp = malloc(sizeof(int64_t) * (size_t)n);                                                 \
        block_t *blocks = malloc(sizeof(block_t) * (size_t)n);                                               \
        run_t *runs = NULL;                                                                                  \
        item_t *items = NULL;                                                                                \
        int64_t *wave_items = NULL, *wave_rows = NULL;                                                       \
        U *buf = NULL;                                                                                       \
        if (!gfirst || !grun || !mrow || !roff || !rgrp || !blocks) { err = 1; goto done; }                  \
        {                                                                                                    \
            int64_t g = -1, total_runs = 0;                                                                  \
            for (int64_t r = 0; r < n; r++) {                                                                \
                if (r == 0 || (row_seq && row_seq[r] != row_seq[r - 1])) gfirst[++g] = r;                    \
                rgrp[r] = g;                                                                                 \
            }                                                                                                \
            gfirst[ng] = n;                                                                                  \
            for (g = 0; g < ng; g++) { /* an upper bound on the runs: pages up to the group's last row */    \
                int64_t mx;                                                                                  \
                const int64_t np = group_pages(positions, rows, gfirst[g], gfirst[g + 1], P, W, &mx);        \
                total_runs += np + 1;                                                                        \
            }                                                                                                \
            runs = malloc(sizeof(run_t) * (size_t)total_runs);                                               \
            if (!runs) { err = 1; goto done; }                                                               \
            int64_t nr = 0;                                                                                  \
            for (g = 0; g < ng; g++) {                                                                       \
                const int64_t *tbl = tables + (row_seq ? row_seq[gfirst[g]] : 0) * tstride;                  \
                int64_t mx;                                                                                  \
                const int64_t np = group_pages(positions, rows, gfirst[g], gfirst[g + 1], P, W, &mx);        \
                grun[g] = nr;                                                                                \
                int64_t cnt = 0;                                                                             \
                for (int64_t pg = 0; pg < np; pg++) {                                                        \
                    if (tbl[pg] < 0) continue;                                                               \
                    if (tbl[pg] >= num_pages) { err = 2; goto done; }                                        \
                    runs[nr++] = (run_t){pg, tbl[pg], cnt};                                                  \
                    cnt += mx - pg * P + 1 < P ? mx - pg * P + 1 : P;                                        \
                }                                                                                            \
                runs[nr++] = (run_t){np, -1, cnt}; /* sentinel: the group's key count */                     \
            }                                                                                                \
            grun[ng] = nr;                                                                                   \
            for (int64_t r = 0; r < n; r++) { /* keys at positions <= the row's */                           \
                const run_t *gr = runs + grun[rgrp[r]];                                                      \
                const int64_t nrun = grun[rgrp[r] + 1] - grun[rgrp[r]];                                      \
                const int64_t p = positions[rows ? rows[r] : r];                                             \
                int64_t m = 0;                                                                               \
                if (p >= 0) {                                                                                \
                    const int64_t pg = p / P;                                                                \
                    int64_t lo = 0, hi = nrun - 1; /* first run with page >= pg (the sentinel at worst) */   \
                    while (lo < hi) {                                                                        \
                        const int64_t mid = (lo + hi) / 2;                                                   \
                        if (gr[mid].pg >= pg)                                                                \
                            hi = mid;                                                                        \
                        else                                                                                 \
                            lo = mid + 1;                                                                    \
                    }                                                                                        \
                    m = gr[lo].start;                                                                        \
                    if (lo < nrun - 1 && gr[lo].pg == pg) m += p - pg * P + 1;                               \
                }                                                                                            \
                mrow[r] = m;                                                                                 \
            }                                                                                                \
        }                                                                                                    \
        /* blocks of RB rows of a group; waves of blocks whose scores fit the budget; items per wave */      \
        int64_t nb = 0, maxm = 0;                                                                            \
        for (int64_t g = 0; g < ng; g++)                                                                     \
            for (int64_t r = gfirst[g]; r < gfirst[g + 1]; r += RB)                                          \
                blocks[nb++] = (block_t){g, r, r + RB < gfirst[g + 1] ? r + RB : gfirst[g + 1]};             \
        for (int64_t r = 0; r < n; r++)                                                                      \
            if (mrow[r] > maxm) maxm = mrow[r];                                                              \
        int64_t nwaves = 0, nitems = 0, bufn = 0;                                                            \
        {                                                                                                    \
            int64_t cap = 0;                                                                                 \
            for (int64_t b = 0; b < nb; b++) {                                                               \
                int64_t mb = 0;                                                                              \
                for (int64_t r = blocks[b].r0; r < blocks[b].r1; r++) mb = mrow[r] > mb ? mrow[r] : mb;      \
                cap += mb / MINCH + 1;                                                                       \
            }                                                                                                \
            items = malloc(sizeof(item_t) * (size_t)cap);                                                    \
            wave_items = malloc(sizeof(int64_t) * (size_t)(nb + 1));                                         \
            wave_rows = malloc(sizeof(int64_t) * (size_t)(nb + 1));                                          \
            if (!items || !wave_items || !wave_rows) { err = 1; goto done; }                                 \
            int64_t b = 0;                                                                                   \
            wave_items[0] = 0;                                                                               \
            wave_rows[0] = 0;                                                                                \
            while (b < nb) {                                                                                 \
                int64_t e = b, ent = 0, keys = 0;                                                            \
                while (e < nb) { /* at least one block a wave */                                             \
                    int64_t s = 0, mb = 0;                                                                   \
                    for (int64_t r = blocks[e].r0; r < blocks[e].r1; r++) {                                  \
                        s += mrow[r];                                                                        \
                        mb = mrow[r] > mb ? mrow[r] : mb;                                                    \
                    }                                                                                        \
                    if (e > b && ent + s > budget) break;                                                    \
                    for (int64_t r = blocks[e].r0; r < blocks[e].r1; r++) {                                  \
                        roff[r] = ent;                                                                       \
                        ent += mrow[r];                                                                      \
                    }                                                                                        \
                    keys += mb;                                                                              \
                    e++;                                                                                     \
                }                                                                                            \
                int64_t ch = (keys + 4 * nthreads - 1) / (4 * nthreads);                                     \
                ch = ch < MINCH ? MINCH : ch > MAXCH ? MAXCH : ch;                                           \
                for (int64_t bb = b; bb < e; bb++) {                                                         \
                    int64_t mb = 0;                                                                          \
                    for (int64_t r = blocks[bb].r0; r < blocks[bb].r1; r++)                                  \
                        mb = mrow[r] > mb ? mrow[r] : mb;                                                    \
                    const int64_t pieces = (mb + ch - 1) / ch; /* even pieces, about ch keys each */         \
                    for (int64_t c = 0; c < pieces; c++)                                                     \
                        items[nitems++] = (item_t){bb, mb * c / pieces, mb * (c + 1) / pieces};              \
                }                                                                                            \
                bufn = ent > bufn ? ent : bufn;                                                              \
                nwaves++;                                                                                    \
                wave_items[nwaves] = nitems;                                                                 \
                wave_rows[nwaves] = e < nb ? blocks[e].r0 : n;                                               \
                b = e;                                                                                       \
            }                                                                                                \
        }                                                                                                    \
        buf = malloc(sizeof(U) * (size_t)(bufn > 0 ? bufn : 1));                                             \
        if (!buf) { err = 1; goto done; }                                                                    \
        _Pragma("omp parallel num_threads(nthreads)") {                                                      \
            A *qt = malloc(sizeof(A) * (size_t)(RB * Hp * d + RB * Hp));                                     \
            A *kf = CONV ? malloc(sizeof(A) * (size_t)(NR * d)) : NULL;                                      \
            U *cand = malloc(sizeof(U) * (size_t)(maxm + 2 * SAMPLE));                                       \
            U *smp = cand ? cand + maxm : NULL;                                                              \
            int64_t *sel = malloc(sizeof(int64_t) * (size_t)(k + maxm));                                     \
            int64_t *cidx = sel ? sel + k : NULL;                                                            \
            const int ok = qt && cand && sel && (!CONV || kf);                                               \
            if (!ok) {                                                                                       \
                _Pragma("omp atomic write") err = 1;                                                         \
            }                                                                                                \
            A *wt = qt ? qt + RB * Hp * d : NULL;                                                            \
            for (int64_t wv = 0; wv < nwaves; wv++) {                                                        \
                _Pragma("omp for schedule(dynamic, 1)") for (int64_t it = wave_items[wv];                   \
                                                             it < wave_items[wv + 1]; it++) {                \
                    if (!ok) continue;                                                                       \
                    const item_t I = items[it];                                                              \
                    const block_t B = blocks[I.b];                                                           \
                    const int64_t nrow = B.r1 - B.r0;                                                        \
                    for (int64_t j = 0; j < nrow; j++) { /* the rows' queries as [d, Hp], weights [Hp] */    \
                        const int64_t src = rows ? rows[B.r0 + j] : B.r0 + j;                                \
                        A *t = qt + j * Hp * d;                                                              \
                        for (int64_t h = 0; h < Hp; h++) {                                                   \
                            const A *qh = q + src * q_n + h * q_h;                                           \
                            if (h < H)                                                                       \
                                for (int64_t dd = 0; dd < d; dd++) t[dd * Hp + h] = qh[dd];                  \
                            else                                                                             \
                                for (int64_t dd = 0; dd < d; dd++) t[dd * Hp + h] = 0;                       \
                            wt[j * Hp + h] = h < H ? w[src * w_n + h] : 0;                                   \
                        }                                                                                    \
                    }                                                                                        \
                    const run_t *gr = runs + grun[B.g];                                                      \
                    const int64_t nrun = grun[B.g + 1] - grun[B.g];                                          \
                    int64_t e = find_run(gr, nrun, I.c0), t = I.c0 - gr[e].start;                            \
                    const T *raw[NR], *nxt[NR]; /* this block's keys in the pool, and the next block's */    \
                    for (int64_t j = 0; j < NR && I.c0 + j < I.c1; j++) {                                    \
                        while (t >= gr[e + 1].start - gr[e].start) t = 0, e++;                                \
                        raw[j] = kv + (gr[e].id * P + t++) * ROW(d);                                            \
                    }                                                                                        \
                    for (int64_t i = I.c0; i < I.c1; i += NR) {                                              \
                        const int64_t nk = I.c1 - i < NR ? I.c1 - i : NR;                                    \
                        for (int64_t j = 0; j < NR && i + NR + j < I.c1; j++) { /* fetched while we score */ \
                            while (t >= gr[e + 1].start - gr[e].start) t = 0, e++;                            \
                            nxt[j] = kv + (gr[e].id * P + t++) * ROW(d);                                        \
                            for (int64_t b = 0; b < ROW(d) * (int64_t)sizeof(T); b += 64)                      \
                                __builtin_prefetch((const char *)nxt[j] + b);                                \
                        }                                                                                    \
                        const A *kp[NR];                                                                     \
                        for (int64_t j = 0; j < nk; j++) {                                                   \
                            if (CONV) {                                                                      \
                                A *dst = kf + j * d;                                                         \
                                KROW(raw[j], d, dst);                                                       \
                                kp[j] = dst;                                                                 \
                            } else {                                                                         \
                                kp[j] = (const A *)(const void *)raw[j];                                     \
                            }                                                                                \
                        }                                                                                    \
                        for (int64_t j = nk; j < NR; j++) kp[j] = kp[0];                                     \
                        memcpy(raw, nxt, sizeof(raw));                                                       \
                        for (int64_t j = 0; j < nrow; j++) {                                                 \
                            const int64_t r = B.r0 + j, m = mrow[r];                                         \
                            if (i >= m) continue;                                                            \
                            A sc[NR];                                                                        \
                            if (two) {                                                                       \
                                NAME##_micro2(qt + j * Hp * d, wt + j * Hp, Hp, d, kp, sc);                  \
                                if (nk > NR / 2)                                                             \
                                    NAME##_micro2(qt + j * Hp * d, wt + j * Hp, Hp, d, kp + NR / 2,          \
                                                  sc + NR / 2);                                              \
                            } else {                                                                         \
                                NAME##_micro1(qt + j * Hp * d, wt + j * Hp, Hp, d, kp, sc);                  \
                            }                                                                                \
                            const int64_t nv = m - i < nk ? m - i : nk;                                      \
                            U *o = buf + roff[r] + i;                                                        \
                            for (int64_t u = 0; u < nv; u++) o[u] = KEY(sc[u]);                              \
                        }                                                                                    \
                    }                                                                                        \
                }                                                                                            \
                _Pragma("omp for schedule(dynamic, 1)") for (int64_t r = wave_rows[wv];                     \
                                                             r < wave_rows[wv + 1]; r++) {                   \
                    if (!ok) continue;                                                                       \
                    const int64_t m = mrow[r];                                                               \
                    const U *x = buf + roff[r];                                                              \
                    A *os = out_sc + r * k;                                                                  \
                    int64_t *op = out_pos + r * k, *ol = out_slot + r * k;                                   \
                    int64_t o = m; /* keys selected (k of them when the row sees more) */                    \
                    if (m > k)                                                                               \
                        o = NAME##_select(x, m, k, cand, cidx, smp, sel);                                    \
                    else                                                                                     \
                        for (int64_t i = 0; i < m; i++) sel[i] = i;                                          \
                    const run_t *gr = runs + grun[rgrp[r]];                                                  \
                    for (int64_t c = 0, e = 0; c < o; c++) {                                                 \
                        const int64_t i = sel[c];                                                            \
                        while (gr[e + 1].start <= i) e++;                                                    \
                        os[c] = UNKEY(x[i]);                                                                 \
                        op[c] = gr[e].pg * P + i - gr[e].start;                                              \
                        ol[c] = gr[e].id * P + i - gr[e].start;                                              \
                    }                                                                                        \
                    for (; o < k; o++) {                                                                     \
                        os[o] = -INFINITY;                                                                   \
                        op[o] = -1;                                                                          \
                        ol[o] = -1;                                                                          \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
            free(qt);                                                                                        \
            free(kf);                                                                                        \
            free(cand);                                                                                      \
            free(sel);                                                                                       \
        }                                                                                                    \
    done:                                                                                                    \
        free(gfirst);                                                                                        \
        free(grun);                                                                                          \
        free(mrow);                                                                                          \
        free(roff);                                                                                          \
        free(rgrp);                                                                                          \
        free(blocks);                                                                                        \
        free(runs);                                                                                          \
        free(items);                                                                                         \
        free(wave_items);                                                                                    \
        free(wave_rows);                                                                                     \
        free(buf);                                                                                           \
        return err;                                                                                          \
    }

#define NO_ROW(row, d, dst) ((void)0)
#define BF16_ROW(row, d, dst) bf16_run_f((const uint8_t *)(row), (d), (dst))
#define PLAIN(d) (d)
#define FP8ROW(d) ((d) + 4 * (((d) + 127) / 128))
DEFINE(dsa_topk_f64, double, double, vd, vdi, uint64_t, 64, 0, key_d, unkey_d, PLAIN, NO_ROW)
DEFINE(dsa_topk_f32, float, float, vf, vfi, uint32_t, 32, 0, key_f, unkey_f, PLAIN, NO_ROW)
DEFINE(dsa_topk_f32_bf16, bf16, float, vf, vfi, uint32_t, 32, 1, key_f, unkey_f, PLAIN, BF16_ROW)
DEFINE(dsa_topk_f64_fp8, uint8_t, double, vd, vdi, uint64_t, 64, 1, key_d, unkey_d, FP8ROW, fp8_tiles_d)
DEFINE(dsa_topk_f32_fp8, uint8_t, float, vf, vfi, uint32_t, 32, 1, key_f, unkey_f, FP8ROW, fp8_tiles_f)
