/* Part of _lanes.c (one translation unit, #included there): version 2's keys, its row kernels
 * (plain C, AVX2, AVX-512), the mergeable fingerprint's accumulator and the whole tree. */

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

