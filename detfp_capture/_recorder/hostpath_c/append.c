/* Part of _hostpath.c: append_plain's helpers: the version cache's get/put, the deferred branch, one record row (plain.c: append_plain).
 * Included by _hostpath.c and compiled with it as one unit (the parts share its static state);
 * not built on its own. */

/* ------------------------------------------------------------------------------------------
 * append_plain(rec, call, tensors, fresh, defer): hot.append_plain's loop in C (see hot.py for
 * what each branch means; the two are kept statement for statement alike, and
 * tests/golden/test_capture_routes.py checks that both write the same trace). The Python
 * version runs some 80 bytecodes per tensor around a dozen cheap torch accessors; at level ops
 * that loop is the largest single share of the capture's host cost.
 *
 * Returns None, or NotImplemented before touching anything when the call needs what only the
 * Python version does: a collective may still be writing a tensor (rec.inflight), or a tensor
 * is not a plain torch.Tensor or Parameter. configure() hands over the Python objects it uses.
 * ------------------------------------------------------------------------------------------ */

static PyTypeObject *SlotType = NULL;   /* the Slot type above, once the module is initialised */
static PyObject *cfg_plain = NULL;      /* tuple: the classes taken as plain (awaited.PLAIN) */
static PyObject *cfg_tensor = NULL;     /* torch.Tensor */
static PyObject *cfg_int64 = NULL;      /* torch.int64 */
static PyObject *cfg_dtype_str = NULL;  /* slot.DTYPE_STR */
static PyObject *cfg_dtype_fn = NULL;   /* slot.dtype_str */
static PyObject *cfg_shapes = NULL;     /* slot.SHAPES */
static PyObject *cfg_shape_fn = NULL;   /* slot.shape_tuple */
static PyObject *cfg_staging = NULL;    /* Staging (its fits, looked up per call as Python does) */
static PyObject *cfg_digest = NULL;     /* the digest module (its start, looked up per call) */
static PyObject *cfg_storage_ptrs = NULL; /* slot.storage_ptrs */
static PyObject *cfg_no_hazards = NULL; /* hot._NO_HAZARDS */
static Py_ssize_t cfg_limit = 0;        /* vcache.LIMIT */
static PyObject *one = NULL;            /* the int 1 */

static PyObject *s_version, *s_dtype, *s_numel, *s_shape, *s_untyped_storage, *s_data_ptr,
    *s_itemsize, *s_vcache, *s_waiting, *s_records, *s_rows, *s_seq, *s_inflight, *s_by_id,
    *s_by_storage, *s_clear, *s_tensors, *s_storages, *s_slots, *s_versions, *s_addrs, *s_nbytes,
    *s_stage, *s_fits, *s_start, *s_pointer_check;

static int
intern_names(void)
{
#define I(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    I(s_version, "_version") I(s_dtype, "dtype") I(s_numel, "numel") I(s_shape, "shape")
    I(s_untyped_storage, "untyped_storage") I(s_data_ptr, "data_ptr") I(s_itemsize, "itemsize")
    I(s_vcache, "vcache") I(s_waiting, "waiting") I(s_records, "records") I(s_rows, "rows")
    I(s_seq, "seq") I(s_inflight, "inflight") I(s_by_id, "by_id") I(s_by_storage, "by_storage")
    I(s_clear, "clear") I(s_tensors, "tensors") I(s_storages, "storages") I(s_slots, "slots")
    I(s_versions, "versions") I(s_addrs, "addrs") I(s_nbytes, "nbytes") I(s_stage, "stage")
    I(s_fits, "fits") I(s_start, "start") I(s_pointer_check, "pointer_check")
#undef I
    if ((one = PyLong_FromLong(1)) == NULL) return -1;
    return 0;
}

static PyObject *
configure(PyObject *module, PyObject *args)
{
    PyObject *plain, *tensor, *int64, *dstr, *dfn, *shapes, *sfn, *staging, *dig, *sptrs, *noh;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "O!OOO!OO!OOOOO!n:configure", &PyTuple_Type, &plain, &tensor, &int64,
                          &PyDict_Type, &dstr, &dfn, &PyDict_Type, &shapes, &sfn, &staging, &dig, &sptrs,
                          &PyTuple_Type, &noh, &limit)) {
        return NULL;
    }
#define SET(var, v) Py_INCREF(v); Py_XSETREF(var, v);
    SET(cfg_plain, plain) SET(cfg_tensor, tensor) SET(cfg_int64, int64) SET(cfg_dtype_str, dstr)
    SET(cfg_dtype_fn, dfn) SET(cfg_shapes, shapes) SET(cfg_shape_fn, sfn) SET(cfg_staging, staging)
    SET(cfg_digest, dig) SET(cfg_storage_ptrs, sptrs) SET(cfg_no_hazards, noh)
#undef SET
    cfg_limit = limit;
    Py_RETURN_NONE;
}

/* The record-time digest route (roots.c), used by append_plain's snapshot branch. */
static PyObject *rt_pool; /* defined in roots.c: NULL until the route is configured */
static int root_now(PyObject *t, PyObject *dt, PyObject **s_out);
static int root_eligible(PyObject *t, PyObject *dt, Py_ssize_t *numel, unsigned long long *addr, Py_ssize_t *nbytes);

/* Slot(None), without going through the type's call. */
static PyObject *
new_slot(PyObject *pending)
{
    PyObject *a = PyTuple_Pack(1, pending);
    if (a == NULL) {
        return NULL;
    }
    PyObject *s = slot_new(SlotType, a, NULL);
    Py_DECREF(a);
    return s;
}

/* A field of a Slot (the native type: its member; any other object: the attribute). New ref. */
#define SLOT_FIELD(obj, field, name)                                                           \
    (Py_IS_TYPE((obj), SlotType)                                                                \
         ? (((SlotObject *)(obj))->field ? Py_NewRef(((SlotObject *)(obj))->field)            \
                                         : (PyErr_SetString(PyExc_AttributeError, name), NULL)) \
         : PyObject_GetAttrString((obj), name))

static int
set_slot_field(PyObject *obj, PyObject **field, const char *name, PyObject *v)
{
    if (field != NULL) {
        Py_INCREF(v);
        Py_XSETREF(*field, v);
        return 0;
    }
    return PyObject_SetAttrString(obj, name, v);
}
#define SET_SLOT(obj, f, name, v) \
    set_slot_field((obj), Py_IS_TYPE((obj), SlotType) ? &((SlotObject *)(obj))->f : NULL, name, (v))

/* Python's ``a == b`` as a truth value; -1 on error. */
#define EQ(a, b) PyObject_RichCompareBool((a), (b), Py_EQ)

/* VersionCache.get(t, version) with rows=False, moments=False: a new reference, Py_None on a
 * miss, NULL on error. */
static PyObject *
cache_get(PyObject *by_id, PyObject *key, PyObject *t, PyObject *version)
{
    PyObject *hit = PyDict_GetItemWithError(by_id, key); /* borrowed */
    if (hit == NULL) {
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    if (hit == Py_None) {
        return Py_NewRef(Py_None);
    }
    Py_INCREF(hit);
    PyObject *f = SLOT_FIELD(hit, version, "version");
    int ok = f == NULL ? -1 : EQ(f, version);
    Py_XDECREF(f);
    if (ok == 1) {
        PyObject *ref = SLOT_FIELD(hit, ref, "ref");
        PyObject *target = ref == NULL ? NULL : PyObject_CallNoArgs(ref);
        Py_XDECREF(ref);
        ok = target == NULL ? -1 : target == t;
        Py_XDECREF(target);
    }
    if (ok == 1) {
        f = SLOT_FIELD(hit, opt_rows, "opt_rows");
        ok = f == NULL ? -1 : EQ(f, Py_False);
        Py_XDECREF(f);
    }
    if (ok == 1) {
        f = SLOT_FIELD(hit, opt_moments, "opt_moments");
        ok = f == NULL ? -1 : EQ(f, Py_False);
        Py_XDECREF(f);
    }
    if (ok < 0) {
        Py_DECREF(hit);
        return NULL;
    }
    if (ok == 0) {
        Py_DECREF(hit);
        return Py_NewRef(Py_None);
    }
    return hit;
}

/* VersionCache.put(t, s, version, ptr=ptr) (rows False, moments False); ptr NULL: None.
 * ``by_id``: the cache's dict (the caller has it). */
static int
cache_put(PyObject *vcache, PyObject *by_id, PyObject *key, PyObject *t, PyObject *s, PyObject *version, PyObject *ptr)
{
    int rc = -1;
    PyObject *by_storage = NULL, *ptrs = NULL;
    if (PyDict_GET_SIZE(by_id) >= cfg_limit) {
        PyObject *r = PyObject_CallMethodNoArgs(vcache, s_clear);
        if (r == NULL) {
            goto done;
        }
        Py_DECREF(r);
    }
    PyObject *ref = PyWeakref_NewRef(t, NULL);
    if (ref == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear(); /* refuses weak references: not cached */
            rc = 0;
        }
        goto done;
    }
    untrack_ref(ref);
    int bad = SET_SLOT(s, ref, "ref", ref);
    Py_DECREF(ref);
    if (bad || SET_SLOT(s, version, "version", version) || SET_SLOT(s, opt_rows, "opt_rows", Py_False) ||
        SET_SLOT(s, opt_moments, "opt_moments", Py_False) || PyObject_SetItem(by_id, key, s) < 0) {
        goto done;
    }
    by_storage = PyObject_GetAttr(vcache, s_by_storage);
    if (by_storage == NULL) {
        goto done;
    }
    if (by_storage == Py_None) {
        rc = 0;
        goto done;
    }
    ptrs = ptr != NULL ? PyTuple_Pack(1, ptr) : PyObject_CallOneArg(cfg_storage_ptrs, t);
    if (ptrs == NULL) {
        goto done;
    }
    if (ptrs == Py_None) {
        rc = PyObject_DelItem(by_id, key);
        goto done;
    }
    PyObject *it = PyObject_GetIter(ptrs);
    if (it == NULL) {
        goto done;
    }
    PyObject *p;
    while ((p = PyIter_Next(it)) != NULL) {
        PyObject *ids = PyDict_GetItemWithError(by_storage, p); /* borrowed */
        int e;
        if (ids == NULL && PyErr_Occurred()) {
            e = -1;
        } else if (ids == NULL || ids == Py_None) {
            PyObject *l = PyList_New(1);
            e = l == NULL ? -1 : 0;
            if (l != NULL) {
                /* It only ever holds ids (ints): no cycle through it, so the collector is left
                 * out of it (see untrack_ref; a window's lists were promoted like the refs). */
                PyObject_GC_UnTrack(l);
                PyList_SET_ITEM(l, 0, Py_NewRef(key));
                e = PyDict_SetItem(by_storage, p, l);
                Py_DECREF(l);
            }
        } else {
            PyObject *r = PyObject_CallMethod(ids, "append", "O", key);
            e = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        }
        Py_DECREF(p);
        if (e < 0) {
            Py_DECREF(it);
            goto done;
        }
    }
    Py_DECREF(it);
    rc = PyErr_Occurred() ? -1 : 0;
done:
    Py_XDECREF(ptrs);
    Py_XDECREF(by_storage);
    return rc;
}

/* dict.get(key) or fn(key): the shared dtype text and shape tuple (an empty value counts as
 * missing, as Python's ``or`` does). New reference. */
static PyObject *
memo_or_call(PyObject *memo, PyObject *key, PyObject *fn)
{
    PyObject *v = PyDict_GetItemWithError(memo, key);
    if (v == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (v != NULL) {
        int truth = PyObject_IsTrue(v);
        if (truth < 0) {
            return NULL;
        }
        if (truth) {
            return Py_NewRef(v);
        }
    }
    return PyObject_CallOneArg(fn, key);
}

/* One record onto the buffer's flat rows (records.FIELDS: call, seq, role, arg, dtype text,
 * shape tuple, numel, Slot or None, no hazards), and *seq advanced by one. ``numel``: t's, or
 * NULL to ask t. */
static int
push_record(PyObject *rows, PyObject *call, PyObject **seq, PyObject *role, PyObject *arg, PyObject *t,
            PyObject *dt, PyObject *numel, PyObject *slot)
{
    int rc = -1;
    PyObject *dstr = NULL, *shape = NULL, *stup = NULL, *own = NULL, *next = NULL;
    if (numel == NULL && (numel = own = PyObject_CallMethodNoArgs(t, s_numel)) == NULL) goto out;
    if ((dstr = memo_or_call(cfg_dtype_str, dt, cfg_dtype_fn)) == NULL) goto out;
    if ((shape = PyObject_GetAttr(t, s_shape)) == NULL) goto out;
    if ((stup = memo_or_call(cfg_shapes, shape, cfg_shape_fn)) == NULL) goto out;
    PyObject *row[9] = {call, *seq, role, arg, dstr, stup, numel, slot, cfg_no_hazards};
    for (int k = 0; k < 9; k++) {
        if (PyList_Append(rows, row[k]) < 0) goto out;
    }
    if ((next = PyNumber_Add(*seq, one)) == NULL) goto out;
    Py_SETREF(*seq, next);
    rc = 0;
out:
    Py_XDECREF(dstr); Py_XDECREF(shape); Py_XDECREF(stup); Py_XDECREF(own);
    return rc;
}

/* The deferred branch: keep t for a batch, indexed by its storage. Sets *s and *ptr (new refs). */
static int
defer_one(PyObject *waiting, PyObject *t, PyObject *dt, PyObject *numel, PyObject *version, int fresh,
          PyObject **s_out, PyObject **ptr_out)
{
    int rc = -1;
    PyObject *s = NULL, *storage = NULL, *ptr = NULL, *dstor = NULL, *deferred = NULL, *n = NULL,
             *slots = NULL, *versions = NULL, *addrs = NULL, *addr = NULL, *nbytes = NULL,
             *itemsize = NULL, *size = NULL, *total = NULL;
    s = new_slot(Py_None);
    if (s == NULL) goto done;
    storage = PyObject_CallMethodNoArgs(t, s_untyped_storage);
    if (storage == NULL) goto done;
    ptr = PyObject_CallMethodNoArgs(storage, s_data_ptr);
    if (ptr == NULL) goto done;
    dstor = PyObject_GetAttr(waiting, s_storages);
    if (dstor == NULL) goto done;
    deferred = PyObject_GetAttr(waiting, s_tensors);
    if (deferred == NULL) goto done;
    Py_ssize_t len = PyObject_Length(deferred);
    if (len < 0) goto done;
    n = PyLong_FromSsize_t(len);
    if (n == NULL) goto done;
    PyObject *same = PyObject_GetItem(dstor, ptr);
    if (same == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) goto done;
        PyErr_Clear();
        same = Py_NewRef(Py_None);
    }
    int e;
    if (same == Py_None) {
        e = PyObject_SetItem(dstor, ptr, n);
    } else if (Py_IS_TYPE(same, &PyLong_Type)) {
        PyObject *pair = PyList_New(2);
        e = pair == NULL ? -1 : 0;
        if (pair != NULL) {
            PyList_SET_ITEM(pair, 0, Py_NewRef(same));
            PyList_SET_ITEM(pair, 1, Py_NewRef(n));
            e = PyObject_SetItem(dstor, ptr, pair);
            Py_DECREF(pair);
        }
    } else {
        PyObject *r = PyObject_CallMethod(same, "append", "O", n);
        e = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(same);
    if (e < 0) goto done;
    if (PyList_Append(deferred, t) < 0) goto done;
    if ((slots = PyObject_GetAttr(waiting, s_slots)) == NULL || PyList_Append(slots, s) < 0) goto done;
    if ((versions = PyObject_GetAttr(waiting, s_versions)) == NULL ||
        PyList_Append(versions, fresh ? Py_None : version) < 0) goto done;
    if ((addr = PyObject_CallMethodNoArgs(t, s_data_ptr)) == NULL) goto done;
    if ((addrs = PyObject_GetAttr(waiting, s_addrs)) == NULL || PyList_Append(addrs, addr) < 0) goto done;
    if ((itemsize = PyObject_GetAttr(dt, s_itemsize)) == NULL) goto done;
    if ((size = PyNumber_Multiply(numel, itemsize)) == NULL) goto done;
    if ((nbytes = PyObject_GetAttr(waiting, s_nbytes)) == NULL) goto done;
    if ((total = PyNumber_InPlaceAdd(nbytes, size)) == NULL) goto done;
    if (PyObject_SetAttr(waiting, s_nbytes, total) < 0) goto done;
    *s_out = Py_NewRef(s);
    *ptr_out = Py_NewRef(ptr);
    rc = 0;
done:
    Py_XDECREF(s); Py_XDECREF(storage); Py_XDECREF(ptr); Py_XDECREF(dstor); Py_XDECREF(deferred);
    Py_XDECREF(n); Py_XDECREF(slots); Py_XDECREF(versions); Py_XDECREF(addrs); Py_XDECREF(addr);
    Py_XDECREF(nbytes); Py_XDECREF(itemsize); Py_XDECREF(size); Py_XDECREF(total);
    return rc;
}

/* t._version, or None for a tensor without a version counter (inference tensors). New ref. */
static PyObject *
version_or_none(PyObject *t)
{
    PyObject *v = PyObject_GetAttr(t, s_version);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        v = Py_NewRef(Py_None);
    }
    return v;
}

/* digest.start(t, pointer_check=is_int64), looked up now (a test may replace it). */
static PyObject *
start_now(PyObject *t, int is_int64)
{
    PyObject *start = PyObject_GetAttr(cfg_digest, s_start);
    if (start == NULL) {
        return NULL;
    }
    PyObject *kwnames = PyTuple_Pack(1, s_pointer_check);
    PyObject *out = NULL;
    if (kwnames != NULL) {
        PyObject *a[2] = {t, is_int64 ? Py_True : Py_False};
        out = PyObject_Vectorcall(start, a, 1, kwnames);
        Py_DECREF(kwnames);
    }
    Py_DECREF(start);
    return out;
}
