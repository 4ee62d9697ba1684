/* Part of _hostpath.c: digests computed at record time on CPU: roots_fill and root_now.
 * Included by _hostpath.c and compiled with it as one unit (the parts share its static state);
 * not built on its own. */

/* ------------------------------------------------------------------------------------------
 * Digests on CPU at digest version 2 without a layout, copy or batch: each tensor that is
 * plain, contiguous and on CPU (what batched._batchable asks, plus those two) has its whole
 * tree's root computed where it lies by the kernel of _digest/_lanes.c (its TREE capsule), into
 * a row of a BatchLanes, and its Slot filled as batched.fill does. The digest is the same: a
 * tensor's tree does not depend on the batch it is hashed in.
 *   roots_fill(tensors, slots, held, lanes_addr, first_row): rows first_row + k (k: the rank of
 *       a tensor among those taken; the caller has taken rows for all of them); returns the
 *       indices of the tensors not taken, for the other paths;
 *   root_now (append_plain's): one tensor, into the next row of the pool (roots._RootPool).
 * ------------------------------------------------------------------------------------------ */

typedef struct {
    int (*tree)(int isa, const unsigned char *x, Py_ssize_t n, const unsigned char *keys, int nkeys,
                unsigned long long out[2]);
    int (*pick)(int want);
} DetfpTreeApi;

/* Set by configure_roots (roots.configure_roots, from seam.configure_native), once the digest kernel is known to be there. */
static DetfpTreeApi *tree_api = NULL;
static PyObject *rt_pool = NULL;      /* roots._POOL (record-time rows): NULL until configured */
static PyObject *rt_state = NULL;     /* versions._STATE: [the active scheme, the default] */
static PyObject *rt_v2 = NULL;        /* tlh2.SCHEME */
static PyObject *rt_keys = NULL;      /* tlh2.pack_all_keys(), kept alive for rt_keys_addr */
static PyObject *rt_cpu = NULL;       /* torch.device("cpu") */
static PyObject *rt_special = NULL;   /* dtypes hashed through a byte view (never batched) */
static PyObject *rt_strided = NULL;   /* torch.strided */
static PyObject *rt_batched = NULL;   /* batched.BATCHED */
static unsigned long long rt_keys_addr = 0;
static long rt_nkeys = 0;
/* What the route hashed since the process started: calls, bytes and the wall-clock nanoseconds
 * inside the tree function (root_stats(): the benchmarks' breakdown). */
static unsigned long long rt_calls = 0, rt_bytes = 0, rt_ns = 0;
static PyObject *s_layout, *s_is_nested, *s_is_meta, *s_is_cpu, *s_is_conj, *s_is_neg, *s_is_contiguous,
    *s_used, *s_cap, *s_addr, *s_held, *s_room;

static int
intern_root_names(void)
{
#define I(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    I(s_layout, "layout") I(s_is_nested, "is_nested") I(s_is_meta, "is_meta") I(s_is_cpu, "is_cpu")
    I(s_is_conj, "is_conj") I(s_is_neg, "is_neg") I(s_is_contiguous, "is_contiguous")
    I(s_used, "used") I(s_cap, "cap") I(s_addr, "addr") I(s_held, "held") I(s_room, "room")
#undef I
    return 0;
}

static PyObject *
configure_roots(PyObject *module, PyObject *args)
{
    PyObject *cap, *special, *strided, *batched, *pool, *state, *v2, *keys, *cpu;
    long nkeys;
    if (!PyArg_ParseTuple(args, "OOOOOO!OOlO:configure_roots", &cap, &special, &strided, &batched, &pool,
                          &PyList_Type, &state, &v2, &keys, &nkeys, &cpu)) {
        return NULL;
    }
    DetfpTreeApi *api = PyCapsule_GetPointer(cap, "detfp_capture._digest._lanes.TREE");
    if (api == NULL) return NULL;
    PyObject *ka = PyObject_CallMethodNoArgs(keys, s_data_ptr);
    if (ka == NULL) return NULL;
    unsigned long long keys_addr = PyLong_AsUnsignedLongLong(ka);
    Py_DECREF(ka);
    if (PyErr_Occurred()) return NULL;
    if (keys_addr == 0 || nkeys < 1) {
        PyErr_SetString(PyExc_ValueError, "configure_roots: no keys");
        return NULL;
    }
    tree_api = api;
    rt_keys_addr = keys_addr;
    rt_nkeys = nkeys;
#define SET(var, v) Py_INCREF(v); Py_XSETREF(var, v);
    SET(rt_special, special) SET(rt_strided, strided) SET(rt_batched, batched) SET(rt_pool, pool)
    SET(rt_state, state) SET(rt_v2, v2) SET(rt_keys, keys) SET(rt_cpu, cpu)
#undef SET
    Py_RETURN_NONE;
}

static unsigned long long
rt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

/* The root of nbytes at addr into the two words at y, counted in root_stats. A large tensor
 * lets the interpreter go meanwhile (a small one: not worth handing it to another thread). */
static int
tree_into(unsigned long long addr, Py_ssize_t nbytes, unsigned long long *y)
{
    int isa = tree_api->pick(-1);
    if (isa < 0) return -1;
    const unsigned char *x = (const unsigned char *)(uintptr_t)addr, *keys = (const unsigned char *)(uintptr_t)rt_keys_addr;
    unsigned long long t0 = rt_now();
    int rc;
    if (nbytes >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        rc = tree_api->tree(isa, x, nbytes, keys, (int)rt_nkeys, y);
        Py_END_ALLOW_THREADS
    } else {
        rc = tree_api->tree(isa, x, nbytes, keys, (int)rt_nkeys, y);
    }
    if (rc != 0) {
        PyErr_Format(PyExc_ValueError, "record-time digest: %zd bytes need more than %ld levels of keys", nbytes, rt_nkeys);
        return -1;
    }
    rt_calls++;
    rt_bytes += (unsigned long long)nbytes;
    rt_ns += rt_now() - t0;
    return 0;
}

/* batched.fill(slot, held, row, dtype, t's shape, numel, the CPU). */
static int
fill_row(PyObject *sl, PyObject *held, Py_ssize_t row, PyObject *dt, PyObject *t, Py_ssize_t numel)
{
    PyObject *r = PyLong_FromSsize_t(row), *num = PyLong_FromSsize_t(numel), *shape = NULL, *stup = NULL;
    int e = r == NULL || num == NULL || (shape = PyObject_GetAttr(t, s_shape)) == NULL ||
            (stup = memo_or_call(cfg_shapes, shape, cfg_shape_fn)) == NULL ||
            SET_SLOT(sl, arena, "arena", held) || SET_SLOT(sl, arena_pointer, "arena_pointer", Py_False) ||
            SET_SLOT(sl, row, "row", r) || SET_SLOT(sl, dtype, "dtype", dt) || SET_SLOT(sl, shape, "shape", stup) ||
            SET_SLOT(sl, numel, "numel", num) || SET_SLOT(sl, device, "device", rt_cpu) ||
            SET_SLOT(sl, pending, "pending", rt_batched);
    Py_XDECREF(r); Py_XDECREF(num); Py_XDECREF(shape); Py_XDECREF(stup);
    return e ? -1 : 0;
}

/* The next row of the record-time pool, taken (pool.used advanced) before the tree runs: the
 * tree may let the interpreter go, and another thread recording meanwhile (autograd's device
 * threads) must get another row. Sets *held (new ref), *lanes_addr and *row. */
static int
pool_row(PyObject **held, unsigned long long *lanes_addr, Py_ssize_t *row)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        PyObject *u = PyObject_GetAttr(rt_pool, s_used), *c = PyObject_GetAttr(rt_pool, s_cap),
                 *a = PyObject_GetAttr(rt_pool, s_addr);
        Py_XSETREF(*held, PyObject_GetAttr(rt_pool, s_held));
        Py_ssize_t used = 0, cap = 0;
        int bad = u == NULL || c == NULL || a == NULL || *held == NULL;
        if (!bad) {
            used = PyLong_AsSsize_t(u);
            cap = PyLong_AsSsize_t(c);
            *lanes_addr = PyLong_AsUnsignedLongLong(a);
            bad = PyErr_Occurred() != NULL;
        }
        Py_XDECREF(u); Py_XDECREF(c); Py_XDECREF(a);
        if (bad) return -1;
        if (*held != Py_None && used < cap && *lanes_addr != 0) {
            PyObject *next = PyLong_FromSsize_t(used + 1);
            int e = next == NULL || PyObject_SetAttr(rt_pool, s_used, next) < 0;
            Py_XDECREF(next);
            *row = used;
            return e ? -1 : 0;
        }
        if (attempt == 0) { /* full, or none yet: a new one (roots._RootPool.room) */
            PyObject *r = PyObject_CallMethodObjArgs(rt_pool, s_room, one, rt_v2, NULL);
            if (r == NULL) return -1;
            Py_DECREF(r);
        }
    }
    PyErr_SetString(PyExc_RuntimeError, "record-time digest: the pool has no room after room()");
    return -1;
}

/* A slot for t's digest computed now into the next row of the record-time pool, if t is taken
 * (plain, contiguous, CPU, not int64 or a byte-view dtype) and version 2 is active; *s_out
 * stays NULL otherwise. 1: taken; 0: not; -1: error. */
static int
root_now(PyObject *t, PyObject *dt, PyObject **s_out)
{
    if (rt_pool == NULL || PyList_GET_SIZE(rt_state) == 0 || PyList_GET_ITEM(rt_state, 0) != rt_v2) return 0;
    Py_ssize_t numel = 0, nbytes = 0, row = 0;
    unsigned long long addr = 0, lanes_addr = 0;
    int ok = root_eligible(t, dt, &numel, &addr, &nbytes);
    if (ok <= 0) return ok;
    PyObject *held = NULL, *s = NULL;
    int rc = -1;
    if (pool_row(&held, &lanes_addr, &row) == 0 &&
        tree_into(addr, nbytes, (unsigned long long *)(uintptr_t)lanes_addr + 2 * row) == 0 &&
        (s = new_slot(Py_None)) != NULL && fill_row(s, held, row, dt, t, numel) == 0) {
        *s_out = Py_NewRef(s);
        rc = 1;
    }
    Py_XDECREF(held);
    Py_XDECREF(s);
    return rc;
}

/* 1: t is taken by the route (its bytes in *addr, *nbytes); 0: not; -1: error. */
static int
root_eligible(PyObject *t, PyObject *dt, Py_ssize_t *numel, unsigned long long *addr, Py_ssize_t *nbytes)
{
    PyObject *tp = (PyObject *)Py_TYPE(t);
    if (tp != cfg_tensor && tp != op_param) return 0;
    if (dt == cfg_int64) return 0;
    int sp = PySequence_Contains(rt_special, dt);
    if (sp != 0) return sp < 0 ? -1 : 0;
    PyObject *layout = PyObject_GetAttr(t, s_layout);
    if (layout == NULL) return -1;
    int strided = layout == rt_strided;
    Py_DECREF(layout);
    if (!strided) return 0;
    PyObject *n = PyObject_CallMethodNoArgs(t, s_numel);
    if (n == NULL) return -1;
    *numel = PyLong_AsSsize_t(n);
    Py_DECREF(n);
    if (*numel == -1 && PyErr_Occurred()) return -1;
    if (*numel <= 0) return 0;
    int v;
    if ((v = attr_true(t, s_is_nested)) != 0) return v < 0 ? -1 : 0;
    if ((v = attr_true(t, s_is_meta)) != 0) return v < 0 ? -1 : 0;
    if ((v = attr_true(t, s_is_cpu)) != 1) return v < 0 ? -1 : 0;
    static PyObject **checks[] = {&s_is_conj, &s_is_neg, &s_is_contiguous};
    for (int k = 0; k < 3; k++) {
        PyObject *r = PyObject_CallMethodNoArgs(t, *checks[k]);
        if (r == NULL) return -1;
        int b = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (b < 0) return -1;
        if (b != (k == 2)) return 0; /* conj and neg must be off, contiguity on */
    }
    PyObject *item = PyObject_GetAttr(dt, s_itemsize);
    if (item == NULL) return -1;
    Py_ssize_t isz = PyLong_AsSsize_t(item);
    Py_DECREF(item);
    if (isz == -1 && PyErr_Occurred()) return -1;
    PyObject *p = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (p == NULL) {
        /* No storage to read (a functional wrapper's, a zero tensor's): the other paths take it. */
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    *addr = PyLong_AsUnsignedLongLong(p);
    Py_DECREF(p);
    if (PyErr_Occurred()) return -1;
    *nbytes = *numel * isz;
    return *addr != 0;
}

static PyObject *
roots_fill(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyList_Check(args[0]) || !PyList_Check(args[1]) ||
        PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "roots_fill(tensors: list, slots: list, held, lanes_addr, first_row)");
        return NULL;
    }
    if (tree_api == NULL || cfg_tensor == NULL || op_param == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "roots_fill: configure_roots() was not called");
        return NULL;
    }
    PyObject *tensors = args[0], *slots = args[1], *held = args[2];
    unsigned long long lanes_addr = PyLong_AsUnsignedLongLong(args[3]);
    Py_ssize_t k = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (lanes_addr == 0 || k < 0) {
        PyErr_SetString(PyExc_ValueError, "roots_fill: null lanes or a negative row");
        return NULL;
    }
    unsigned long long *y = (unsigned long long *)(uintptr_t)lanes_addr;
    PyObject *rest = PyList_New(0);
    if (rest == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors); i++) {
        PyObject *t = PyList_GET_ITEM(tensors, i), *sl = PyList_GET_ITEM(slots, i);
        PyObject *dt = PyObject_GetAttr(t, s_dtype);
        if (dt == NULL) goto fail;
        Py_ssize_t numel = 0, nbytes = 0;
        unsigned long long addr = 0;
        int ok = root_eligible(t, dt, &numel, &addr, &nbytes);
        int e = ok < 0;
        if (ok == 0) {
            PyObject *ii = PyLong_FromSsize_t(i);
            e = ii == NULL || PyList_Append(rest, ii) < 0;
            Py_XDECREF(ii);
        } else if (ok > 0) {
            e = tree_into(addr, nbytes, y + 2 * k) < 0 || fill_row(sl, held, k, dt, t, numel) < 0;
            k++;
        }
        Py_DECREF(dt);
        if (e) goto fail;
    }
    return rest;
fail:
    Py_DECREF(rest);
    return NULL;
}

/* root_stats(): (calls, bytes, seconds) of the record-time route in this process. */
static PyObject *
root_stats(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("(KKd)", rt_calls, rt_bytes, (double)rt_ns * 1e-9);
}
