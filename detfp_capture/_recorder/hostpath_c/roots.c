/* Part of _hostpath.c: digests computed at record time on CPU: roots_fill and root_now.
 * Included by _hostpath.c and compiled with it as one unit (the parts share its static state);
 * not built on its own. */

/* ------------------------------------------------------------------------------------------
 * roots_fill(tensors, slots, held, lanes_addr, first_row, keys_addr, nkeys, device): digests
 * (_digest.batched.start_many) on CPU at digest version 2 without a layout: each tensor that
 * is plain, contiguous and on CPU (what _batchable asks, plus those two) has its whole tree's
 * root computed where it lies by the kernel of _digest/_lanes.c (its TREE capsule), into row
 * first_row + k of ``held``'s lanes (k: its rank among the tensors taken; the caller makes
 * room for all of them), and its Slot filled as
 * batched.fill does. Returns the indices of the tensors not taken, for the layout path. The
 * digest is the same: a tensor's tree does not depend on the batch it is hashed in.
 * ------------------------------------------------------------------------------------------ */

typedef struct {
    int (*tree)(int isa, const unsigned char *x, Py_ssize_t n, const unsigned char *keys, int nkeys,
                unsigned long long out[2]);
    int (*pick)(int want);
} DetfpTreeApi;

static DetfpTreeApi *tree_api = NULL;
/* What the record-time route hashed since the process started: calls, bytes and the wall-clock
 * nanoseconds inside the tree function (root_stats(): the benchmarks' breakdown). */
static unsigned long long rt_calls = 0, rt_bytes = 0, rt_ns = 0;

static unsigned long long
rt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}
static PyObject *rt_pool = NULL;      /* roots._POOL (record-time rows): NULL until configured */
static PyObject *rt_state = NULL;     /* versions._STATE: [the active scheme, the default] */
static PyObject *rt_v2 = NULL;        /* tlh2.SCHEME */
static PyObject *rt_keys = NULL;      /* tlh2.pack_all_keys(), kept alive */
static PyObject *rt_cpu = NULL;       /* torch.device("cpu") */
static unsigned long long rt_keys_addr = 0;
static long rt_nkeys = 0;
static PyObject *s_used, *s_cap, *s_addr, *s_held;

/* The instruction set the digest kernel runs now (its select() may change it). */
static int
rt_isa(void)
{
    int isa = tree_api->pick(-1);
    if (isa < 0) PyErr_Clear();
    return isa < 0 ? 0 : isa;
}
static PyObject *rt_special = NULL;   /* dtypes hashed through a byte view (never batched) */
static PyObject *rt_strided = NULL;   /* torch.strided */
static PyObject *rt_batched = NULL;   /* batched.BATCHED */
static PyObject *s_layout, *s_is_nested, *s_is_meta, *s_is_cpu, *s_is_conj, *s_is_neg, *s_is_contiguous,
    *s_arena, *s_arena_pointer, *s_row, *s_device, *s_pending;

static int
intern_root_names(void)
{
#define I(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    I(s_layout, "layout") I(s_is_nested, "is_nested") I(s_is_meta, "is_meta") I(s_is_cpu, "is_cpu")
    I(s_is_conj, "is_conj") I(s_is_neg, "is_neg") I(s_is_contiguous, "is_contiguous") I(s_arena, "arena")
    I(s_arena_pointer, "arena_pointer") I(s_row, "row") I(s_device, "device") I(s_pending, "pending")
    I(s_used, "used") I(s_cap, "cap") I(s_addr, "addr") I(s_held, "held")
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
    rt_keys_addr = PyLong_AsUnsignedLongLong(ka);
    Py_DECREF(ka);
    if (PyErr_Occurred()) return NULL;
    tree_api = api;
    rt_nkeys = nkeys;
#define SET(var, v) Py_INCREF(v); Py_XSETREF(var, v);
    SET(rt_special, special) SET(rt_strided, strided) SET(rt_batched, batched) SET(rt_pool, pool)
    SET(rt_state, state) SET(rt_v2, v2) SET(rt_keys, keys) SET(rt_cpu, cpu)
#undef SET
    Py_RETURN_NONE;
}

/* A slot for t's digest computed now into the next row of the record-time pool
 * (roots._RootPool: held, addr, cap, used), if t is taken (plain, contiguous, CPU, not int64
 * or a byte-view dtype) and version 2 is active; *s_out stays NULL otherwise. -1 on error. */
static int
root_now(PyObject *t, PyObject *dt, PyObject **s_out)
{
    if (rt_pool == NULL || PyList_GET_SIZE(rt_state) == 0 || PyList_GET_ITEM(rt_state, 0) != rt_v2) return 0;
    Py_ssize_t numel = 0, nbytes = 0;
    unsigned long long addr = 0;
    int ok = root_eligible(t, dt, &numel, &addr, &nbytes);
    if (ok <= 0) return ok;
    PyObject *held = NULL, *lanes = NULL, *s = NULL, *row = NULL, *num = NULL, *shape = NULL, *stup = NULL,
             *next = NULL;
    int rc = -1;
    Py_ssize_t used = 0, cap = 0;
    unsigned long long lanes_addr = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        PyObject *u = PyObject_GetAttr(rt_pool, s_used), *c = PyObject_GetAttr(rt_pool, s_cap),
                 *a = PyObject_GetAttr(rt_pool, s_addr);
        Py_XSETREF(held, PyObject_GetAttr(rt_pool, s_held));
        int bad = u == NULL || c == NULL || a == NULL || held == NULL;
        if (!bad) {
            used = PyLong_AsSsize_t(u);
            cap = PyLong_AsSsize_t(c);
            lanes_addr = PyLong_AsUnsignedLongLong(a);
            bad = PyErr_Occurred() != NULL;
        }
        Py_XDECREF(u); Py_XDECREF(c); Py_XDECREF(a);
        if (bad) goto out;
        if (held != Py_None && used < cap && lanes_addr != 0) break;
        if (attempt == 1) {
            PyErr_SetString(PyExc_RuntimeError, "root_now: the record-time pool has no room after room()");
            goto out;
        }
        PyObject *r = PyObject_CallMethod(rt_pool, "room", "nO", (Py_ssize_t)1, rt_v2);
        if (r == NULL) goto out;
        Py_DECREF(r);
    }
    /* The row is taken before the interpreter may be let go below: another thread recording
     * meanwhile (autograd's device threads) gets the next one. */
    if ((next = PyLong_FromSsize_t(used + 1)) == NULL || PyObject_SetAttr(rt_pool, s_used, next) < 0) goto out;
    unsigned long long *y = (unsigned long long *)(uintptr_t)lanes_addr;
    const unsigned char *keys = (const unsigned char *)(uintptr_t)rt_keys_addr;
    int trc;
    unsigned long long t0 = rt_now();
    if (nbytes >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        trc = tree_api->tree(rt_isa(), (const unsigned char *)(uintptr_t)addr, nbytes, keys, (int)rt_nkeys, y + 2 * used);
        Py_END_ALLOW_THREADS
    } else {
        trc = tree_api->tree(rt_isa(), (const unsigned char *)(uintptr_t)addr, nbytes, keys, (int)rt_nkeys, y + 2 * used);
    }
    if (trc != 0) {
        PyErr_Format(PyExc_ValueError, "root_now: %zd bytes need more than %ld levels of keys", nbytes, rt_nkeys);
        goto out;
    }
    rt_calls++;
    rt_bytes += (unsigned long long)nbytes;
    rt_ns += rt_now() - t0;
    if ((s = new_slot(Py_None)) == NULL || (row = PyLong_FromSsize_t(used)) == NULL ||
        (num = PyLong_FromSsize_t(numel)) == NULL || (shape = PyObject_GetAttr(t, s_shape)) == NULL ||
        (stup = memo_or_call(cfg_shapes, shape, cfg_shape_fn)) == NULL)
        goto out;
    /* batched.fill(slot, held, row, dtype, shape, numel, device) */
    if (SET_SLOT(s, arena, "arena", held) || SET_SLOT(s, arena_pointer, "arena_pointer", Py_False) ||
        SET_SLOT(s, row, "row", row) || SET_SLOT(s, dtype, "dtype", dt) || SET_SLOT(s, shape, "shape", stup) ||
        SET_SLOT(s, numel, "numel", num) || SET_SLOT(s, device, "device", rt_cpu) ||
        SET_SLOT(s, pending, "pending", rt_batched))
        goto out;
    *s_out = Py_NewRef(s);
    rc = 1;
out:
    Py_XDECREF(held); Py_XDECREF(lanes); Py_XDECREF(s); Py_XDECREF(row); Py_XDECREF(num); Py_XDECREF(shape);
    Py_XDECREF(stup); Py_XDECREF(next);
    return rc;
}

/* 1: t is taken by roots_fill (its bytes in *addr, *nbytes); 0: not; -1: error. */
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
    if (nargs != 8 || !PyList_Check(args[0]) || !PyList_Check(args[1]) ||
        PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "roots_fill(tensors: list, slots: list, held, lanes_addr, first_row, keys_addr, nkeys, device)");
        return NULL;
    }
    if (tree_api == NULL || cfg_tensor == NULL || op_param == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "roots_fill: configure_roots() was not called");
        return NULL;
    }
    PyObject *tensors = args[0], *slots = args[1], *held = args[2], *dev = args[7];
    unsigned long long lanes_addr = PyLong_AsUnsignedLongLong(args[3]);
    Py_ssize_t first = PyLong_AsSsize_t(args[4]);
    unsigned long long keys_addr = PyLong_AsUnsignedLongLong(args[5]);
    long nkeys = PyLong_AsLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (lanes_addr == 0 || keys_addr == 0 || nkeys < 1 || first < 0) {
        PyErr_SetString(PyExc_ValueError, "roots_fill: null address or no keys");
        return NULL;
    }
    int isa = tree_api->pick(-1);
    if (isa < 0) return NULL;
    unsigned long long *y = (unsigned long long *)(uintptr_t)lanes_addr;
    const unsigned char *keys = (const unsigned char *)(uintptr_t)keys_addr;
    PyObject *rest = PyList_New(0);
    if (rest == NULL) return NULL;
    Py_ssize_t k = first, n = PyList_GET_SIZE(tensors);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(tensors, i), *sl = PyList_GET_ITEM(slots, i);
        PyObject *dt = PyObject_GetAttr(t, s_dtype);
        if (dt == NULL) goto fail;
        Py_ssize_t numel = 0, nbytes = 0;
        unsigned long long addr = 0;
        int ok = root_eligible(t, dt, &numel, &addr, &nbytes);
        if (ok <= 0) {
            Py_DECREF(dt);
            if (ok < 0) goto fail;
            PyObject *ii = PyLong_FromSsize_t(i);
            if (ii == NULL || PyList_Append(rest, ii) < 0) {
                Py_XDECREF(ii);
                goto fail;
            }
            Py_DECREF(ii);
            continue;
        }
        int rc;
        unsigned long long t0 = rt_now();
        if (nbytes >= (1 << 16)) { /* (a small one: not worth handing the interpreter to another thread) */
            Py_BEGIN_ALLOW_THREADS
            rc = tree_api->tree(isa, (const unsigned char *)(uintptr_t)addr, nbytes, keys, (int)nkeys, y + 2 * k);
            Py_END_ALLOW_THREADS
        } else {
            rc = tree_api->tree(isa, (const unsigned char *)(uintptr_t)addr, nbytes, keys, (int)nkeys, y + 2 * k);
        }
        if (rc == 0) {
            rt_calls++;
            rt_bytes += (unsigned long long)nbytes;
            rt_ns += rt_now() - t0;
        }
        PyObject *shape = rc == 0 ? PyObject_GetAttr(t, s_shape) : NULL;
        PyObject *stup = shape == NULL ? NULL : memo_or_call(cfg_shapes, shape, cfg_shape_fn);
        PyObject *row = PyLong_FromSsize_t(k), *num = PyLong_FromSsize_t(numel);
        int e = rc != 0 || stup == NULL || row == NULL || num == NULL;
        if (rc != 0) PyErr_Format(PyExc_ValueError, "roots_fill: %zd bytes need more than %ld levels of keys", nbytes, nkeys);
        /* batched.fill(slot, held, row, dtype, shape, numel, device) */
        e = e || SET_SLOT(sl, arena, "arena", held) || SET_SLOT(sl, arena_pointer, "arena_pointer", Py_False) ||
            SET_SLOT(sl, row, "row", row) || SET_SLOT(sl, dtype, "dtype", dt) || SET_SLOT(sl, shape, "shape", stup) ||
            SET_SLOT(sl, numel, "numel", num) || SET_SLOT(sl, device, "device", dev) ||
            SET_SLOT(sl, pending, "pending", rt_batched);
        Py_XDECREF(shape); Py_XDECREF(stup); Py_XDECREF(row); Py_XDECREF(num); Py_DECREF(dt);
        if (e) goto fail;
        k++;
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
