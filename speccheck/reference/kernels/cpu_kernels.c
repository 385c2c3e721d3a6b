/* The reference engine's CPU kernels: a row-invariant bf16 linear, out[m, n] = x[m, :] . w[n, :],
 * RMSNorm, and the gated delta rule over a verify's chunk (both at the end).
 *
 * Why: PyTorch's bf16 GEMM on a CPU without bf16 instructions is a scalar loop whose cost grows
 * with the rows (a verify of 8 tokens paid ~6x a decode step's GEMMs), and an fp32 BLAS sums a
 * 1-row and an 8-row product in different orders (decode and verify would then differ in bits).
 * Here every output element is computed the same way whatever the number of rows: products of
 * the bf16 operands in fp32 (exact), accumulated in 16 lanes (lane l takes k = 16c + l, in order
 * of c, K zero-padded to a multiple of 16), the lanes summed by a fixed tree
 * ((l, l+8), then (l, l+4), (l, l+2), (0, 1)). Plain IEEE fp32 adds (-ffp-contract=off; a
 * fused multiply-add where the CPU has one rounds as a multiply and an add do, see MADD): the
 * same bits on any CPU, and cpu.py's PyTorch formulation of the same sums gives them
 * too. Rows are taken up to four at a time so each weight row is converted once per four rows,
 * and the next weight rows are prefetched (a decode step's weights come from L3 or memory: 1.9x
 * faster cold on the AVX2 EPYC); from 5 rows on (a verify, a prefill, a batch) a column block
 * of weights is converted to fp32 once and up to six rows run over each weight row (1.2-1.7x
 * faster), the next block's rows prefetched meanwhile (a verify's products 1.3x faster in the
 * decode loop). With AVX-512 (USE_AVX512) one register holds a sum's 16 lanes and tiles of up
 * to 6 rows x 4 weight rows serve every row count (a verify's products 1.7x faster in the
 * decode loop on the AVX-512 EPYC, a decode step's no slower). Those change speed, not any
 * element's arithmetic: the install builds one library per instruction set (build.py) and
 * cpu.py loads the widest the CPU has (SPECCHECK_CPU_ISA asks for a narrower one); the tests
 * check that every build gives the same bits.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

/* The sha256 of this file as build.py compiled it: cpu.py refuses a library built from another
 * source (a checkout edited since its last build) */
#ifndef CPU_KERNELS_SHA256
#define CPU_KERNELS_SHA256 ""
#endif
const char *const cpu_kernels_sha256 = CPU_KERNELS_SHA256;

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline v8f load_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* acc + x * w. The product of two bf16 values is exact in fp32 (16 significant bits), so a
 * fused multiply-add rounds once exactly where a multiply and an add round once: the same bits
 * (a product below fp32's normal range, ~1e-38, is the only exception) */
#ifdef USE_FMA
#include <immintrin.h>
#define MADD(x, w, acc) ((v8f)_mm256_fmadd_ps((__m256)(x), (__m256)(w), (__m256)(acc)))
#else
#define MADD(x, w, acc) ((acc) + (x) * (w))
#endif

static inline float reduce16(v8f a, v8f b) {
    v8f s = a + b; /* lanes l and l + 8 */
    float t[8];
    memcpy(t, &s, sizeof t);
    float u0 = t[0] + t[4], u1 = t[1] + t[5], u2 = t[2] + t[6], u3 = t[3] + t[7];
    float w0 = u0 + u2, w1 = u1 + u3;
    return w0 + w1;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f(uint16_t h) { /* exact */
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* K bf16 values to fp32, zero-padded to Kp (the lanes' multiple of 16) */
static void widen_row(const uint16_t *src, float *dst, int64_t K, int64_t Kp) {
    for (int64_t k = 0; k < K; k++) dst[k] = bf16_to_f(src[k]);
    for (int64_t k = K; k < Kp; k++) dst[k] = 0.0f;
}

static inline void store(void *out, int out_fp32, int64_t i, float v) {
    if (out_fp32) ((float *)out)[i] = v;
    else ((uint16_t *)out)[i] = to_bf16(v);
}

/* xf: R rows of fp32 activations, each Kp long (zero-padded); R is 1..4; output columns n0..n1.
 * NB weight rows at a time (more independent sums in flight for few rows); no element's
 * arithmetic depends on R, NB or the column range */
#define TILE(R, NB)                                                                            \
    static void tile##R##x##NB(const float *xf, int64_t Kp, const uint16_t *w, int64_t K,      \
                               uint16_t *wbuf, int64_t N, void *out, int64_t m0, int out_fp32, \
                               int64_t n0, int64_t n1) {                                       \
        for (int64_t n = n0; n < n1; n += NB) {                                                \
            int nb = n1 - n < NB ? (int)(n1 - n) : NB;                                         \
            const uint16_t *wr[NB];                                                            \
            for (int j = 0; j < NB; j++) {                                                     \
                int jj = j < nb ? j : 0;                                                       \
                wr[j] = w + (n + jj) * K;                                                      \
                if (Kp != K) { memcpy(wbuf + j * Kp, wr[j], K * 2); wr[j] = wbuf + j * Kp; }   \
            }                                                                                  \
            if (n + 2 * NB <= N && Kp == K)  /* the next block's rows, ahead of the loads */     \
                for (int64_t off = 0; off < NB * K; off += 32)                                 \
                    __builtin_prefetch(w + (n + NB) * K + off, 0, 0);                          \
            v8f a[R][NB], b[R][NB];                                                            \
            for (int r = 0; r < R; r++)                                                        \
                for (int j = 0; j < NB; j++) { a[r][j] = (v8f){0}; b[r][j] = (v8f){0}; }       \
            for (int64_t k = 0; k < Kp; k += 16) {                                             \
                v8f w0[NB], w1[NB];                                                            \
                for (int j = 0; j < NB; j++) {                                                 \
                    w0[j] = load_bf16(wr[j] + k); w1[j] = load_bf16(wr[j] + k + 8);            \
                }                                                                              \
                for (int r = 0; r < R; r++) {                                                  \
                    v8f x0, x1;                                                                \
                    memcpy(&x0, xf + r * Kp + k, sizeof x0);                                   \
                    memcpy(&x1, xf + r * Kp + k + 8, sizeof x1);                               \
                    for (int j = 0; j < NB; j++) {                                             \
                        a[r][j] = MADD(x0, w0[j], a[r][j]);                                    \
                        b[r][j] = MADD(x1, w1[j], b[r][j]);                                    \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            for (int r = 0; r < R; r++)                                                        \
                for (int j = 0; j < nb; j++)                                                   \
                    store(out, out_fp32, (m0 + r) * N + n + j, reduce16(a[r][j], b[r][j]));    \
        }                                                                                      \
    }
TILE(1, 4)
TILE(2, 2)
TILE(3, 1)
TILE(4, 1)

/* Many rows (a prefill, a batch, a verify of 5 or more): the 16 weight rows of a column block are
 * converted to fp32 once, then R rows of x (up to 6, 12 independent sums keep both FMA pipes
 * busy) run over each weight row with the weight operand straight from L1, no conversion in the
 * loop. The same lanes in the same order as the tiles above: the same bits. */
#define WIDE 6
#define WIDE_ROWS(R)                                                                            \
    static void wide##R(const float *xf, int64_t Kp, const float *wf, int64_t N, void *out,    \
                        int64_t m0, int out_fp32, int64_t n0, int64_t n1, const char *next,     \
                        int64_t rb) {                                                           \
        for (int64_t n = n0; n < n1; n++) {                                                     \
            if (next) /* row n - n0 of the next column block, ahead of its widening */           \
                for (int64_t off = 0; off < rb; off += 64)                                      \
                    __builtin_prefetch(next + (n - n0) * rb + off, 0, 3);                       \
            const float *wr = wf + (n - n0) * Kp;                                               \
            v8f a[R], b[R];                                                                     \
            for (int r = 0; r < R; r++) { a[r] = (v8f){0}; b[r] = (v8f){0}; }                   \
            for (int64_t k = 0; k < Kp; k += 16) {                                              \
                v8f w0, w1;                                                                     \
                memcpy(&w0, wr + k, sizeof w0);                                                 \
                memcpy(&w1, wr + k + 8, sizeof w1);                                             \
                for (int r = 0; r < R; r++) {                                                   \
                    v8f x0, x1;                                                                 \
                    memcpy(&x0, xf + r * Kp + k, sizeof x0);                                    \
                    memcpy(&x1, xf + r * Kp + k + 8, sizeof x1);                                \
                    a[r] = MADD(x0, w0, a[r]);                                                  \
                    b[r] = MADD(x1, w1, b[r]);                                                  \
                }                                                                               \
            }                                                                                   \
            for (int r = 0; r < R; r++)                                                         \
                store(out, out_fp32, (m0 + r) * N + n, reduce16(a[r], b[r]));                   \
        }                                                                                       \
    }
WIDE_ROWS(1)
WIDE_ROWS(2)
WIDE_ROWS(3)
WIDE_ROWS(4)
WIDE_ROWS(5)
WIDE_ROWS(6)

static void wide_rows(const float *xf, int64_t Kp, const float *wf, int R, int64_t N, void *out,
                      int64_t m0, int out_fp32, int64_t n0, int64_t n1, const char *next, int64_t rb) {
    switch (R) {
    case 1: wide1(xf, Kp, wf, N, out, m0, out_fp32, n0, n1, next, rb); break;
    case 2: wide2(xf, Kp, wf, N, out, m0, out_fp32, n0, n1, next, rb); break;
    case 3: wide3(xf, Kp, wf, N, out, m0, out_fp32, n0, n1, next, rb); break;
    case 4: wide4(xf, Kp, wf, N, out, m0, out_fp32, n0, n1, next, rb); break;
    case 5: wide5(xf, Kp, wf, N, out, m0, out_fp32, n0, n1, next, rb); break;
    default: wide6(xf, Kp, wf, N, out, m0, out_fp32, n0, n1, next, rb); break;
    }
}

/* rows of x from M_WIDE on take the wide path (A/B on the AVX2 EPYC: 5-8 rows 1.24-1.38x, 2 and
 * 4 rows no faster) */
#define M_WIDE 5
#define M_BLOCK 96

#ifdef USE_AVX512
/* With AVX-512 one zmm register holds a sum's 16 lanes: tiles of up to 6 rows x 4 weight rows
 * keep 24 sums in registers, the weights are widened in registers (no fp32 copy), and the next
 * 4 weight rows are prefetched while these are used, for any number of rows. The same lanes in
 * the same order and the same tree: the same bits as the paths above. */
#define ZB 4 /* weight rows per tile */

static inline __m512 load16_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline float reduce_zmm(__m512 v) { /* lanes 0-7 and 8-15 as reduce16's two halves */
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    v8f a, b;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, &hi, sizeof b);
    return reduce16(a, b);
}

/* R rows of xf over weight rows n..n+nb-1 (nb <= ZB); ahead: prefetch rows n+ZB.. meanwhile */
#define ZTILE(R)                                                                                 \
    static void ztile##R(const float *xf, int64_t Kp, const uint16_t *w, int64_t K,             \
                         uint16_t *wbuf, int64_t N, void *out, int64_t m0, int out_fp32,         \
                         int64_t n, int nb, int ahead) {                                         \
        const uint16_t *wr[ZB];                                                                  \
        for (int j = 0; j < ZB; j++) {                                                           \
            wr[j] = w + (n + (j < nb ? j : 0)) * K;                                              \
            if (Kp != K) {                                                                       \
                memcpy(wbuf + j * Kp, wr[j], K * 2);                                             \
                memset(wbuf + j * Kp + K, 0, (size_t)(Kp - K) * 2);                              \
                wr[j] = wbuf + j * Kp;                                                           \
            }                                                                                    \
        }                                                                                        \
        const char *next = (const char *)(w + (n + ZB) * K); /* ZB rows: 8 bytes per k */       \
        __m512 acc[R][ZB];                                                                       \
        for (int r = 0; r < R; r++)                                                              \
            for (int j = 0; j < ZB; j++) acc[r][j] = _mm512_setzero_ps();                        \
        for (int64_t k = 0; k < Kp; k += 16) {                                                   \
            if (ahead) {                                                                         \
                __builtin_prefetch(next + k * 8, 0, 3);                                          \
                __builtin_prefetch(next + k * 8 + 64, 0, 3);                                     \
            }                                                                                    \
            __m512 wv[ZB];                                                                       \
            for (int j = 0; j < ZB; j++) wv[j] = load16_bf16(wr[j] + k);                         \
            for (int r = 0; r < R; r++) {                                                        \
                __m512 xv = _mm512_loadu_ps(xf + r * Kp + k);                                    \
                for (int j = 0; j < ZB; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]); \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < R; r++)                                                              \
            for (int j = 0; j < nb; j++)                                                         \
                store(out, out_fp32, (m0 + r) * N + n + j, reduce_zmm(acc[r][j]));               \
    }
ZTILE(1)
ZTILE(2)
ZTILE(3)
ZTILE(4)
ZTILE(5)
ZTILE(6)

static void rowinv_linear_zmm(const uint16_t *x, const uint16_t *w, void *out, int64_t M,
                              int64_t N, int64_t K, int out_fp32, float *xbuf, uint16_t *wbuf) {
    int64_t Kp = (K + 15) / 16 * 16;
    for (int64_t m = 0; m < M; m++) widen_row(x + m * K, xbuf + m * Kp, K, Kp);
    for (int64_t mb = 0; mb < M; mb += M_BLOCK) { /* blocks of M_BLOCK rows (in L2) */
        int64_t rows = M - mb < M_BLOCK ? M - mb : M_BLOCK, groups = (rows + WIDE - 1) / WIDE;
        for (int64_t n = 0; n < N; n += ZB) {
            int nb = N - n < ZB ? (int)(N - n) : ZB;
            int ahead = n + 2 * ZB <= N && Kp == K;
            for (int64_t g = 0, m0 = mb; g < groups; g++) { /* groups as even as can be */
                int R = (int)(rows / groups + (g < rows % groups));
                const float *xf = xbuf + m0 * Kp;
                int a = ahead && g == 0;
                switch (R) {
                case 1: ztile1(xf, Kp, w, K, wbuf, N, out, m0, out_fp32, n, nb, a); break;
                case 2: ztile2(xf, Kp, w, K, wbuf, N, out, m0, out_fp32, n, nb, a); break;
                case 3: ztile3(xf, Kp, w, K, wbuf, N, out, m0, out_fp32, n, nb, a); break;
                case 4: ztile4(xf, Kp, w, K, wbuf, N, out, m0, out_fp32, n, nb, a); break;
                case 5: ztile5(xf, Kp, w, K, wbuf, N, out, m0, out_fp32, n, nb, a); break;
                default: ztile6(xf, Kp, w, K, wbuf, N, out, m0, out_fp32, n, nb, a); break;
                }
                m0 += R;
            }
        }
    }
}
#endif

/* x [M, K] bf16, w [N, K] bf16, out [M, N] bf16 or fp32; xbuf >= M * Kp floats, wbuf
 * >= 16 * Kp floats, Kp = K rounded up to a multiple of 16. Columns in blocks of 16 weight rows
 * (8 KB at K = 256, in L1), every row block of x over each: a weight row comes from memory once. */
void rowinv_linear(const uint16_t *x, const uint16_t *w, void *out, int64_t M, int64_t N,
                   int64_t K, int out_fp32, float *xbuf, void *wbuf) {
#ifdef USE_AVX512
    rowinv_linear_zmm(x, w, out, M, N, K, out_fp32, xbuf, (uint16_t *)wbuf);
    return;
#endif
    int64_t Kp = (K + 15) / 16 * 16;
    uint16_t *wb16 = (uint16_t *)wbuf;
    float *wf = (float *)wbuf;
    int wide = M >= M_WIDE;
    if (Kp != K && !wide)
        for (int j = 0; j < 4; j++) memset(wb16 + j * Kp + K, 0, (size_t)(Kp - K) * 2);
    for (int64_t m = 0; m < M; m++) widen_row(x + m * K, xbuf + m * Kp, K, Kp);
    if (wide) { /* blocks of M_BLOCK rows (in L2), over every column block (in L1) */
        for (int64_t mb = 0; mb < M; mb += M_BLOCK) {
            int64_t me = M - mb < M_BLOCK ? M : mb + M_BLOCK;
            for (int64_t n0 = 0; n0 < N; n0 += 16) {
                int64_t n1 = N - n0 < 16 ? N : n0 + 16;
                for (int64_t n = n0; n < n1; n++) widen_row(w + n * K, wf + (n - n0) * Kp, K, Kp);
                /* the block's rows in groups of at most WIDE, as even as can be (8 = 4 + 4) */
                int64_t rows = me - mb, groups = (rows + WIDE - 1) / WIDE;
                for (int64_t g = 0, m0 = mb; g < groups; g++) {
                    int R = (int)(rows / groups + (g < rows % groups));
                    wide_rows(xbuf + m0 * Kp, Kp, wf, R, N, out, m0, out_fp32, n0, n1,
                              g == 0 && n1 + 16 <= N ? (const char *)(w + n1 * K) : 0, K * 2);
                    m0 += R;
                }
            }
        }
        return;
    }
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        int64_t n1 = N - n0 < 16 ? N : n0 + 16;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int R = M - m0 < 4 ? (int)(M - m0) : 4;
            const float *xf = xbuf + m0 * Kp;
            switch (R) {
            case 1: tile1x4(xf, Kp, w, K, wb16, N, out, m0, out_fp32, n0, n1); break;
            case 2: tile2x2(xf, Kp, w, K, wb16, N, out, m0, out_fp32, n0, n1); break;
            case 3: tile3x1(xf, Kp, w, K, wb16, N, out, m0, out_fp32, n0, n1); break;
            default: tile4x1(xf, Kp, w, K, wb16, N, out, m0, out_fp32, n0, n1); break;
            }
        }
    }
}

/* RMSNorm of M rows of D: out[m, d] = (x[m, d] * r) * scale[d], r = 1 / sqrt(sum_d x^2 / D + eps).
 * The squares (fp32, rounded: multiply then add, never fused) are summed in the linear's 16
 * lanes and tree, so a row gets the same bits alone or in a batch, on any CPU. x is fp32 or
 * bf16, out fp32 or bf16; scale NULL means 1. */
void rms_norm(const void *x, int x_bf16, const float *scale, void *out, int out_fp32, int64_t M,
              int64_t D, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xf = (const float *)x + m * D;
        const uint16_t *xh = (const uint16_t *)x + m * D;
        v8f a = {0}, b = {0};
        for (int64_t k = 0; k < D; k += 16) {
            float t[16];
            for (int l = 0; l < 16; l++) {
                float v = 0.0f;
                if (k + l < D) {
                    v = x_bf16 ? bf16_to_f(xh[k + l]) : xf[k + l];
                }
                t[l] = v;
            }
            v8f x0, x1;
            memcpy(&x0, t, sizeof x0);
            memcpy(&x1, t + 8, sizeof x1);
            v8f s0 = x0 * x0, s1 = x1 * x1;
            a = a + s0;
            b = b + s1;
        }
        float r = 1.0f / sqrtf(reduce16(a, b) / (float)D + eps);
        for (int64_t k = 0; k < D; k++) {
            float v = x_bf16 ? bf16_to_f(xh[k]) : xf[k];
            float y = v * r;
            if (scale) y = y * scale[k];
            store(out, out_fp32, m * D + k, y);
        }
    }
}

/* The gated delta rule over one chunk of T new positions (a verify's K+1 tokens), in the
 * chunked (WY) form of model.gdn_chunked, for each sequence b and head h:
 *   q, k L2-normalised (x / sqrt(sum x^2 + eps)), q also scaled by 1/sqrt(Dk);
 *   cum_i = g_0 + ... + g_i;  D_ij = exp(cum_i - cum_j) for j <= i;
 *   [u | w]_i = [beta_i v_i | beta_i exp(cum_i) k_i] - sum_{j<i} beta_i (k_i.k_j) D_ij [u | w]_j
 *   (the unit lower-triangular solve, by forward substitution);
 *   vnew_i = u_i - w_i S0;   out_i = exp(cum_i) q_i S0 + sum_{j<=i} (q_i.k_j) D_ij vnew_j.
 * One call instead of ~30 PyTorch ops per layer; every sum runs in a fixed sequential order
 * (no reassociation: -ffp-contract=off, no fast-math), so the bits depend on nothing but the
 * inputs. qkv: [B, T, C] fp32 (q at column h*Dk, k at Hk + h*Dk, v at 2*Hk + h*Dv, Hk = H*Dk);
 * g, beta: [B, T, H] fp32; s0: [B, H, Dk, Dv]. Writes out [B, T, H, Dv] and, for
 * gdn_chunk_state, kn [B, H, T, Dk] (the normalised keys), vnew [B, H, T, Dv], cum [B, H, T].
 * scratch: T * (2 Dk + Dv) + Dv floats. */
void gdn_chunk(const float *qkv, int64_t C, const float *g, const float *beta, const float *s0,
               float *out, float *kn, float *vnew, float *cum, int64_t B, int64_t T, int64_t H,
               int64_t Dk, int64_t Dv, float eps, float *scratch) {
    const int64_t Hk = H * Dk, W = Dv + Dk;
    const float qscale = 1.0f / sqrtf((float)Dk);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const float *S = s0 + (b * H + h) * Dk * Dv;
            float *K = kn + (b * H + h) * T * Dk, *Vn = vnew + (b * H + h) * T * Dv;
            float *cm = cum + (b * H + h) * T;
            float *Q = scratch, *X = Q + T * Dk, *tmp = X + T * W;
            float c = 0.0f;
            for (int64_t i = 0; i < T; i++) {
                const float *row = qkv + (b * T + i) * C;
                const float *qi = row + h * Dk, *ki = row + Hk + h * Dk;
                float sq = 0.0f, sk = 0.0f;
                for (int64_t d = 0; d < Dk; d++) { sq = sq + qi[d] * qi[d]; sk = sk + ki[d] * ki[d]; }
                float rq = 1.0f / sqrtf(sq + eps), rk = 1.0f / sqrtf(sk + eps);
                for (int64_t d = 0; d < Dk; d++) {
                    Q[i * Dk + d] = (qi[d] * rq) * qscale;
                    K[i * Dk + d] = ki[d] * rk;
                }
                c = i == 0 ? g[(b * T + i) * H + h] : c + g[(b * T + i) * H + h];
                cm[i] = c;
            }
            for (int64_t i = 0; i < T; i++) {
                const float bi = beta[(b * T + i) * H + h], ec = expf(cm[i]);
                const float *vi = qkv + (b * T + i) * C + 2 * Hk + h * Dv;
                float *xi = X + i * W;
                for (int64_t d = 0; d < Dv; d++) xi[d] = vi[d] * bi;
                for (int64_t d = 0; d < Dk; d++) xi[Dv + d] = (K[i * Dk + d] * bi) * ec;
                for (int64_t j = 0; j < i; j++) {
                    float kk = 0.0f;
                    for (int64_t d = 0; d < Dk; d++) kk = kk + K[i * Dk + d] * K[j * Dk + d];
                    float a = (bi * kk) * expf(cm[i] - cm[j]);
                    const float *xj = X + j * W;
                    for (int64_t d = 0; d < W; d++) xi[d] = xi[d] - a * xj[d];
                }
                /* vnew_i = u_i - w_i S0 */
                for (int64_t e = 0; e < Dv; e++) tmp[e] = 0.0f;
                for (int64_t d = 0; d < Dk; d++) {
                    const float wd = xi[Dv + d];
                    for (int64_t e = 0; e < Dv; e++) tmp[e] = tmp[e] + wd * S[d * Dv + e];
                }
                for (int64_t e = 0; e < Dv; e++) Vn[i * Dv + e] = xi[e] - tmp[e];
            }
            for (int64_t i = 0; i < T; i++) {
                const float ec = expf(cm[i]);
                const float *qi = Q + i * Dk;
                float *o = out + ((b * T + i) * H + h) * Dv;
                for (int64_t e = 0; e < Dv; e++) tmp[e] = 0.0f;
                for (int64_t d = 0; d < Dk; d++) {
                    const float qd = qi[d];
                    for (int64_t e = 0; e < Dv; e++) tmp[e] = tmp[e] + qd * S[d * Dv + e];
                }
                for (int64_t e = 0; e < Dv; e++) o[e] = ec * tmp[e];
                for (int64_t j = 0; j <= i; j++) {
                    float qk = 0.0f;
                    for (int64_t d = 0; d < Dk; d++) qk = qk + qi[d] * K[j * Dk + d];
                    float a = qk * expf(cm[i] - cm[j]);
                    for (int64_t e = 0; e < Dv; e++) o[e] = o[e] + a * Vn[j * Dv + e];
                }
            }
        }
    }
}

/* The state after position idx[b] of gdn_chunk's chunk, per sequence b:
 * S = exp(cum_i) S0 + sum_{j<=i} D_ij k_j^T vnew_j (i = idx[b]; summed over j in order).
 * state: [B, H, Dk, Dv]. */
void gdn_chunk_state(const float *s0, const float *kn, const float *vnew, const float *cum,
                     const int64_t *idx, float *state, int64_t B, int64_t T, int64_t H,
                     int64_t Dk, int64_t Dv) {
    for (int64_t b = 0; b < B; b++) {
        const int64_t i = idx[b];
        for (int64_t h = 0; h < H; h++) {
            const float *S = s0 + (b * H + h) * Dk * Dv, *cm = cum + (b * H + h) * T;
            const float *K = kn + (b * H + h) * T * Dk, *Vn = vnew + (b * H + h) * T * Dv;
            float *o = state + (b * H + h) * Dk * Dv;
            const float ec = expf(cm[i]);
            for (int64_t x = 0; x < Dk * Dv; x++) o[x] = ec * S[x];
            for (int64_t j = 0; j <= i; j++) {
                const float dij = expf(cm[i] - cm[j]);
                for (int64_t d = 0; d < Dk; d++) {
                    const float kd = dij * K[j * Dk + d];
                    for (int64_t e = 0; e < Dv; e++) o[d * Dv + e] = o[d * Dv + e] + kd * Vn[j * Dv + e];
                }
            }
        }
    }
}

/* 8 fp32 values rounded to bf16 (nearest even, NaN to the quiet NaN), kept as fp32: to_bf16,
 * lane by lane */
static inline v8f round_bf16_v(v8f f) {
    v8u u;
    memcpy(&u, &f, sizeof u);
    v8u nan = (v8u)((u & 0x7fffffffu) > 0x7f800000u);
    v8u r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    r = (r & ~nan) | (0x7fc00000u & nan);
    memcpy(&f, &r, sizeof f);
    return f;
}
static inline v8f load_f32(const float *p) { v8f f; memcpy(&f, p, sizeof f); return f; }
static inline void store_f32(float *p, v8f f) { memcpy(p, &f, sizeof f); }
static inline void store_bf16(uint16_t *p, v8f f) { /* f already rounded: its high halves */
    v8u u;
    memcpy(&u, &f, sizeof u);
    v8h h = __builtin_convertvector(u >> 16, v8h);
    memcpy(p, &h, sizeof h);
}
static inline v8f same_v(v8f f) { return f; }
static inline v8f splat(float v) { return (v8f){v, v, v, v, v, v, v, v}; } /* (0 + v loses -0) */
static inline float f32_of(float f) { return f; }

/* per position, for each tap t, 8 channels at a time: acc = R(acc + R(R(R(base + d) * xs) * r))
 * (R: round to the op dtype; d one value per group of GS channels, GS a multiple of 8; tap 0
 * has no reach factor and starts acc; xs is the zero padding before the first position) */
#define GROUPED_CONV(NAME, TYPE, LOAD1, LOAD8, R, STORE8)                                          \
    static void NAME(const TYPE *x, const TYPE *base, const TYPE *delta, int side,                \
                     const uint8_t *reach, TYPE *out, int64_t B, int64_t T, int64_t taps,         \
                     int64_t G, int64_t GS, float *acc) {                                         \
        const int64_t H = G * GS;                                                                \
        for (int64_t b = 0; b < B; b++)                                                          \
            for (int64_t i = 0; i < T; i++) {                                                    \
                const int64_t drow = ((b * T + i) * 2 + side) * taps * G;                          \
                for (int64_t t = 0; t < taps; t++) {                                             \
                    const int pad = i < t;                                                       \
                    const TYPE *xs = x + (b * T + (pad ? 0 : i - t)) * H;                        \
                    const v8f r = splat(reach[t * T + i] ? 1.0f : 0.0f);                          \
                    for (int64_t g = 0; g < G; g++) {                                            \
                        const v8f d = splat(LOAD1(delta[drow + t * G + g]));                         \
                        for (int64_t h = g * GS; h < (g + 1) * GS; h += 8) {                     \
                            v8f coef = R(LOAD8(base + t * H + h) + d);                           \
                            v8f term = R(coef * (pad ? (v8f){0} : LOAD8(xs + h)));               \
                            store_f32(acc + h, t == 0 ? term                                     \
                                      : R(load_f32(acc + h) + R(term * r)));                     \
                        }                                                                        \
                    }                                                                            \
                }                                                                                \
                for (int64_t h = 0; h < H; h += 8) STORE8(out + (b * T + i) * H + h, load_f32(acc + h)); \
            }                                                                                    \
    }
GROUPED_CONV(grouped_conv_bf16, uint16_t, bf16_to_f, load_bf16, round_bf16_v, store_bf16)
GROUPED_CONV(grouped_conv_f32, float, f32_of, load_f32, same_v, store_f32)

/* DFlash2's two-tap (any-tap) grouped dynamic convolution along the block, exactly as the
 * PyTorch ops of dflash2.DFlashGroupedConv._convolve round it, one op after another:
 *   c_t = base[t, h] + delta[i, side, t, g]                       (g = h / GS)
 *   out = c_0 * x[i, h];  out = out + (c_t * x[i - t, h]) * reach[t, i]   for t = 1 ..
 * with x[i - t] = +0 before the sequence's first position (the op form's zero padding) and
 * reach 0 / 1 (a product with it, not a select: -0 and NaN come out as the op form's do). In
 * bf16 (bf16 != 0) every op computes in fp32 and rounds to bf16, as PyTorch's CPU bf16 ops do;
 * in fp32 every op is one IEEE fp32 operation. x, out: [B, T, H]; base: [taps, H] (one side of
 * base_kernel); delta: [B, T, 2, taps, G] (kernel_projection's output, both sides);
 * reach: [taps, T] bytes; acc: H floats of scratch. */
void grouped_conv(const void *x, const void *base, const void *delta, int side,
                  const uint8_t *reach, void *out, int bf16, int64_t B, int64_t T, int64_t taps,
                  int64_t G, int64_t GS, float *acc) {
    if (bf16)
        grouped_conv_bf16(x, base, delta, side, reach, out, B, T, taps, G, GS, acc);
    else
        grouped_conv_f32(x, base, delta, side, reach, out, B, T, taps, G, GS, acc);
}

/* DFlash2's candidate selector for N sequences of L slots, the fp32 walk (dflash2.select_drafts):
 * per slot the top K of the V LM-head scores (ties to the lower token id: the first K of a
 * stable descending sort, as dflash2.candidates), then from the anchor the greedy walk: at
 * slot l the candidate c maximising unary[c] + sum_r (A[p, r] * h[l, r]) * B[c, r] (p the
 * token chosen before, the anchor for l = 0; the first maximum on ties). Only the row of
 * edge scores the walk reads is computed. The sum over r runs in order, so its rounding is
 * not the PyTorch einsum's: drafts may differ from the op form at near-ties (drafts only).
 * unary: [N, L, V] fp32; h: [N, L, R] fp32 (hidden_projection of the slots); books A, B:
 * [V, R], bf16 (books_bf16) or fp32; out: [N, L] token ids; scratch: K ints + K floats. */
void dflash2_select(const float *unary, const float *h, const void *pred_book,
                    const void *succ_book, int books_bf16, const int64_t *anchor, int64_t *out,
                    int64_t N, int64_t L, int64_t V, int64_t K, int64_t R, int64_t *ids,
                    float *vals) {
#define BOOK(p, i) (books_bf16 ? bf16_to_f(((const uint16_t *)(p))[i]) : ((const float *)(p))[i])
    for (int64_t n = 0; n < N; n++) {
        int64_t prev = anchor[n];
        for (int64_t l = 0; l < L; l++) {
            const float *u = unary + (n * L + l) * V;
            int64_t count = 0;
            for (int64_t v = 0; v < V; v++) { /* insertion into the K best, stable */
                const float x = u[v];
                if (count == K && !(x > vals[K - 1])) continue;
                int64_t j = count < K ? count++ : K - 1;
                while (j > 0 && x > vals[j - 1]) { vals[j] = vals[j - 1]; ids[j] = ids[j - 1]; j--; }
                vals[j] = x;
                ids[j] = v;
            }
            const float *hl = h + (n * L + l) * R;
            float best = 0.0f;
            int64_t pick = 0;
            for (int64_t c = 0; c < count; c++) {
                float e = 0.0f;
                for (int64_t r = 0; r < R; r++) {
                    const float ah = BOOK(pred_book, prev * R + r) * hl[r];
                    e = e + ah * BOOK(succ_book, ids[c] * R + r);
                }
                const float s = vals[c] + e;
                if (c == 0 || s > best) { best = s; pick = c; }
            }
            prev = ids[pick];
            out[n * L + l] = prev;
        }
    }
#undef BOOK
}
