/* The digest's level functions on CPU, exactly (docs/digest.md), with runtime CPU dispatch.
 *
 * Version 1 ("Levels" of version 1): y = x @ W for int8 rows x of at most 1024 bytes and a
 * level's 1024 x 16 int8 weights W, into int32. Without int8 dot-product instructions torch has
 * no fast exact int8 GEMM; here each pair of bytes is sign-extended to int16 and multiplied with
 * a pair of weights by one vpmaddwd, whose int32 sums are exact (|x| <= 128, |w| <= 127, at most
 * 1024 terms: |y| < 2^24), so the result is the same integers as torch._int_mm and the float
 * path, bit for bit.
 *
 * Version 2 ("Levels" of version 2): per row of at most 1024 bytes (zero-padded), two 64-bit
 * multilinear sums a = sum_i A[i] * w_i and b = sum_i B[i] * w_i (mod 2^64) over its 256 words
 * w_i (4 bytes each, read as the balanced value sum_j 256^j * (signed byte j)) with a level's
 * unsigned 32-bit keys A and B. Computed as sum_i A[i] * (u_i ^ 0x80808080) - 0x80808080 *
 * sum_i A[i], u_i the unsigned little-endian word: one 32 x 32 -> 64-bit vpmuludq per word and
 * half, which runs near memory bandwidth (the design goal of version 2).
 *
 * Python hands over addresses of tensors it has checked (detfp_capture/_digest/native.py): x rows
 * of `cols` bytes `stride` bytes apart, the level's weights or keys (layouts below), and y. The
 * GIL is released while a kernel runs. Which instruction set runs is decided at import (the best
 * the CPU has: AVX-512 (F+BW), AVX2, plain C) and can be lowered once by native.py
 * (DETFP_NATIVE_ISA): the results are the same integers on every one; tests hold them to each
 * other.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define K 1024
#define LANES 16

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *ISA_NAMES[] = {"portable", "avx2", "avx512"};
/* The best instruction set this CPU runs, and the one selected (<= best). */
static int isa_best = ISA_PORTABLE;
static int isa_sel = ISA_PORTABLE;

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define DETFP_X86 1
#include <immintrin.h>
#endif

/* ============================================================================= version 1 */

/* Any CPU: the same sums in plain C (the reference the vector kernel is tested against). */
static void lanes_portable(const int8_t *x, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t stride,
                           const int16_t *wp, int32_t *y) {
    for (Py_ssize_t m = 0; m < rows; m++) {
        const int8_t *row = x + m * stride;
        int32_t acc[LANES] = {0};
        for (Py_ssize_t k = 0; k < cols; k++) {
            const int16_t *w = wp + (k >> 1) * 2 * LANES + (k & 1);
            int32_t v = row[k];
            for (int l = 0; l < LANES; l++) acc[l] += v * w[2 * l];
        }
        memcpy(y + m * LANES, acc, sizeof(acc));
    }
}

#ifdef DETFP_X86

/* Rows per pass: 6 rows x 2 accumulators + 2 weight registers + 1 broadcast fill the 16 ymm
 * registers (measured on an AVX2-only EPYC: 6 rows 2.3 GB/s, 4 rows 1.5-1.8, 7 rows 1.7). */
#define ROWS 6

__attribute__((target("avx2"))) static void lanes_avx2(const int8_t *x, Py_ssize_t rows, Py_ssize_t cols,
                                                       Py_ssize_t stride, const int16_t *wp, int32_t *y) {
    Py_ssize_t pairs = (cols + 1) / 2;
    /* This pass's rows sign-extended to int16 (zero past `cols`, so an odd last pair is exact). */
    int16_t buf[ROWS][K + 2] __attribute__((aligned(32)));
    for (Py_ssize_t m = 0; m < rows; m += ROWS) {
        int nr = rows - m < ROWS ? (int)(rows - m) : ROWS;
        for (int r = 0; r < ROWS; r++) {
            if (r >= nr) {
                memset(buf[r], 0, sizeof(buf[r]));
                continue;
            }
            const int8_t *src = x + (m + r) * stride;
            Py_ssize_t k = 0;
            for (; k + 16 <= cols; k += 16) {
                __m128i b = _mm_loadu_si128((const __m128i *)(src + k));
                _mm256_storeu_si256((__m256i *)(buf[r] + k), _mm256_cvtepi8_epi16(b));
            }
            for (; k < cols; k++) buf[r][k] = src[k];
            buf[r][cols] = 0;
        }
        __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
        __m256i a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
        for (Py_ssize_t p = 0; p < pairs; p++) {
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(wp + p * 2 * LANES));
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(wp + p * 2 * LANES + LANES));
            int32_t pr;
            __m256i b;
#define DETFP_ROW(r, lo, hi)                               \
    memcpy(&pr, buf[r] + 2 * p, sizeof(pr));               \
    b = _mm256_set1_epi32(pr);                             \
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(b, w0));   \
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(b, w1));
            DETFP_ROW(0, a00, a01)
            DETFP_ROW(1, a10, a11)
            DETFP_ROW(2, a20, a21)
            DETFP_ROW(3, a30, a31)
            DETFP_ROW(4, a40, a41)
            DETFP_ROW(5, a50, a51)
#undef DETFP_ROW
        }
        __m256i acc[ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
        for (int r = 0; r < nr; r++) {
            _mm256_storeu_si256((__m256i *)(y + (m + r) * LANES), acc[r][0]);
            _mm256_storeu_si256((__m256i *)(y + (m + r) * LANES + 8), acc[r][1]);
        }
    }
}
#endif

/* ============================================================================= version 2 */

/* A level's keys as Python packs them (native.pack_keys), byte offsets into one buffer:
 * A: 272 uint32 (A[0..255], zeros after); A1: A shifted by one word (A1[i] = A[i + 1], so that
 * a vector load puts the odd words' keys in the low halves of its 64-bit lanes, where vpmuludq
 * reads them); B, B1 likewise; CA, CB: 264 uint64, CA[n] = 0x80808080 * (A[0] + ... + A[n-1])
 * mod 2^64 (the bias of the first n words, subtracted once per row). */
#define KEY_WORDS 272
#define OFF_A 0
#define OFF_A1 (OFF_A + 4 * KEY_WORDS)
#define OFF_B (OFF_A1 + 4 * KEY_WORDS)
#define OFF_B1 (OFF_B + 4 * KEY_WORDS)
#define OFF_CA (OFF_B1 + 4 * KEY_WORDS)
#define OFF_CB (OFF_CA + 8 * 264)
#define KEYS_BYTES (OFF_CB + 8 * 264)
#define BIAS 0x80808080u

typedef struct {
    const uint32_t *a, *a1, *b, *b1;
    const uint64_t *ca, *cb;
} keys2;

static keys2 unpack(const uint8_t *base) {
    keys2 k = {(const uint32_t *)(base + OFF_A), (const uint32_t *)(base + OFF_A1),
               (const uint32_t *)(base + OFF_B), (const uint32_t *)(base + OFF_B1),
               (const uint64_t *)(base + OFF_CA), (const uint64_t *)(base + OFF_CB)};
    return k;
}

/* Any CPU: word by word (the reference the vector kernels are tested against). */
static void tlh2_portable(const uint8_t *x, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t stride, keys2 k,
                          uint64_t *y) {
    Py_ssize_t n = (cols + 3) / 4;
    for (Py_ssize_t m = 0; m < rows; m++) {
        const uint8_t *row = x + m * stride;
        uint64_t a = 0, b = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t have = cols - 4 * i < 4 ? cols - 4 * i : 4;
            uint32_t w = 0;
            for (Py_ssize_t j = 0; j < have; j++) w |= (uint32_t)row[4 * i + j] << (8 * j);
            w ^= BIAS;
            a += (uint64_t)k.a[i] * w;
            b += (uint64_t)k.b[i] * w;
        }
        y[2 * m] = a - k.ca[n];
        y[2 * m + 1] = b - k.cb[n];
    }
}

#ifdef DETFP_X86
/* Rows per pass: the four key vectors of a word position are loaded once for 4 rows (measured on
 * a Xeon with AVX-512: 1.5x the one-row loop on cache-resident rows); leftover rows one by one.
 * A pass reads 4 short streams (a row each), too short for the hardware prefetcher to follow on
 * 4 KiB pages: the rows two passes ahead are prefetched (6.1 -> 9-10 GB/s on 64 MiB from memory, the
 * same Xeon, where a single read pass runs at 11-14 GB/s). */
#define R2 4

__attribute__((target("avx2"))) static inline uint64_t hsum_avx2(__m256i v) {
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (uint64_t)_mm_cvtsi128_si64(s) + (uint64_t)_mm_extract_epi64(s, 1);
}

/* One vector of words into a row's two accumulators: even words times the even keys, odd words
 * (shifted into the low halves) times the odd keys. */
#define STEP_AVX2(w, acc_a, acc_b)                                                                   \
    do {                                                                                             \
        __m256i u_ = _mm256_xor_si256((w), bias), o_ = _mm256_srli_epi64(u_, 32);                    \
        acc_a = _mm256_add_epi64(acc_a, _mm256_add_epi64(_mm256_mul_epu32(u_, ka), _mm256_mul_epu32(o_, ka1))); \
        acc_b = _mm256_add_epi64(acc_b, _mm256_add_epi64(_mm256_mul_epu32(u_, kb), _mm256_mul_epu32(o_, kb1))); \
    } while (0)

/* Vector v of a row: 32 bytes, or the row's last `tail` bytes followed by zeros. */
__attribute__((target("avx2"))) static inline __m256i load_avx2(const uint8_t *row, Py_ssize_t v, Py_ssize_t full,
                                                                Py_ssize_t tail) {
    if (v < full) return _mm256_loadu_si256((const __m256i *)(row + 32 * v));
    uint8_t t[32] = {0};
    memcpy(t, row + 32 * v, (size_t)tail);
    return _mm256_loadu_si256((const __m256i *)t);
}

__attribute__((target("avx2"))) static void tlh2_avx2(const uint8_t *x, Py_ssize_t rows, Py_ssize_t cols,
                                                     Py_ssize_t stride, keys2 k, uint64_t *y) {
    const __m256i bias = _mm256_set1_epi32((int)BIAS);
    Py_ssize_t full = cols / 32, tail = cols % 32, nv = full + (tail != 0);
    uint64_t ca = k.ca[8 * nv], cb = k.cb[8 * nv];
    Py_ssize_t m = 0;
    for (; m + R2 <= rows; m += R2) {
        const uint8_t *p0 = x + m * stride, *p1 = p0 + stride, *p2 = p1 + stride, *p3 = p2 + stride;
        Py_ssize_t pf = m + 3 * R2 <= rows ? 2 * R2 * stride : 0; /* prefetch distance: two passes */
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (Py_ssize_t v = 0; v < nv; v++) {
            __m256i ka = _mm256_loadu_si256((const __m256i *)(k.a + 8 * v));
            __m256i ka1 = _mm256_loadu_si256((const __m256i *)(k.a1 + 8 * v));
            __m256i kb = _mm256_loadu_si256((const __m256i *)(k.b + 8 * v));
            __m256i kb1 = _mm256_loadu_si256((const __m256i *)(k.b1 + 8 * v));
            if (!(v & 1)) { /* the next pass's rows, a cache line each per two vectors */
                _mm_prefetch((const char *)(p0 + pf + 32 * v), _MM_HINT_T0);
                _mm_prefetch((const char *)(p1 + pf + 32 * v), _MM_HINT_T0);
                _mm_prefetch((const char *)(p2 + pf + 32 * v), _MM_HINT_T0);
                _mm_prefetch((const char *)(p3 + pf + 32 * v), _MM_HINT_T0);
            }
            STEP_AVX2(load_avx2(p0, v, full, tail), a0, b0);
            STEP_AVX2(load_avx2(p1, v, full, tail), a1, b1);
            STEP_AVX2(load_avx2(p2, v, full, tail), a2, b2);
            STEP_AVX2(load_avx2(p3, v, full, tail), a3, b3);
        }
        y[2 * m] = hsum_avx2(a0) - ca, y[2 * m + 1] = hsum_avx2(b0) - cb;
        y[2 * m + 2] = hsum_avx2(a1) - ca, y[2 * m + 3] = hsum_avx2(b1) - cb;
        y[2 * m + 4] = hsum_avx2(a2) - ca, y[2 * m + 5] = hsum_avx2(b2) - cb;
        y[2 * m + 6] = hsum_avx2(a3) - ca, y[2 * m + 7] = hsum_avx2(b3) - cb;
    }
    for (; m < rows; m++) {
        const uint8_t *p0 = x + m * stride;
        __m256i a0 = _mm256_setzero_si256(), b0 = a0;
        for (Py_ssize_t v = 0; v < nv; v++) {
            __m256i ka = _mm256_loadu_si256((const __m256i *)(k.a + 8 * v));
            __m256i ka1 = _mm256_loadu_si256((const __m256i *)(k.a1 + 8 * v));
            __m256i kb = _mm256_loadu_si256((const __m256i *)(k.b + 8 * v));
            __m256i kb1 = _mm256_loadu_si256((const __m256i *)(k.b1 + 8 * v));
            STEP_AVX2(load_avx2(p0, v, full, tail), a0, b0);
        }
        y[2 * m] = hsum_avx2(a0) - ca, y[2 * m + 1] = hsum_avx2(b0) - cb;
    }
}
#undef STEP_AVX2

/* The sum of a vector's eight uint64 lanes, wrapping (not the intrinsic _mm512_reduce_add_epi64,
 * whose scalar part adds signed long longs: overflow there is undefined behaviour). */
__attribute__((target("avx512f,avx512bw"))) static inline uint64_t hsum_avx512(__m512i v) {
    __m256i h = _mm256_add_epi64(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    return (uint64_t)_mm_cvtsi128_si64(s) + (uint64_t)_mm_extract_epi64(s, 1);
}

#define STEP_AVX512(w, acc_a, acc_b)                                                                 \
    do {                                                                                             \
        __m512i u_ = _mm512_xor_si512((w), bias), o_ = _mm512_srli_epi64(u_, 32);                    \
        acc_a = _mm512_add_epi64(acc_a, _mm512_add_epi64(_mm512_mul_epu32(u_, ka), _mm512_mul_epu32(o_, ka1))); \
        acc_b = _mm512_add_epi64(acc_b, _mm512_add_epi64(_mm512_mul_epu32(u_, kb), _mm512_mul_epu32(o_, kb1))); \
    } while (0)

/* Vector v of a row: 64 bytes, or (masked: neither read nor counted) its last `tail` bytes. */
#define LOAD_AVX512(row, v) ((v) < full ? _mm512_loadu_si512((row) + 64 * (v)) : _mm512_maskz_loadu_epi8(tmask, (row) + 64 * (v)))

__attribute__((target("avx512f,avx512bw"))) static void tlh2_avx512(const uint8_t *x, Py_ssize_t rows,
                                                                   Py_ssize_t cols, Py_ssize_t stride, keys2 k,
                                                                   uint64_t *y) {
    const __m512i bias = _mm512_set1_epi32((int)BIAS);
    Py_ssize_t full = cols / 64, tail = cols % 64, nv = full + (tail != 0);
    __mmask64 tmask = tail ? (((__mmask64)1 << tail) - 1) : 0;
    uint64_t ca = k.ca[16 * nv], cb = k.cb[16 * nv];
    Py_ssize_t m = 0;
    for (; m + R2 <= rows; m += R2) {
        const uint8_t *p0 = x + m * stride, *p1 = p0 + stride, *p2 = p1 + stride, *p3 = p2 + stride;
        Py_ssize_t pf = m + 3 * R2 <= rows ? 2 * R2 * stride : 0; /* prefetch distance: two passes */
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (Py_ssize_t v = 0; v < nv; v++) {
            __m512i ka = _mm512_loadu_si512(k.a + 16 * v), ka1 = _mm512_loadu_si512(k.a1 + 16 * v);
            __m512i kb = _mm512_loadu_si512(k.b + 16 * v), kb1 = _mm512_loadu_si512(k.b1 + 16 * v);
            _mm_prefetch((const char *)(p0 + pf + 64 * v), _MM_HINT_T0); /* the next pass's rows */
            _mm_prefetch((const char *)(p1 + pf + 64 * v), _MM_HINT_T0);
            _mm_prefetch((const char *)(p2 + pf + 64 * v), _MM_HINT_T0);
            _mm_prefetch((const char *)(p3 + pf + 64 * v), _MM_HINT_T0);
            STEP_AVX512(LOAD_AVX512(p0, v), a0, b0);
            STEP_AVX512(LOAD_AVX512(p1, v), a1, b1);
            STEP_AVX512(LOAD_AVX512(p2, v), a2, b2);
            STEP_AVX512(LOAD_AVX512(p3, v), a3, b3);
        }
        y[2 * m] = hsum_avx512(a0) - ca, y[2 * m + 1] = hsum_avx512(b0) - cb;
        y[2 * m + 2] = hsum_avx512(a1) - ca, y[2 * m + 3] = hsum_avx512(b1) - cb;
        y[2 * m + 4] = hsum_avx512(a2) - ca, y[2 * m + 5] = hsum_avx512(b2) - cb;
        y[2 * m + 6] = hsum_avx512(a3) - ca, y[2 * m + 7] = hsum_avx512(b3) - cb;
    }
    for (; m < rows; m++) {
        const uint8_t *p0 = x + m * stride;
        __m512i a0 = _mm512_setzero_si512(), b0 = a0;
        for (Py_ssize_t v = 0; v < nv; v++) {
            __m512i ka = _mm512_loadu_si512(k.a + 16 * v), ka1 = _mm512_loadu_si512(k.a1 + 16 * v);
            __m512i kb = _mm512_loadu_si512(k.b + 16 * v), kb1 = _mm512_loadu_si512(k.b1 + 16 * v);
            STEP_AVX512(LOAD_AVX512(p0, v), a0, b0);
        }
        y[2 * m] = hsum_avx512(a0) - ca, y[2 * m + 1] = hsum_avx512(b0) - cb;
    }
}
#undef STEP_AVX512
#undef LOAD_AVX512
#endif

/* The level function on `rows` rows with instruction set `isa`. */
static void tlh2_rows(int isa, const uint8_t *x, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t stride, keys2 k,
                      uint64_t *y) {
#ifdef DETFP_X86
    if (isa == ISA_AVX512) {
        tlh2_avx512(x, rows, cols, stride, k, y);
        return;
    }
    if (isa == ISA_AVX2) {
        tlh2_avx2(x, rows, cols, stride, k, y);
        return;
    }
#endif
    tlh2_portable(x, rows, cols, stride, k, y);
}

/* ============================================================================= mergeable (mlh) */

/* The mergeable fingerprint (docs/digest.md, "Mergeable fingerprints"): over a logical tensor's
 * global byte stream, ma = sum_r Ra(r) * a_r and mb = sum_r Rb(r) * b_r (mod 2^64), a_r/b_r the
 * version-2 level-0 sums of global row r (1024 bytes, keys of level 0), Ra/Rb odd 64-bit row keys
 * from splitmix64. Linear in the words, so a shard computes its part from its own bytes placed at
 * their global offsets (rows it covers partly: the other bytes are zeros), and the parts of every
 * shard add up, modulo 2^64, to the whole tensor's sums. */
#define MLH_GAMMA 0x9E3779B97F4A7C15ull
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
/* Row r's keys: the (r + 1)-th output of splitmix64 from the seed, made odd. */
static inline uint64_t mlh_row_key(uint64_t seed, uint64_t r) { return mix64(seed + (r + 1) * MLH_GAMMA) | 1u; }

typedef struct {
    uint64_t seed_a, seed_b;
    uint64_t acc[2];
} mlh_acc;

/* Rows' level-0 sums y (2 per row) of the global rows r0, r0 + 1, ... into the accumulator. */
static void mlh_add_rows(mlh_acc *m, const uint64_t *y, Py_ssize_t rows, uint64_t r0) {
    for (Py_ssize_t i = 0; i < rows; i++) {
        m->acc[0] += mlh_row_key(m->seed_a, r0 + (uint64_t)i) * y[2 * i];
        m->acc[1] += mlh_row_key(m->seed_b, r0 + (uint64_t)i) * y[2 * i + 1];
    }
}

/* Most levels a tree may have (8: up to 64^7 rows of 1024 bytes, 2^52 bytes). */
#define MAX_LEVELS 8
#define FANIN 64

/* The whole tree of n contiguous bytes (version 2, "Levels"): the root's two sums into out.
 * Level 0 runs in chunks whose outputs fill one row of level 1 (64 outputs = 1024 bytes) in a
 * small buffer; a full row of a level is hashed at once into the next level's buffer, and at the
 * end each level's partial row is hashed bottom-up: the same rows, in the same order, as level by
 * level, without writing any level to memory. keys: `nkeys` levels' packed keys, one after the
 * other. Returns 0, or -1 when the tree needs more levels than `nkeys`. */
static int tlh2_tree_acc(int isa, const uint8_t *x, Py_ssize_t n, const uint8_t *keys, int nkeys, uint64_t out[2],
                         mlh_acc *m) {
    Py_ssize_t rows_at[MAX_LEVELS];
    int top = 0;
    rows_at[0] = n > 0 ? (n + K - 1) / K : 1;
    while (rows_at[top] > 1) {
        if (top + 1 >= MAX_LEVELS) return -1;
        rows_at[top + 1] = (rows_at[top] + FANIN - 1) / FANIN;
        top++;
    }
    if (top >= nkeys) return -1;
    if (top == 0) {
        tlh2_rows(isa, x, 1, n, n, unpack(keys), out);
        if (m != NULL) mlh_add_rows(m, out, 1, 0);
        return 0;
    }
    uint64_t buf[MAX_LEVELS][2 * FANIN]; /* level l's input row being filled: FANIN outputs of l - 1 */
    int count[MAX_LEVELS] = {0};
    Py_ssize_t full = n / K, tail = n % K;
#define CARRY(from)                                                                                           \
    for (int l_ = (from); l_ < top && count[l_] == FANIN; l_++) {                                           \
        tlh2_rows(isa, (const uint8_t *)buf[l_], 1, K, K, unpack(keys + (size_t)l_ * KEYS_BYTES),            \
                  buf[l_ + 1] + 2 * count[l_ + 1]);                                                        \
        count[l_ + 1]++;                                                                                   \
        count[l_] = 0;                                                                                     \
    }
    for (Py_ssize_t r = 0; r < full;) {
        Py_ssize_t take = full - r < FANIN - count[1] ? full - r : FANIN - count[1];
        tlh2_rows(isa, x + r * K, take, K, K, unpack(keys), buf[1] + 2 * count[1]);
        if (m != NULL) mlh_add_rows(m, buf[1] + 2 * count[1], take, (uint64_t)r);
        count[1] += (int)take;
        r += take;
        CARRY(1)
    }
    if (tail) {
        tlh2_rows(isa, x + full * K, 1, tail, tail, unpack(keys), buf[1] + 2 * count[1]);
        if (m != NULL) mlh_add_rows(m, buf[1] + 2 * count[1], 1, (uint64_t)full);
        count[1]++;
        CARRY(1)
    }
    for (int l = 1; l < top; l++) {
        if (count[l] == 0) continue;
        Py_ssize_t bytes = (Py_ssize_t)count[l] * 16;
        tlh2_rows(isa, (const uint8_t *)buf[l], 1, bytes, bytes, unpack(keys + (size_t)l * KEYS_BYTES),
                  buf[l + 1] + 2 * count[l + 1]);
        count[l + 1]++;
        count[l] = 0;
        CARRY(l + 1)
    }
#undef CARRY
    Py_ssize_t bytes = (Py_ssize_t)count[top] * 16;
    tlh2_rows(isa, (const uint8_t *)buf[top], 1, bytes, bytes, unpack(keys + (size_t)top * KEYS_BYTES), out);
    return 0;
}

/* The tree alone (the record path's capsule takes this one). */
static int tlh2_tree(int isa, const uint8_t *x, Py_ssize_t n, const uint8_t *keys, int nkeys, uint64_t out[2]) {
    return tlh2_tree_acc(isa, x, n, keys, nkeys, out, NULL);
}

/* ============================================================================= mergeable (mlh): shards */

/* Rows per call of the level function on the full rows of a run (its outputs on the stack). */
#define MLH_CHUNK 64

/* One run: n contiguous local bytes whose first byte is global byte g. A row the run covers in
 * part is hashed from a zeroed row holding the run's bytes at their places (the words the other
 * shards hold are zeros there); its full rows are read where they lie. */
static void mlh_run(int isa, const uint8_t *x, Py_ssize_t n, uint64_t g, keys2 k, mlh_acc *m) {
    uint64_t y[2 * MLH_CHUNK];
    uint64_t h = g % K;
    if (n > 0 && h != 0) {
        uint8_t row[K];
        Py_ssize_t take = (Py_ssize_t)(K - h) < n ? (Py_ssize_t)(K - h) : n;
        memset(row, 0, K);
        memcpy(row + h, x, (size_t)take);
        tlh2_rows(isa, row, 1, (Py_ssize_t)h + take, K, k, y);
        mlh_add_rows(m, y, 1, g / K);
        x += take, n -= take, g += (uint64_t)take;
    }
    while (n >= K) {
        Py_ssize_t rows = n / K < MLH_CHUNK ? n / K : MLH_CHUNK;
        tlh2_rows(isa, x, rows, K, K, k, y);
        mlh_add_rows(m, y, rows, g / K);
        x += rows * K, n -= rows * K, g += (uint64_t)rows * K;
    }
    if (n > 0) {
        tlh2_rows(isa, x, 1, n, n, k, y);
        mlh_add_rows(m, y, 1, g / K);
    }
}

#define MLH_MAX_DIMS 16

/* A shard's runs: local bytes are `count` runs of run_bytes each, in order; run j's global byte
 * offset is base + sum_d i_d * gstride[d], (i_0, ..., i_{nd-1}) the row-major index of j over
 * `sizes` (nd <= MLH_MAX_DIMS; nd = 0: one run). */
static void mlh_box(int isa, const uint8_t *x, int nd, const Py_ssize_t *sizes, const uint64_t *gstride,
                    Py_ssize_t run_bytes, uint64_t base, keys2 k, mlh_acc *m) {
    Py_ssize_t idx[MLH_MAX_DIMS] = {0};
    for (int d = 0; d < nd; d++)
        if (sizes[d] == 0) return;
    uint64_t g = base;
    for (;;) {
        mlh_run(isa, x, run_bytes, g, k, m);
        x += run_bytes;
        int d = nd - 1;
        while (d >= 0) {
            if (++idx[d] < sizes[d]) {
                g += gstride[d];
                break;
            }
            g -= gstride[d] * (uint64_t)(sizes[d] - 1);
            idx[d] = 0;
            d--;
        }
        if (d < 0) return;
    }
}

/* ============================================================================= Python */

static int parse_rows(unsigned long long xa, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t stride,
                      unsigned long long wa, unsigned long long ya) {
    if (rows < 0 || cols < 0 || cols > K || (rows > 1 && stride < cols)) {
        PyErr_Format(PyExc_ValueError, "bad shape rows=%zd cols=%zd stride=%zd", rows, cols, stride);
        return 0;
    }
    if (rows > 0 && (xa == 0 || wa == 0 || ya == 0)) {
        PyErr_SetString(PyExc_ValueError, "null address");
        return 0;
    }
    return 1;
}

static int pick_isa(int want) {
    if (want < 0) return isa_sel;
    if (want > isa_best) {
        PyErr_Format(PyExc_ValueError, "instruction set %s is not available on this CPU (best: %s)",
                     want <= ISA_AVX512 ? ISA_NAMES[want] : "?", ISA_NAMES[isa_best]);
        return -1;
    }
    return want;
}

static PyObject *lanes(PyObject *self, PyObject *args) {
    unsigned long long xa, wa, ya;
    Py_ssize_t rows, cols, stride;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "KnnnKK|p", &xa, &rows, &cols, &stride, &wa, &ya, &portable)) return NULL;
    if (!parse_rows(xa, rows, cols, stride, wa, ya)) return NULL;
    const int8_t *x = (const int8_t *)(uintptr_t)xa;
    const int16_t *wp = (const int16_t *)(uintptr_t)wa;
    int32_t *y = (int32_t *)(uintptr_t)ya;
    int use = portable ? ISA_PORTABLE : isa_sel;
    Py_BEGIN_ALLOW_THREADS
#ifdef DETFP_X86
    if (use >= ISA_AVX2) lanes_avx2(x, rows, cols, stride, wp, y);
    else
#endif
        lanes_portable(x, rows, cols, stride, wp, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *tlh2(PyObject *self, PyObject *args) {
    unsigned long long xa, ka, ya;
    Py_ssize_t rows, cols, stride;
    int want = -1;
    if (!PyArg_ParseTuple(args, "KnnnKK|i", &xa, &rows, &cols, &stride, &ka, &ya, &want)) return NULL;
    if (!parse_rows(xa, rows, cols, stride, ka, ya)) return NULL;
    int use = pick_isa(want);
    if (use < 0) return NULL;
    const uint8_t *x = (const uint8_t *)(uintptr_t)xa;
    keys2 k = unpack((const uint8_t *)(uintptr_t)ka);
    uint64_t *y = (uint64_t *)(uintptr_t)ya;
    Py_BEGIN_ALLOW_THREADS
    tlh2_rows(use, x, rows, cols, stride, k, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *tlh2_root(PyObject *self, PyObject *args) {
    unsigned long long xa, ka, ya;
    Py_ssize_t n;
    int nkeys, want = -1, rc;
    if (!PyArg_ParseTuple(args, "KnKiK|i", &xa, &n, &ka, &nkeys, &ya, &want)) return NULL;
    if (n < 0 || nkeys < 1 || (n > 0 && xa == 0) || ka == 0 || ya == 0) {
        PyErr_Format(PyExc_ValueError, "tlh2_root: bad arguments n=%zd nkeys=%d", n, nkeys);
        return NULL;
    }
    int use = pick_isa(want);
    if (use < 0) return NULL;
    const uint8_t *x = (const uint8_t *)(uintptr_t)xa;
    const uint8_t *keys = (const uint8_t *)(uintptr_t)ka;
    uint64_t *y = (uint64_t *)(uintptr_t)ya;
    Py_BEGIN_ALLOW_THREADS
    rc = tlh2_tree(use, x, n, keys, nkeys, y);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_Format(PyExc_ValueError, "tlh2_root: %zd bytes need more than %d levels of keys", n, nkeys);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *tlh2_root_mlh(PyObject *self, PyObject *args) {
    unsigned long long xa, ka, ya, seed_a, seed_b;
    Py_ssize_t n;
    int nkeys, want = -1, rc;
    if (!PyArg_ParseTuple(args, "KnKiKKK|i", &xa, &n, &ka, &nkeys, &ya, &seed_a, &seed_b, &want)) return NULL;
    if (n < 0 || nkeys < 1 || (n > 0 && xa == 0) || ka == 0 || ya == 0) {
        PyErr_Format(PyExc_ValueError, "tlh2_root_mlh: bad arguments n=%zd nkeys=%d", n, nkeys);
        return NULL;
    }
    int use = pick_isa(want);
    if (use < 0) return NULL;
    mlh_acc m = {seed_a, seed_b, {0, 0}};
    const uint8_t *x = (const uint8_t *)(uintptr_t)xa;
    const uint8_t *keys = (const uint8_t *)(uintptr_t)ka;
    uint64_t *y = (uint64_t *)(uintptr_t)ya;
    Py_BEGIN_ALLOW_THREADS
    rc = tlh2_tree_acc(use, x, n, keys, nkeys, y, &m);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_Format(PyExc_ValueError, "tlh2_root_mlh: %zd bytes need more than %d levels of keys", n, nkeys);
        return NULL;
    }
    return Py_BuildValue("(KK)", (unsigned long long)m.acc[0], (unsigned long long)m.acc[1]);
}

static PyObject *mlh(PyObject *self, PyObject *args) {
    unsigned long long xa, ka, base, seed_a, seed_b;
    Py_ssize_t run_bytes;
    PyObject *sizes_o, *strides_o;
    int want = -1;
    if (!PyArg_ParseTuple(args, "KnO!O!KKKK|i", &xa, &run_bytes, &PyTuple_Type, &sizes_o, &PyTuple_Type, &strides_o,
                          &base, &ka, &seed_a, &seed_b, &want))
        return NULL;
    Py_ssize_t nd = PyTuple_GET_SIZE(sizes_o);
    if (nd > MLH_MAX_DIMS || PyTuple_GET_SIZE(strides_o) != nd || run_bytes < 0 || ka == 0) {
        PyErr_Format(PyExc_ValueError, "mlh: bad arguments (%zd dims, run of %zd bytes)", nd, run_bytes);
        return NULL;
    }
    Py_ssize_t sizes[MLH_MAX_DIMS];
    uint64_t gstride[MLH_MAX_DIMS];
    Py_ssize_t runs = 1;
    for (Py_ssize_t d = 0; d < nd; d++) {
        sizes[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes_o, d));
        gstride[d] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(strides_o, d));
        if (PyErr_Occurred()) return NULL;
        if (sizes[d] < 0) {
            PyErr_SetString(PyExc_ValueError, "mlh: negative size");
            return NULL;
        }
        runs *= sizes[d];
    }
    if (runs > 0 && run_bytes > 0 && xa == 0) {
        PyErr_SetString(PyExc_ValueError, "mlh: null address");
        return NULL;
    }
    int use = pick_isa(want);
    if (use < 0) return NULL;
    mlh_acc m = {seed_a, seed_b, {0, 0}};
    const uint8_t *x = (const uint8_t *)(uintptr_t)xa;
    keys2 k = unpack((const uint8_t *)(uintptr_t)ka);
    Py_BEGIN_ALLOW_THREADS
    if (run_bytes > 0) mlh_box(use, x, (int)nd, sizes, gstride, run_bytes, base, k, &m);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(KK)", (unsigned long long)m.acc[0], (unsigned long long)m.acc[1]);
}

static PyObject *isas(PyObject *self, PyObject *unused) {
    PyObject *out = PyTuple_New(isa_best + 1);
    if (out == NULL) return NULL;
    for (int i = 0; i <= isa_best; i++) PyTuple_SET_ITEM(out, i, PyUnicode_FromString(ISA_NAMES[i]));
    return out;
}

static PyObject *select_isa(PyObject *self, PyObject *args) {
    int want;
    if (!PyArg_ParseTuple(args, "i", &want)) return NULL;
    if (want < 0 || pick_isa(want) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "unknown instruction set");
        return NULL;
    }
    isa_sel = want;
    Py_RETURN_NONE;
}

static PyObject *kernel(PyObject *self, PyObject *unused) { return PyUnicode_FromString(ISA_NAMES[isa_sel]); }

static PyObject *keys_bytes(PyObject *self, PyObject *unused) { return PyLong_FromLong(KEYS_BYTES); }

static PyMethodDef methods[] = {
    {"lanes", lanes, METH_VARARGS,
     "lanes(x_addr, rows, cols, stride, wpairs_addr, y_addr, portable=False): version 1, y = x @ W, exact int32."},
    {"tlh2", tlh2, METH_VARARGS,
     "tlh2(x_addr, rows, cols, stride, keys_addr, y_addr, isa=-1): version 2, (rows, 2) uint64 per level."},
    {"tlh2_root", tlh2_root, METH_VARARGS,
     "tlh2_root(x_addr, nbytes, keys_addr, nlevels, y_addr, isa=-1): version 2, the root's two uint64 sums of n "
     "contiguous bytes through every level (keys: nlevels levels' packed keys, one after the other)."},
    {"tlh2_root_mlh", tlh2_root_mlh, METH_VARARGS,
     "tlh2_root_mlh(x_addr, nbytes, keys_addr, nlevels, y_addr, seed_a, seed_b, isa=-1): tlh2_root, and the same "
     "bytes' mergeable fingerprint sums (ma, mb) from its level 0, in the same pass."},
    {"mlh", mlh, METH_VARARGS,
     "mlh(x_addr, run_bytes, sizes, gstrides, base, keys_addr, seed_a, seed_b, isa=-1): the mergeable "
     "fingerprint's part (ma, mb) of a shard's contiguous bytes, runs of run_bytes at global byte offsets "
     "base + sum_d i_d * gstrides[d] over the row-major index of sizes (level-0 keys)."},
    {"isas", isas, METH_NOARGS, "The instruction sets this CPU runs, worst first: ('portable', 'avx2', ...)."},
    {"select", select_isa, METH_VARARGS, "select(i): run instruction set isas()[i] from now on."},
    {"kernel", kernel, METH_NOARGS, "The instruction set the kernels run: 'avx512', 'avx2' or 'portable'."},
    {"keys_bytes", keys_bytes, METH_NOARGS, "Size in bytes of one level's packed version-2 keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lanes", "The digest's level functions on CPU, exactly.",
                                    -1, methods};

/* The best instruction set this CPU runs (the compiler's cpuid checks, OS support included). */
static int detect_isa(void) {
    int best = ISA_PORTABLE;
#ifdef DETFP_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) best = ISA_AVX2;
    if (best == ISA_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) best = ISA_AVX512;
#endif
    return best;
}

/* The version-2 tree for other native code (the capture's record path, _recorder/_hostpath.c):
 * a capsule named "detfp_capture._digest._lanes.TREE" holding this table. */
typedef struct {
    int (*tree)(int isa, const uint8_t *x, Py_ssize_t n, const uint8_t *keys, int nkeys, uint64_t out[2]);
    int (*pick)(int want);
    /* The tree and, from its level 0, the mergeable sums of the same bytes (seeds in, sums out). */
    int (*tree_mlh)(int isa, const uint8_t *x, Py_ssize_t n, const uint8_t *keys, int nkeys, uint64_t out[2],
                    const uint64_t seeds[2], uint64_t mlh[2]);
} DetfpTreeApi;
static int tree_mlh(int isa, const uint8_t *x, Py_ssize_t n, const uint8_t *keys, int nkeys, uint64_t out[2],
                    const uint64_t seeds[2], uint64_t mlh[2]) {
    mlh_acc m = {seeds[0], seeds[1], {0, 0}};
    int rc = tlh2_tree_acc(isa, x, n, keys, nkeys, out, &m);
    mlh[0] = m.acc[0], mlh[1] = m.acc[1];
    return rc;
}
static DetfpTreeApi tree_api = {tlh2_tree, pick_isa, tree_mlh};

PyMODINIT_FUNC PyInit__lanes(void) {
    isa_sel = isa_best = detect_isa();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *cap = PyCapsule_New(&tree_api, "detfp_capture._digest._lanes.TREE", NULL);
    if (cap == NULL || PyModule_AddObject(m, "TREE", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
