/* Part of _lanes.c (one translation unit, #included there after the Python helpers): the
 * mergeable fingerprint of a shard (its runs at their global offsets) and its Python entry points. */

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
/* The runs of a box whose every run starts a global row and spans whole rows (base, run length
 * and strides multiples of K: a tensor-parallel shard of a weight whose shard width is a multiple
 * of 256 float32s, say). The local bytes are then a sequence of whole rows, each landing whole on
 * one global row: the kernel goes through them MLH_CHUNK rows at a time across run boundaries (a
 * call per run would pay the kernel's set-up and lose its prefetch on every run), and only the
 * row keys follow the runs. */
static void mlh_box_aligned(int isa, const uint8_t *x, int nd, const Py_ssize_t *sizes, const uint64_t *gstride,
                            Py_ssize_t run_rows, uint64_t base, keys2 k, mlh_acc *m) {
    Py_ssize_t idx[MLH_MAX_DIMS] = {0};
    Py_ssize_t total = run_rows;
    for (int d = 0; d < nd; d++) total *= sizes[d];
    uint64_t y[2 * MLH_CHUNK];
    uint64_t g = base / K; /* the current run's first global row */
    Py_ssize_t in_run = 0;
    for (Py_ssize_t r = 0; r < total;) {
        Py_ssize_t take = total - r < MLH_CHUNK ? total - r : MLH_CHUNK;
        tlh2_rows(isa, x + r * K, take, K, K, k, y);
        for (Py_ssize_t i = 0; i < take; i++) {
            m->acc[0] += mlh_row_key(m->seed_a, g + (uint64_t)in_run) * y[2 * i];
            m->acc[1] += mlh_row_key(m->seed_b, g + (uint64_t)in_run) * y[2 * i + 1];
            if (++in_run < run_rows) continue;
            in_run = 0;
            for (int d = nd - 1; d >= 0; d--) { /* the next run: the odometer over sizes */
                if (++idx[d] < sizes[d]) {
                    g += gstride[d] / K;
                    break;
                }
                g -= gstride[d] / K * (uint64_t)(sizes[d] - 1);
                idx[d] = 0;
            }
        }
        r += take;
    }
}

static void mlh_box(int isa, const uint8_t *x, int nd, const Py_ssize_t *sizes, const uint64_t *gstride,
                    Py_ssize_t run_bytes, uint64_t base, keys2 k, mlh_acc *m) {
    Py_ssize_t idx[MLH_MAX_DIMS] = {0};
    int aligned = run_bytes % K == 0 && base % K == 0;
    for (int d = 0; d < nd; d++) {
        if (sizes[d] == 0) return;
        aligned = aligned && gstride[d] % K == 0;
    }
    if (aligned) {
        mlh_box_aligned(isa, x, nd, sizes, gstride, run_bytes / K, base, k, m);
        return;
    }
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

static int tree_mlh(int isa, const uint8_t *x, Py_ssize_t n, const uint8_t *keys, int nkeys, uint64_t out[2],
                    const uint64_t seeds[2], uint64_t mlh[2]) {
    mlh_acc m = {seeds[0], seeds[1], {0, 0}};
    int rc = tlh2_tree_acc(isa, x, n, keys, nkeys, out, &m);
    mlh[0] = m.acc[0], mlh[1] = m.acc[1];
    return rc;
}
