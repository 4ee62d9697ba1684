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
 *
 * Parts, #included below (one translation unit, as _recorder/_hostpath.c): lanes_c/tlh2.c (version
 * 2's keys, row kernels and whole tree), lanes_c/mlh.c (the mergeable fingerprint of a shard).
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

#include "lanes_c/tlh2.c"

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

#include "lanes_c/mlh.c"

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
