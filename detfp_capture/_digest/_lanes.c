/* The digest's level GEMM on CPU, exactly (docs/digest.md, "Levels"): y = x @ W for int8 rows x
 * of at most 1024 bytes and a level's 1024 x 16 int8 weights W, into int32.
 *
 * Why a native kernel: without int8 dot-product instructions (AVX2 without VNNI) torch has no
 * fast exact int8 GEMM, and its exact float32 route converts every byte to 4 and runs a 16-column
 * GEMM at about 1 GB/s of digested bytes. Here each pair of bytes is sign-extended to int16 and
 * multiplied with a pair of weights by one vpmaddwd, whose int32 sums are exact
 * (|x| <= 128, |w| <= 127, at most 1024 terms: |y| < 2^24), so the result is the same integers as
 * torch._int_mm and the float path, bit for bit; tests hold the three to each other.
 *
 * Python hands over addresses of tensors it has checked (detfp_capture/_digest/native.py): x rows
 * of `cols` bytes `stride` bytes apart, the level's weights as int16 pairs (wp[p][l][j] =
 * W[2p + j][l], 512 x 16 x 2), and y, rows x 16 int32. The GIL is released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define K 1024
#define LANES 16

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

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define DETFP_HAVE_AVX2_KERNEL 1
#include <immintrin.h>

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

/* 1: the AVX2 kernel; 0: the portable one. Decided once, at import. */
static int use_avx2 = 0;

static PyObject *lanes(PyObject *self, PyObject *args) {
    unsigned long long xa, wa, ya;
    Py_ssize_t rows, cols, stride;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "KnnnKK|p", &xa, &rows, &cols, &stride, &wa, &ya, &portable)) return NULL;
    if (rows < 0 || cols < 0 || cols > K || (rows > 1 && stride < cols)) {
        PyErr_Format(PyExc_ValueError, "lanes: bad shape rows=%zd cols=%zd stride=%zd", rows, cols, stride);
        return NULL;
    }
    if (rows > 0 && (xa == 0 || wa == 0 || ya == 0)) {
        PyErr_SetString(PyExc_ValueError, "lanes: null address");
        return NULL;
    }
    const int8_t *x = (const int8_t *)(uintptr_t)xa;
    const int16_t *wp = (const int16_t *)(uintptr_t)wa;
    int32_t *y = (int32_t *)(uintptr_t)ya;
    Py_BEGIN_ALLOW_THREADS
#ifdef DETFP_HAVE_AVX2_KERNEL
    if (use_avx2 && !portable) lanes_avx2(x, rows, cols, stride, wp, y);
    else
#endif
        lanes_portable(x, rows, cols, stride, wp, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *kernel(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(use_avx2 ? "avx2" : "portable");
}

static PyMethodDef methods[] = {
    {"lanes", lanes, METH_VARARGS,
     "lanes(x_addr, rows, cols, stride, wpairs_addr, y_addr, portable=False): y = x @ W, exact int32."},
    {"kernel", kernel, METH_NOARGS, "The kernel this CPU runs: 'avx2' or 'portable'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lanes", "Exact level GEMM of the digest on CPU.", -1, methods};

PyMODINIT_FUNC PyInit__lanes(void) {
#ifdef DETFP_HAVE_AVX2_KERNEL
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
