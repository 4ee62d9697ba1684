/* The record path's native helpers (optional; slot.py and staging.py fall back to Python).
 *
 * Slot: the capture's digest slot (see slot.py) as an object the cyclic garbage collector does
 * not track. A buffered window holds one Slot per distinct digest (thousands per step at level
 * ops) until its flush; as instances of a Python class they were tracked, survived the young
 * collections, were promoted and triggered full collections of the whole heap, paid by the
 * training step. A Slot never takes part in a reference cycle: it refers to its pending digest,
 * a batch's lanes, a weak reference, the slot it copies or a subclass's parts, none of which
 * refers back to it, so reference counting frees every one, and the collector need not see
 * them. The user's collector settings are left as they are.
 *
 * The fields are the Python class's __slots__, same names, same semantics (a field never set
 * raises AttributeError); slot.py adds the class attributes, the property and the method.
 *
 * copy_bytes(dst, src, n): memcpy between two addresses (the staging buffer's snapshot of a
 * contiguous CPU tensor: the same bytes as copy_ into a contiguous view of the same dtype,
 * without two dispatcher calls). The caller checks what it hands over.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    PyObject *arena;
    PyObject *arena_pointer;
    PyObject *device;
    PyObject *dtype;
    PyObject *extra;
    PyObject *hi;
    PyObject *lo;
    PyObject *numel;
    PyObject *opt_moments;
    PyObject *opt_rows;
    PyObject *pending;
    PyObject *ref;
    PyObject *row;
    PyObject *shape;
    PyObject *source;
    PyObject *version;
} SlotObject;

#define M(name) {#name, T_OBJECT_EX, offsetof(SlotObject, name), 0, NULL}
static PyMemberDef slot_members[] = {
    M(arena), M(arena_pointer), M(device), M(dtype), M(extra), M(hi), M(lo), M(numel),
    M(opt_moments), M(opt_rows), M(pending), M(ref), M(row), M(shape), M(source), M(version),
    {NULL, 0, 0, 0, NULL},
};
#undef M

static PyObject *
slot_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *pending;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Slot() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "Slot", 1, 1, &pending)) {
        return NULL;
    }
    SlotObject *self = (SlotObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    /* What the Python class's __init__ sets; the rest stays unset until fill() sets it. */
    Py_INCREF(pending);
    self->pending = pending;
    self->hi = Py_NewRef(Py_None);
    self->lo = Py_NewRef(Py_None);
    self->extra = Py_NewRef(Py_None);
    self->ref = Py_NewRef(Py_None);
    self->version = Py_NewRef(Py_None);
    self->opt_rows = Py_NewRef(Py_False);
    self->opt_moments = Py_NewRef(Py_False);
    self->source = Py_NewRef(Py_None);
    return (PyObject *)self;
}

static void
slot_dealloc(SlotObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Py_CLEAR(self->arena);
    Py_CLEAR(self->arena_pointer);
    Py_CLEAR(self->device);
    Py_CLEAR(self->dtype);
    Py_CLEAR(self->extra);
    Py_CLEAR(self->hi);
    Py_CLEAR(self->lo);
    Py_CLEAR(self->numel);
    Py_CLEAR(self->opt_moments);
    Py_CLEAR(self->opt_rows);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->ref);
    Py_CLEAR(self->row);
    Py_CLEAR(self->shape);
    Py_CLEAR(self->source);
    Py_CLEAR(self->version);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp); /* instances of a heap type hold a reference to it */
}

static PyType_Slot slot_type_slots[] = {
    {Py_tp_new, slot_new},
    {Py_tp_dealloc, slot_dealloc},
    {Py_tp_members, slot_members},
    {Py_tp_doc, "A capture digest slot (see detfp_capture._recorder.slot); not tracked by the collector."},
    {0, NULL},
};

/* Py_TPFLAGS_HAVE_GC deliberately absent: the point of this type. Not a base type (a Python
 * subclass would be tracked again). */
static PyType_Spec slot_spec = {
    "detfp_capture._recorder._hostpath.Slot",
    sizeof(SlotObject),
    0,
    Py_TPFLAGS_DEFAULT,
    slot_type_slots,
};

static PyObject *
copy_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_bytes(dst, src, n) takes 3 arguments");
        return NULL;
    }
    void *dst = PyLong_AsVoidPtr(args[0]);
    if (dst == NULL && PyErr_Occurred()) {
        return NULL;
    }
    void *src = PyLong_AsVoidPtr(args[1]);
    if (src == NULL && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "copy_bytes: negative length");
        }
        return NULL;
    }
    if (n > 0 && (dst == NULL || src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "copy_bytes: null address");
        return NULL;
    }
    if (n >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, (size_t)n);
        Py_END_ALLOW_THREADS
    } else if (n > 0) {
        memcpy(dst, src, (size_t)n);
    }
    Py_RETURN_NONE;
}


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

/* The record-time digest route (see roots_fill below), used by append_plain's snapshot branch. */
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

/* VersionCache.put(t, s, version, ptr=ptr) (rows False, moments False); ptr NULL: None. */
static int
cache_put(PyObject *vcache, PyObject *key, PyObject *t, PyObject *s, PyObject *version, PyObject *ptr)
{
    PyObject *by_id = PyObject_GetAttr(vcache, s_by_id);
    if (by_id == NULL) {
        return -1;
    }
    int rc = -1;
    PyObject *by_storage = NULL, *ptrs = NULL;
    Py_ssize_t n = PyObject_Length(by_id);
    if (n < 0) {
        goto done;
    }
    if (n >= cfg_limit) {
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
    Py_DECREF(by_id);
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

static PyObject *
append_plain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "append_plain(rec, call, tensors, fresh, defer) takes 5 arguments");
        return NULL;
    }
    if (cfg_plain == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "append_plain: configure() was not called");
        return NULL;
    }
    PyObject *rec = args[0], *call = args[1], *tensors = args[2];
    int fresh = PyObject_IsTrue(args[3]);
    int defer = PyObject_IsTrue(args[4]);
    if (fresh < 0 || defer < 0) {
        return NULL;
    }
    PyObject *seqlist = PySequence_Fast(tensors, "append_plain: tensors must be a sequence");
    if (seqlist == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seqlist);
    PyObject **items = PySequence_Fast_ITEMS(seqlist);
    PyObject *result = NULL;
    PyObject *vcache = NULL, *waiting = NULL, *records = NULL, *rows = NULL, *seq = NULL, *by_id = NULL,
             *stage_t = NULL, *stage_s = NULL, *inflight = NULL;
    /* Only the Python version handles these: checked before anything changes. */
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyTuple_Check(items[i]) || PyTuple_GET_SIZE(items[i]) != 3) {
            result = Py_NewRef(Py_NotImplemented);
            goto done;
        }
        int plain = PySequence_Contains(cfg_plain, (PyObject *)Py_TYPE(PyTuple_GET_ITEM(items[i], 2)));
        if (plain < 0) goto done;
        if (!plain) {
            result = Py_NewRef(Py_NotImplemented);
            goto done;
        }
    }
    if ((inflight = PyObject_GetAttr(rec, s_inflight)) == NULL) goto done;
    int busy = PyObject_IsTrue(inflight);
    if (busy < 0) goto done;
    if (busy) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if ((vcache = PyObject_GetAttr(rec, s_vcache)) == NULL) goto done;
    if ((waiting = PyObject_GetAttr(rec, s_waiting)) == NULL) goto done;
    if ((records = PyObject_GetAttr(rec, s_records)) == NULL) goto done;
    if ((rows = PyObject_GetAttr(records, s_rows)) == NULL) goto done;
    if (!PyList_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "append_plain: the records buffer's rows must be a list");
        goto done;
    }
    if ((seq = PyObject_GetAttr(rec, s_seq)) == NULL) goto done;
    if ((by_id = PyObject_GetAttr(vcache, s_by_id)) == NULL) goto done;
    if (!PyDict_Check(by_id)) {
        PyErr_SetString(PyExc_TypeError, "append_plain: the version cache must be a dict");
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *role = PyTuple_GET_ITEM(items[i], 0), *arg = PyTuple_GET_ITEM(items[i], 1),
                 *t = PyTuple_GET_ITEM(items[i], 2);
        PyObject *version = NULL, *s = NULL, *dt = NULL, *numel = NULL, *key = NULL, *ptr = NULL,
                 *dstr = NULL, *shape = NULL, *stup = NULL, *next = NULL;
        int ok = -1;
        version = PyObject_GetAttr(t, s_version);
        if (version == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) goto item_done;
            PyErr_Clear(); /* inference tensors have no version counter */
        }
        key = PyLong_FromVoidPtr(t);
        if (key == NULL) goto item_done;
        if (version != NULL && !fresh) {
            s = cache_get(by_id, key, t, version);
            if (s == NULL) goto item_done;
            if (s == Py_None) Py_CLEAR(s);
        }
        if ((dt = PyObject_GetAttr(t, s_dtype)) == NULL) goto item_done;
        if ((numel = PyObject_CallMethodNoArgs(t, s_numel)) == NULL) goto item_done;
        if (s == NULL) {
            if (defer && version != NULL && dt != cfg_int64 && (PyObject *)Py_TYPE(t) == cfg_tensor) {
                if (defer_one(waiting, t, dt, numel, version, fresh, &s, &ptr) < 0) goto item_done;
            } else {
                /* On CPU at version 2: digested now, from the bytes a snapshot would copy. */
                if (root_now(t, dt, &s) < 0) goto item_done;
            }
            if (s == NULL) {
                PyObject *fits = PyObject_GetAttr(cfg_staging, s_fits);
                PyObject *r = fits == NULL ? NULL : PyObject_CallOneArg(fits, t);
                Py_XDECREF(fits);
                if (r == NULL) goto item_done;
                int fit = PyObject_IsTrue(r);
                Py_DECREF(r);
                if (fit < 0) goto item_done;
                if (fit) {
                    if ((s = new_slot(Py_None)) == NULL) goto item_done;
                    if (stage_t == NULL) {
                        if ((stage_t = PyList_New(0)) == NULL || (stage_s = PyList_New(0)) == NULL) goto item_done;
                    }
                    if (PyList_Append(stage_t, t) < 0 || PyList_Append(stage_s, s) < 0) goto item_done;
                } else {
                    PyObject *p = start_now(t, dt == cfg_int64);
                    if (p == NULL) goto item_done;
                    s = new_slot(p);
                    Py_DECREF(p);
                    if (s == NULL) goto item_done;
                }
            }
            if (version != NULL && cache_put(vcache, key, t, s, version, ptr) < 0) goto item_done;
        }
        if ((dstr = memo_or_call(cfg_dtype_str, dt, cfg_dtype_fn)) == NULL) goto item_done;
        if ((shape = PyObject_GetAttr(t, s_shape)) == NULL) goto item_done;
        if ((stup = memo_or_call(cfg_shapes, shape, cfg_shape_fn)) == NULL) goto item_done;
        PyObject *row[9] = {call, seq, role, arg, dstr, stup, numel, s, cfg_no_hazards};
        for (int k = 0; k < 9; k++) {
            if (PyList_Append(rows, row[k]) < 0) goto item_done;
        }
        if ((next = PyNumber_Add(seq, one)) == NULL) goto item_done;
        Py_SETREF(seq, next);
        ok = 0;
    item_done:
        Py_XDECREF(version); Py_XDECREF(s); Py_XDECREF(dt); Py_XDECREF(numel); Py_XDECREF(key);
        Py_XDECREF(ptr); Py_XDECREF(dstr); Py_XDECREF(shape); Py_XDECREF(stup);
        if (ok < 0) goto done;
    }
    if (PyObject_SetAttr(rec, s_seq, seq) < 0) goto done;
    if (stage_t != NULL) {
        PyObject *r = PyObject_CallMethodObjArgs(waiting, s_stage, stage_t, stage_s, NULL);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(seqlist); Py_XDECREF(vcache); Py_XDECREF(waiting); Py_XDECREF(records); Py_XDECREF(rows);
    Py_XDECREF(seq); Py_XDECREF(by_id); Py_XDECREF(stage_t); Py_XDECREF(stage_s); Py_XDECREF(inflight);
    return result;
}

/* ------------------------------------------------------------------------------------------
 * The dispatch mode's other per-op helpers, in C for the same reason as append_plain:
 *   gather(args, kwargs, dest_pos, dest_kw)        ops.gather
 *   append_fast(rec, call, tensors, digest_it, fresh, defer)   hot.append_fast
 *   record_op(rec, name, module, phase, tensors, args_src, digest_it, defer)   hot.record_op
 * configure_op() and configure_gather() hand over what they use from Python.
 * ------------------------------------------------------------------------------------------ */

static PyObject *op_param = NULL;        /* torch.nn.Parameter */
static PyObject *op_tensor = NULL;       /* torch.Tensor (gather's own: configured apart) */
static PyObject *op_has_subclass = NULL; /* subclass.has_subclass */
static PyObject *op_plain_py = NULL;     /* hot._append_plain_py */
static PyObject *op_flat_args = NULL;    /* args.flat_args */
static PyObject *op_mark_flat = NULL, *op_mark_open = NULL, *op_mark_close = NULL; /* its markers */
static PyObject *op_arg_names = NULL;    /* ops._ARG_NAMES (a tuple) */
static Py_ssize_t op_defer_max = 0;      /* deferred.DEFER_MAX */
static PyObject *op_defer_bytes = NULL;  /* deferred.DEFER_BYTES (an int) */
static PyObject *op_names = NULL;        /* memo: (i, j) or (key, j) -> "args[i][j]" / "kwargs.k[j]" text */
static PyObject *s_input, *s_dest, *s_op, *s_microbatch, *s_occ, *s_step, *s_tensor_opts, *s_run,
    *s_staging_kw, *s_records_in_step, *s_flush_rows, *s_need_flush, *s_append_records, *s_digest_it,
    *s_fresh, *s_defer, *s_kwargs_prefix;

static int
intern_op_names(void)
{
#define I(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    I(s_input, "input") I(s_dest, "dest") I(s_op, "op") I(s_microbatch, "microbatch") I(s_occ, "occ")
    I(s_step, "step") I(s_tensor_opts, "_tensor_opts") I(s_run, "run") I(s_staging_kw, "staging")
    I(s_records_in_step, "records_in_step") I(s_flush_rows, "_flush_rows") I(s_need_flush, "need_flush")
    I(s_append_records, "append_records") I(s_digest_it, "digest_it") I(s_fresh, "fresh")
    I(s_defer, "defer") I(s_kwargs_prefix, "kwargs.")
#undef I
    if ((op_names = PyDict_New()) == NULL) return -1;
    return 0;
}

static PyObject *
configure_op(PyObject *module, PyObject *args)
{
    PyObject *param, *has_sub, *plain_py, *dbytes;
    Py_ssize_t dmax;
    if (!PyArg_ParseTuple(args, "OOOnO!:configure_op", &param, &has_sub, &plain_py, &dmax, &PyLong_Type, &dbytes)) {
        return NULL;
    }
#define SET(var, v) Py_INCREF(v); Py_XSETREF(var, v);
    SET(op_param, param) SET(op_has_subclass, has_sub) SET(op_plain_py, plain_py) SET(op_defer_bytes, dbytes)
#undef SET
    op_defer_max = dmax;
    Py_RETURN_NONE;
}

static PyObject *
configure_gather(PyObject *module, PyObject *args)
{
    PyObject *tensor, *names, *flat, *mflat, *mopen, *mclose;
    if (!PyArg_ParseTuple(args, "OO!OOOO:configure_gather", &tensor, &PyTuple_Type, &names, &flat, &mflat, &mopen,
                          &mclose)) {
        return NULL;
    }
    Py_INCREF(mflat);
    Py_XSETREF(op_mark_flat, mflat);
    Py_INCREF(mopen);
    Py_XSETREF(op_mark_open, mopen);
    Py_INCREF(mclose);
    Py_XSETREF(op_mark_close, mclose);
    Py_INCREF(tensor);
    Py_XSETREF(op_tensor, tensor);
    Py_INCREF(names);
    Py_XSETREF(op_arg_names, names);
    Py_INCREF(flat);
    Py_XSETREF(op_flat_args, flat);
    Py_RETURN_NONE;
}

/* The record name of a list element: "args[i][j]" or "kwargs.k[j]" (memoized). New ref. */
static PyObject *
element_name(PyObject *base, Py_ssize_t j)
{
    PyObject *jj = PyLong_FromSsize_t(j);
    if (jj == NULL) return NULL;
    PyObject *key = PyTuple_Pack(2, base, jj);
    Py_DECREF(jj);
    if (key == NULL) return NULL;
    PyObject *got = PyDict_GetItemWithError(op_names, key);
    if (got != NULL) {
        Py_DECREF(key);
        return Py_NewRef(got);
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *text = PyUnicode_FromFormat("%U[%zd]", base, j);
    if (text != NULL && PyDict_GET_SIZE(op_names) < (1 << 16) && PyDict_SetItem(op_names, key, text) < 0) {
        Py_CLEAR(text);
    }
    Py_DECREF(key);
    return text;
}

/* "args[i]" (the shared text below 64, as ops._ARG_NAMES). New ref. */
static PyObject *
arg_name(Py_ssize_t i)
{
    if (i < PyTuple_GET_SIZE(op_arg_names)) {
        return Py_NewRef(PyTuple_GET_ITEM(op_arg_names, i));
    }
    return PyUnicode_FromFormat("args[%zd]", i);
}

static int
append_record_item(PyObject *tensors, PyObject *role, PyObject *name, PyObject *t)
{
    if (name == NULL) return -1;
    PyObject *item = PyTuple_Pack(3, role, name, t);
    Py_DECREF(name);
    if (item == NULL) return -1;
    int rc = PyList_Append(tensors, item);
    Py_DECREF(item);
    return rc;
}

/* The tensors of a list or tuple argument ``a`` whose first element passes ``first_ok``. */
static int
gather_list(PyObject *tensors, PyObject *role, PyObject *base, PyObject *a)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
    PyObject **xs = PySequence_Fast_ITEMS(a);
    for (Py_ssize_t j = 0; j < n; j++) {
        int is_t = PyObject_IsInstance(xs[j], op_tensor);
        if (is_t < 0) return -1;
        if (is_t && append_record_item(tensors, role, element_name(base, j), xs[j]) < 0) return -1;
    }
    return 0;
}

/* args._inline: v into out, a list (exactly) as its items between the open and close markers. */
static int
inline_arg(PyObject *v, PyObject *out, int depth)
{
    if (!PyList_CheckExact(v)) return PyList_Append(out, v);
    if (depth > 64) { /* (Python's version would recurse as deep; a list nested this deep is not an op argument) */
        PyErr_SetString(PyExc_RecursionError, "flat_args: lists nested too deep");
        return -1;
    }
    if (PyList_Append(out, op_mark_open) < 0) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v); i++) {
        PyObject *x = PyList_GET_ITEM(v, i);
        Py_INCREF(x);
        int e = inline_arg(x, out, depth + 1);
        Py_DECREF(x);
        if (e < 0) return -1;
    }
    return PyList_Append(out, op_mark_close);
}

/* args.flat_args(other, kw): (marker, number of positional args, args..., name, value, ...), or None. */
static PyObject *
flat_args_c(PyObject *other, PyObject *kw)
{
    if (PyList_GET_SIZE(other) == 0 && PyList_GET_SIZE(kw) == 0) return Py_NewRef(Py_None);
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    PyObject *n = PyLong_FromSsize_t(PyList_GET_SIZE(other));
    int e = n == NULL || PyList_Append(out, op_mark_flat) < 0 || PyList_Append(out, n) < 0;
    Py_XDECREF(n);
    for (Py_ssize_t i = 0; !e && i < PyList_GET_SIZE(other); i++) e = inline_arg(PyList_GET_ITEM(other, i), out, 0) < 0;
    for (Py_ssize_t i = 0; !e && i < PyList_GET_SIZE(kw); i++) {
        PyObject *pair = PyList_GET_ITEM(kw, i);
        e = PyList_Append(out, PyTuple_GET_ITEM(pair, 0)) < 0 || inline_arg(PyTuple_GET_ITEM(pair, 1), out, 0) < 0;
    }
    PyObject *t = e ? NULL : PyList_AsTuple(out);
    Py_DECREF(out);
    return t;
}

static PyObject *
gather(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "gather(args: tuple, kwargs: dict, dest_pos, dest_kw)");
        return NULL;
    }
    if (op_flat_args == NULL || op_tensor == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gather: configure_gather() was not called");
        return NULL;
    }
    PyObject *a = args[0], *kw = args[1], *dest_pos = args[2], *dest_kw = args[3];
    PyObject *tensors = PyList_New(0), *other = PyList_New(0), *kwl = PyList_New(0), *result = NULL;
    if (tensors == NULL || other == NULL || kwl == NULL) goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(a);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(a, i);
        PyObject *ii = PyLong_FromSsize_t(i);
        if (ii == NULL) goto done;
        int d = PySequence_Contains(dest_pos, ii);
        Py_DECREF(ii);
        if (d < 0) goto done;
        PyObject *role = d ? s_dest : s_input;
        int is_t = PyObject_IsInstance(v, op_tensor);
        if (is_t < 0) goto done;
        if (is_t) {
            if (append_record_item(tensors, role, arg_name(i), v) < 0) goto done;
            continue;
        }
        if ((PyList_Check(v) || PyTuple_Check(v)) && PySequence_Fast_GET_SIZE(v) > 0) {
            PyObject *first = PySequence_Fast_ITEMS(v)[0];
            int ok = first == Py_None ? 1 : PyObject_IsInstance(first, op_tensor);
            if (ok < 0) goto done;
            if (ok) {
                PyObject *base = arg_name(i);
                if (base == NULL) goto done;
                int e = gather_list(tensors, role, base, v);
                Py_DECREF(base);
                if (e < 0) goto done;
                continue;
            }
        }
        if (PyList_Append(other, v) < 0) goto done;
    }
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kw, &pos, &k, &v)) {
        Py_INCREF(k);
        Py_INCREF(v);
        int e = -1;
        int d = PySequence_Contains(dest_kw, k);
        if (d >= 0) {
            PyObject *role = d ? s_dest : s_input;
            int is_t = PyObject_IsInstance(v, op_tensor);
            if (is_t > 0) {
                e = append_record_item(tensors, role, PyUnicode_Concat(s_kwargs_prefix, k), v);
            } else if (is_t == 0) {
                int listed = 0;
                if ((PyList_Check(v) || PyTuple_Check(v)) && PySequence_Fast_GET_SIZE(v) > 0) {
                    listed = PyObject_IsInstance(PySequence_Fast_ITEMS(v)[0], op_tensor);
                }
                if (listed > 0) {
                    PyObject *base = PyUnicode_Concat(s_kwargs_prefix, k);
                    e = base == NULL ? -1 : gather_list(tensors, role, base, v);
                    Py_XDECREF(base);
                } else if (listed == 0) {
                    PyObject *pair = PyTuple_Pack(2, k, v);
                    e = pair == NULL ? -1 : PyList_Append(kwl, pair);
                    Py_XDECREF(pair);
                }
            }
        }
        Py_DECREF(k);
        Py_DECREF(v);
        if (e < 0) goto done;
    }
    PyObject *flat = op_mark_flat != NULL ? flat_args_c(other, kwl) : PyObject_CallFunctionObjArgs(op_flat_args, other, kwl, NULL);
    if (flat == NULL) goto done;
    result = PyTuple_Pack(2, tensors, flat);
    Py_DECREF(flat);
done:
    Py_XDECREF(tensors); Py_XDECREF(other); Py_XDECREF(kwl);
    return result;
}

/* hot.append_fast. */
/* hot.append_counted: records counted, not digested (views, metadata ops). */
static int
append_counted_c(PyObject *rec, PyObject *call, PyObject *fast)
{
    PyObject *records = NULL, *rows = NULL, *seq = NULL;
    int rc = -1;
    if ((records = PyObject_GetAttr(rec, s_records)) == NULL || (rows = PyObject_GetAttr(records, s_rows)) == NULL ||
        (seq = PyObject_GetAttr(rec, s_seq)) == NULL)
        goto out;
    if (!PyList_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "append_counted: the records buffer's rows must be a list");
        goto out;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        PyObject *item = PySequence_Fast_ITEMS(fast)[i];
        PyObject *t = PyTuple_GET_ITEM(item, 2);
        PyObject *dt = NULL, *dstr = NULL, *shape = NULL, *stup = NULL, *numel = NULL, *next = NULL;
        int e = (dt = PyObject_GetAttr(t, s_dtype)) == NULL || (dstr = memo_or_call(cfg_dtype_str, dt, cfg_dtype_fn)) == NULL ||
                (shape = PyObject_GetAttr(t, s_shape)) == NULL ||
                (stup = memo_or_call(cfg_shapes, shape, cfg_shape_fn)) == NULL ||
                (numel = PyObject_CallMethodNoArgs(t, s_numel)) == NULL;
        if (!e) {
            PyObject *row[9] = {call, seq, PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1), dstr, stup, numel,
                                Py_None, cfg_no_hazards};
            for (int k = 0; k < 9 && !e; k++) e = PyList_Append(rows, row[k]) < 0;
        }
        if (!e) {
            e = (next = PyNumber_Add(seq, one)) == NULL;
            if (!e) Py_SETREF(seq, next);
        }
        Py_XDECREF(dt); Py_XDECREF(dstr); Py_XDECREF(shape); Py_XDECREF(stup); Py_XDECREF(numel);
        if (e) goto out;
    }
    rc = PyObject_SetAttr(rec, s_seq, seq);
out:
    Py_XDECREF(records); Py_XDECREF(rows); Py_XDECREF(seq);
    return rc;
}

/* What every append ends with: rec.records_in_step += n, and a full buffer asks for a flush. */
static int
count_appended(PyObject *rec, Py_ssize_t ntensors)
{
    int rc = -1;
    PyObject *count = NULL, *nt = NULL, *sum = NULL, *records = NULL, *rows = NULL, *limit = NULL;
    if ((count = PyObject_GetAttr(rec, s_records_in_step)) == NULL) goto out;
    if ((nt = PyLong_FromSsize_t(ntensors)) == NULL) goto out;
    if ((sum = PyNumber_Add(count, nt)) == NULL || PyObject_SetAttr(rec, s_records_in_step, sum) < 0) goto out;
    if ((records = PyObject_GetAttr(rec, s_records)) == NULL) goto out;
    if ((rows = PyObject_GetAttr(records, s_rows)) == NULL) goto out;
    if ((limit = PyObject_GetAttr(rec, s_flush_rows)) == NULL) goto out;
    Py_ssize_t nrows = PyObject_Length(rows);
    if (nrows < 0) goto out;
    PyObject *nr = PyLong_FromSsize_t(nrows);
    if (nr == NULL) goto out;
    int over = PyObject_RichCompareBool(nr, limit, Py_GE);
    Py_DECREF(nr);
    if (over < 0 || (over && PyObject_SetAttr(rec, s_need_flush, Py_True) < 0)) goto out;
    rc = 0;
out:
    Py_XDECREF(count); Py_XDECREF(nt); Py_XDECREF(sum); Py_XDECREF(records); Py_XDECREF(rows); Py_XDECREF(limit);
    return rc;
}

/* hot.append_fast; and Recorder.append_records' counted path (digest_it False) when no tensor
 * can be a subclass recorded part by part. */
static int
append_fast_c(PyObject *rec, PyObject *call, PyObject *tensors, int digest_it, PyObject *fresh, PyObject *defer)
{
    /* has_subclass: only a tensor that is not exactly a Tensor or a Parameter can be one. */
    PyObject *fast = PySequence_Fast(tensors, "tensors must be a sequence");
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int odd = 0;
    for (Py_ssize_t i = 0; i < n && !odd; i++) {
        PyObject *item = PySequence_Fast_ITEMS(fast)[i];
        PyObject *t = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 3 ? PyTuple_GET_ITEM(item, 2) : NULL;
        odd = t == NULL || ((PyObject *)Py_TYPE(t) != cfg_tensor && (PyObject *)Py_TYPE(t) != op_param);
    }
    if (!digest_it && !odd) {
        int rc = append_counted_c(rec, call, fast) < 0 || count_appended(rec, n) < 0 ? -1 : 0;
        Py_DECREF(fast);
        return rc;
    }
    Py_DECREF(fast);
    int general = !digest_it;
    if (!general) {
        PyObject *opts = PyObject_GetAttr(rec, s_tensor_opts);
        if (opts == NULL) return -1;
        general = PyObject_IsTrue(opts);
        Py_DECREF(opts);
        if (general < 0) return -1;
    }
    if (!general && odd) {
        PyObject *r = PyObject_CallOneArg(op_has_subclass, tensors);
        if (r == NULL) return -1;
        general = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (general < 0) return -1;
    }
    if (general) {
        PyObject *kwn = PyTuple_Pack(3, s_digest_it, s_fresh, s_defer);
        if (kwn == NULL) return -1;
        PyObject *meth = PyObject_GetAttr(rec, s_append_records);
        PyObject *r = NULL;
        if (meth != NULL) {
            PyObject *argv[5] = {call, tensors, digest_it ? Py_True : Py_False, fresh, defer};
            r = PyObject_Vectorcall(meth, argv, 2, kwn);
            Py_DECREF(meth);
        }
        Py_DECREF(kwn);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 0;
    }
    PyObject *pargs[5] = {rec, call, tensors, fresh, defer};
    PyObject *r = append_plain(NULL, pargs, 5);
    if (r == NULL) return -1;
    if (r == Py_NotImplemented) {
        Py_DECREF(r);
        r = PyObject_Vectorcall(op_plain_py, pargs, 5, NULL);
        if (r == NULL) return -1;
    }
    Py_DECREF(r);
    /* A full batch runs now. */
    PyObject *waiting = PyObject_GetAttr(rec, s_waiting);
    if (waiting == NULL) return -1;
    int rc = -1;
    PyObject *wt = NULL, *nbytes = NULL;
    if ((wt = PyObject_GetAttr(waiting, s_tensors)) == NULL) goto out;
    Py_ssize_t waiting_n = PyObject_Length(wt);
    if (waiting_n < 0) goto out;
    int full = waiting_n >= op_defer_max;
    if (!full) {
        if ((nbytes = PyObject_GetAttr(waiting, s_nbytes)) == NULL) goto out;
        full = PyObject_RichCompareBool(nbytes, op_defer_bytes, Py_GE);
        if (full < 0) goto out;
    }
    if (full) {
        PyObject *kwn = PyTuple_Pack(1, s_staging_kw);
        PyObject *meth = kwn == NULL ? NULL : PyObject_GetAttr(waiting, s_run);
        PyObject *ran = NULL;
        if (meth != NULL) {
            PyObject *argv[1] = {Py_False};
            ran = PyObject_Vectorcall(meth, argv, 0, kwn);
            Py_DECREF(meth);
        }
        Py_XDECREF(kwn);
        if (ran == NULL) goto out;
        Py_DECREF(ran);
    }
    rc = count_appended(rec, n);
out:
    Py_DECREF(waiting); Py_XDECREF(wt); Py_XDECREF(nbytes);
    return rc;
}

static PyObject *
append_fast(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "append_fast(rec, call, tensors, digest_it, fresh, defer) takes 6 arguments");
        return NULL;
    }
    if (op_plain_py == NULL || cfg_plain == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "append_fast: configure() and configure_op() were not called");
        return NULL;
    }
    int digest_it = PyObject_IsTrue(args[3]);
    if (digest_it < 0 || append_fast_c(args[0], args[1], args[2], digest_it, args[4], args[5]) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
record_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "record_op(rec, name, module, phase, tensors, args_src, digest_it, defer) takes 8 arguments");
        return NULL;
    }
    if (op_plain_py == NULL || cfg_plain == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "record_op: configure() and configure_op() were not called");
        return NULL;
    }
    PyObject *rec = args[0], *name = args[1], *mod = args[2], *phase = args[3], *tensors = args[4],
             *args_src = args[5];
    int digest_it = PyObject_IsTrue(args[6]);
    if (digest_it < 0) return NULL;
    PyObject *mb = NULL, *key = NULL, *occ = NULL, *n = NULL, *n1 = NULL, *step = NULL, *call = NULL;
    if ((mb = PyObject_GetAttr(rec, s_microbatch)) == NULL) goto fail;
    if ((key = PyTuple_Pack(5, mb, phase, mod, s_op, name)) == NULL) goto fail;
    if ((occ = PyObject_GetAttr(rec, s_occ)) == NULL) goto fail;
    if (PyDict_CheckExact(occ)) {
        n = PyDict_GetItemWithError(occ, key);
        if (n == NULL && PyErr_Occurred()) goto fail;
        n = n == NULL ? PyLong_FromLong(0) : Py_NewRef(n);
    } else {
        n = PyObject_CallMethod(occ, "get", "Oi", key, 0);
    }
    if (n == NULL) goto fail;
    if ((n1 = PyNumber_Add(n, one)) == NULL || PyObject_SetItem(occ, key, n1) < 0) goto fail;
    if ((step = PyObject_GetAttr(rec, s_step)) == NULL) goto fail;
    if ((call = PyTuple_Pack(9, step, mb, phase, mod, s_op, name, n, args_src, Py_False)) == NULL) goto fail;
    int has = PyObject_IsTrue(tensors);
    if (has < 0) goto fail;
    if (has && append_fast_c(rec, call, tensors, digest_it, Py_False, args[7]) < 0) goto fail;
    Py_DECREF(mb); Py_DECREF(key); Py_DECREF(occ); Py_DECREF(n); Py_DECREF(n1); Py_DECREF(step);
    return call;
fail:
    Py_XDECREF(mb); Py_XDECREF(key); Py_XDECREF(occ); Py_XDECREF(n); Py_XDECREF(n1); Py_XDECREF(step);
    Py_XDECREF(call);
    return NULL;
}

/* ------------------------------------------------------------------------------------------
 * op_pre(mode, func, args, kwargs) and op_post(mode, pre, args, kwargs, out): CaptureMode._pre and
 * CaptureMode._post (_sources/dispatch.py) for the ops most steps consist of, in C. They return
 * NotImplemented, before changing anything, for everything else, which the Python methods do:
 * an op seen for the first time, one with write-only or ignored arguments or an exact copy
 * (OpInfo.plain_in False), outputs that are workspaces, fresh allocations or non-blocking copies
 * (OpInfo.plain_out False), active hazards, a modules= filter, workspace tensors alive. What they
 * do is the Python methods' branch for such an op, statement for statement.
 * ------------------------------------------------------------------------------------------ */

static PyObject *op_out_names = NULL;     /* ops._OUT_NAMES */
static PyObject *s_rec, *s_info, *s_plain_in, *s_plain_out, *s_hazards, *s_workspaces, *s_cfg, *s_modules,
    *s_written, *s_promote, *s_scope, *s_op_where, *s_busy, *s_name, *s_dest_pos, *s_dest_kw,
    *s_batch_inputs, *s_reads, *s_writing, *s_before_write, *s_backward, *s_uninit, *s_async_pending,
    *s_nb_pending, *s_writes, *s_skip, *s_empty, *s_async_out, *s_output, *s_out, *s_out_kwargs, *s_evict;

static int
intern_dispatch_names(void)
{
#define I(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    I(s_rec, "rec") I(s_info, "info") I(s_plain_in, "plain_in") I(s_plain_out, "plain_out")
    I(s_hazards, "hazards") I(s_workspaces, "workspaces") I(s_cfg, "cfg") I(s_modules, "modules")
    I(s_written, "written") I(s_promote, "promote") I(s_scope, "scope") I(s_op_where, "op_where")
    I(s_busy, "busy") I(s_name, "name") I(s_dest_pos, "dest_pos") I(s_dest_kw, "dest_kw")
    I(s_batch_inputs, "batch_inputs") I(s_reads, "reads") I(s_writing, "writing")
    I(s_before_write, "before_write") I(s_backward, "backward") I(s_uninit, "uninit")
    I(s_async_pending, "async_pending") I(s_nb_pending, "nb_pending") I(s_writes, "writes")
    I(s_skip, "skip") I(s_empty, "empty") I(s_async_out, "async_out") I(s_output, "output") I(s_out, "out")
    I(s_out_kwargs, "out_kwargs") I(s_evict, "evict")
#undef I
    return 0;
}

static PyObject *
configure_dispatch(PyObject *module, PyObject *args)
{
    PyObject *names;
    if (!PyArg_ParseTuple(args, "O!:configure_dispatch", &PyTuple_Type, &names)) {
        return NULL;
    }
    Py_INCREF(names);
    Py_XSETREF(op_out_names, names);
    Py_RETURN_NONE;
}

/* The truth of obj.name; -1 on error. */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* Whether the hazard tracker holds any state (HazardTracker.active); 0 when there is none. */
static int
hazards_active(PyObject *hz)
{
    if (hz == Py_None) return 0;
    int a = attr_true(hz, s_uninit);
    if (a != 0) return a;
    a = attr_true(hz, s_async_pending);
    if (a != 0) return a;
    return attr_true(hz, s_nb_pending);
}

/* rec.busy = value. */
static int
set_busy(PyObject *rec, int value)
{
    return PyObject_SetAttr(rec, s_busy, value ? Py_True : Py_False);
}

/* The storages' data pointers of the tensors in v (a tensor, or lists and tuples of them, nested)
 * appended to ptrs (ops._tensors_in + slot.storage_ptrs). 1: done; 0: a storage is unknown
 * (written_storages returns None); -1: error. */
static int
storages_of(PyObject *v, PyObject *ptrs, int depth)
{
    int is_t = PyObject_IsInstance(v, op_tensor);
    if (is_t < 0) return -1;
    if (is_t) {
        PyObject *tp = (PyObject *)Py_TYPE(v);
        if (tp == cfg_tensor || tp == op_param) {
            PyObject *st = PyObject_CallMethodNoArgs(v, s_untyped_storage);
            PyObject *p = st == NULL ? NULL : PyObject_CallMethodNoArgs(st, s_data_ptr);
            Py_XDECREF(st);
            if (p != NULL) {
                int e = PyList_Append(ptrs, p);
                Py_DECREF(p);
                return e < 0 ? -1 : 1;
            }
            if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
            PyErr_Clear(); /* no storage to read: storage_ptrs says what it knows */
        }
        PyObject *own = PyObject_CallOneArg(cfg_storage_ptrs, v);
        if (own == NULL) return -1;
        if (own == Py_None) {
            Py_DECREF(own);
            return 0;
        }
        PyObject *r = PyNumber_InPlaceAdd(ptrs, own);
        Py_DECREF(own);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 1;
    }
    if ((PyList_Check(v) || PyTuple_Check(v)) && depth < 64) {
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(v); i++) {
            int r = storages_of(PySequence_Fast_ITEMS(v)[i], ptrs, depth + 1);
            if (r <= 0) return r;
        }
    }
    return 1;
}

/* ops.written_storages(info, args, kwargs): a new list, or None (a written storage is unknown). */
static PyObject *
written_storages_c(PyObject *info, PyObject *args, PyObject *kwargs)
{
    PyObject *ptrs = PyList_New(0), *writes = NULL, *outs = NULL, *wf = NULL, *of = NULL;
    if (ptrs == NULL) return NULL;
    if ((writes = PyObject_GetAttr(info, s_writes)) == NULL || (outs = PyObject_GetAttr(info, s_out_kwargs)) == NULL ||
        (wf = PySequence_Fast(writes, "OpInfo.writes")) == NULL || (of = PySequence_Fast(outs, "OpInfo.out_kwargs")) == NULL)
        goto fail;
    Py_ssize_t na = PyTuple_GET_SIZE(args);
    /* Python gathers the written arguments first, then their storages: the same order here. */
    for (int pass = 0; pass < 2; pass++) {
        PyObject *f = pass == 0 ? wf : of;
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(f); k++) {
            PyObject *w = NULL;
            if (pass == 0) {
                Py_ssize_t i = PyLong_AsSsize_t(PySequence_Fast_ITEMS(f)[k]);
                if (i == -1 && PyErr_Occurred()) goto fail;
                if (i < 0 || i >= na) continue;
                w = PyTuple_GET_ITEM(args, i);
            } else {
                w = PyDict_GetItemWithError(kwargs, PySequence_Fast_ITEMS(f)[k]);
                if (w == NULL) {
                    if (PyErr_Occurred()) goto fail;
                    continue;
                }
            }
            int r = storages_of(w, ptrs, 0);
            if (r < 0) goto fail;
            if (r == 0) {
                Py_DECREF(ptrs);
                ptrs = Py_NewRef(Py_None);
                goto out;
            }
        }
    }
out:
    Py_XDECREF(writes); Py_XDECREF(outs); Py_XDECREF(wf); Py_XDECREF(of);
    return ptrs;
fail:
    Py_CLEAR(ptrs);
    goto out;
}

/* Recorder.before_write(ptrs) with VersionCache.drop_storages: what waits for a batch in the
 * written storages is snapshotted (waiting.evict), or the whole batch runs when they are
 * unknown; cached digests over them are dropped. */
static int
before_write_c(PyObject *rec, PyObject *ptrs)
{
    int rc = -1;
    PyObject *waiting = NULL, *wt = NULL, *stor = NULL, *hit = NULL, *vcache = NULL, *by_storage = NULL, *by_id = NULL;
    if ((waiting = PyObject_GetAttr(rec, s_waiting)) == NULL || (wt = PyObject_GetAttr(waiting, s_tensors)) == NULL) goto out;
    int any = PyObject_IsTrue(wt);
    if (any < 0) goto out;
    if (any) {
        if (ptrs == Py_None) {
            PyObject *kwn = PyTuple_Pack(1, s_staging_kw), *meth = PyObject_GetAttr(waiting, s_run), *r = NULL;
            if (kwn != NULL && meth != NULL) {
                PyObject *argv[1] = {Py_False};
                r = PyObject_Vectorcall(meth, argv, 0, kwn);
            }
            Py_XDECREF(kwn); Py_XDECREF(meth);
            if (r == NULL) goto out;
            Py_DECREF(r);
        } else {
            if ((stor = PyObject_GetAttr(waiting, s_storages)) == NULL || (hit = PyList_New(0)) == NULL) goto out;
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ptrs); i++) {
                int in = PySequence_Contains(stor, PyList_GET_ITEM(ptrs, i));
                if (in < 0 || (in && PyList_Append(hit, PyList_GET_ITEM(ptrs, i)) < 0)) goto out;
            }
            if (PyList_GET_SIZE(hit)) {
                PyObject *r = PyObject_CallMethodOneArg(waiting, s_evict, hit);
                if (r == NULL) goto out;
                Py_DECREF(r);
            }
        }
    }
    if ((vcache = PyObject_GetAttr(rec, s_vcache)) == NULL) goto out;
    if (ptrs == Py_None) {
        PyObject *r = PyObject_CallMethodNoArgs(vcache, s_clear);
        if (r == NULL) goto out;
        Py_DECREF(r);
        rc = 0;
        goto out;
    }
    if ((by_storage = PyObject_GetAttr(vcache, s_by_storage)) == NULL) goto out;
    int some = by_storage == Py_None ? 0 : PyObject_IsTrue(by_storage);
    if (some < 0) goto out;
    if (some) {
        if (!PyDict_Check(by_storage) || (by_id = PyObject_GetAttr(vcache, s_by_id)) == NULL || !PyDict_Check(by_id)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "before_write: unexpected version cache");
            goto out;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ptrs); i++) {
            PyObject *p = PyList_GET_ITEM(ptrs, i);
            PyObject *ids = PyDict_GetItemWithError(by_storage, p);
            if (ids == NULL) {
                if (PyErr_Occurred()) goto out;
                continue;
            }
            Py_INCREF(ids);
            int e = PyDict_DelItem(by_storage, p) < 0;
            PyObject *f = e ? NULL : PySequence_Fast(ids, "version cache ids");
            e = e || f == NULL;
            for (Py_ssize_t j = 0; !e && j < PySequence_Fast_GET_SIZE(f); j++) {
                PyObject *k = PySequence_Fast_ITEMS(f)[j];
                if (PyDict_DelItem(by_id, k) < 0) {
                    if (PyErr_ExceptionMatches(PyExc_KeyError)) PyErr_Clear();
                    else e = 1;
                }
            }
            Py_XDECREF(f);
            Py_DECREF(ids);
            if (e) goto out;
        }
    }
    rc = 0;
out:
    Py_XDECREF(waiting); Py_XDECREF(wt); Py_XDECREF(stor); Py_XDECREF(hit); Py_XDECREF(vcache); Py_XDECREF(by_storage);
    Py_XDECREF(by_id);
    return rc;
}

/* rec.before_write(written_storages(info, args, kwargs)). */
static int
write_barrier(PyObject *rec, PyObject *info, PyObject *args, PyObject *kwargs)
{
    PyObject *ptrs = written_storages_c(info, args, kwargs);
    if (ptrs == NULL) return -1;
    int rc = before_write_c(rec, ptrs);
    Py_DECREF(ptrs);
    return rc;
}

static PyObject *
op_pre(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "op_pre(mode, func, args, kwargs) takes 4 arguments");
        return NULL;
    }
    if (op_out_names == NULL || op_flat_args == NULL || op_plain_py == NULL || cfg_storage_ptrs == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "op_pre: the native record path is not configured");
        return NULL;
    }
    PyObject *mode = args[0], *func = args[1], *a = args[2], *kw = args[3];
    PyObject *result = NULL, *rec = NULL, *infos = NULL, *info = NULL, *hz = NULL, *ws = NULL, *cfg = NULL,
             *mods = NULL, *vcache = NULL, *scope = NULL, *where = NULL, *gathered = NULL, *name = NULL,
             *dpos = NULL, *dkw = NULL, *call = NULL;
    if (!PyTuple_Check(a) || !PyDict_Check(kw)) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if ((rec = PyObject_GetAttr(mode, s_rec)) == NULL) goto done;
    if ((infos = PyObject_GetAttr(mode, s_info)) == NULL) goto done;
    if (!PyDict_Check(infos)) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    info = PyDict_GetItemWithError(infos, func);
    if (info == NULL) {
        if (!PyErr_Occurred()) result = Py_NewRef(Py_NotImplemented); /* first call: Python makes its OpInfo */
        goto done;
    }
    Py_INCREF(info);
    int ok = attr_true(info, s_plain_in);
    if (ok <= 0) {
        if (ok == 0) result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if ((hz = PyObject_GetAttr(mode, s_hazards)) == NULL) goto done;
    int busy_hz = hazards_active(hz);
    if (busy_hz != 0) {
        if (busy_hz > 0) result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    int any_ws = attr_true(mode, s_workspaces);
    if (any_ws != 0) {
        if (any_ws > 0) result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if ((cfg = PyObject_GetAttr(rec, s_cfg)) == NULL || (mods = PyObject_GetAttr(cfg, s_modules)) == NULL) goto done;
    if (mods != Py_None) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    /* From here on, the Python method's statements. */
    if ((vcache = PyObject_GetAttr(rec, s_vcache)) == NULL) goto done;
    int w = attr_true(vcache, s_written);
    if (w < 0) goto done;
    if (w) {
        PyObject *r = PyObject_CallMethodNoArgs(vcache, s_promote);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    if ((scope = PyObject_GetAttr(mode, s_scope)) == NULL) goto done;
    if ((where = PyObject_CallMethodNoArgs(scope, s_op_where)) == NULL) goto done;
    if (where == Py_None) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (!PyTuple_Check(where) || PyTuple_GET_SIZE(where) != 2) {
        PyErr_SetString(PyExc_TypeError, "op_pre: Scope.op_where() must return (module, phase) or None");
        goto done;
    }
    PyObject *mod = PyTuple_GET_ITEM(where, 0), *phase = PyTuple_GET_ITEM(where, 1);
    if (set_busy(rec, 1) < 0) goto done;
    if ((dpos = PyObject_GetAttr(info, s_dest_pos)) == NULL || (dkw = PyObject_GetAttr(info, s_dest_kw)) == NULL) goto done;
    PyObject *gargs[4] = {a, kw, dpos, dkw};
    if ((gathered = gather(NULL, gargs, 4)) == NULL) goto done;
    int batch = attr_true(info, s_batch_inputs);
    if (batch < 0) goto done;
    int backward = PyObject_RichCompareBool(phase, s_backward, Py_EQ);
    if (backward < 0) goto done;
    if ((name = PyObject_GetAttr(info, s_name)) == NULL) goto done;
    PyObject *reads = PyObject_GetAttr(info, s_reads);
    if (reads == NULL) goto done;
    PyObject *rargs[8] = {rec, name, mod, phase, PyTuple_GET_ITEM(gathered, 0), PyTuple_GET_ITEM(gathered, 1), reads,
                          batch && !backward ? Py_True : Py_False};
    call = record_op(NULL, rargs, 8);
    Py_DECREF(reads);
    if (call == NULL) goto done;
    int writing = attr_true(info, s_writing);
    if (writing < 0 || (writing && write_barrier(rec, info, a, kw) < 0)) goto done;
    if (set_busy(rec, 0) < 0) goto done;
    result = PyTuple_Pack(5, call, info, phase, Py_False, Py_None);
done:
    Py_XDECREF(rec); Py_XDECREF(infos); Py_XDECREF(info); Py_XDECREF(hz); Py_XDECREF(ws); Py_XDECREF(cfg);
    Py_XDECREF(mods); Py_XDECREF(vcache); Py_XDECREF(scope); Py_XDECREF(where); Py_XDECREF(gathered);
    Py_XDECREF(name); Py_XDECREF(dpos); Py_XDECREF(dkw); Py_XDECREF(call);
    return result;
}

/* ops.op_outputs(info, args, out). New list. */
static PyObject *
op_outputs_c(PyObject *info, PyObject *a, PyObject *out)
{
    PyObject *outs = PyList_New(0);
    if (outs == NULL) return NULL;
    int is_t = PyObject_IsInstance(out, op_tensor);
    if (is_t < 0) goto fail;
    if (is_t) {
        if (append_record_item(outs, s_output, Py_NewRef(s_out), out) < 0) goto fail;
        return outs;
    }
    if (PyList_Check(out) || PyTuple_Check(out)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *t = PySequence_Fast_ITEMS(out)[i];
            int it = PyObject_IsInstance(t, op_tensor);
            if (it < 0) goto fail;
            if (!it) continue;
            PyObject *nm = i < PyTuple_GET_SIZE(op_out_names) ? Py_NewRef(PyTuple_GET_ITEM(op_out_names, i))
                                                              : PyUnicode_FromFormat("out[%zd]", i);
            if (append_record_item(outs, s_output, nm, t) < 0) goto fail;
        }
    }
    if (PyList_GET_SIZE(outs) == 0) {
        /* In-place ops that return nothing (the _foreach_*_ family): the written arguments. */
        PyObject *writes = PyObject_GetAttr(info, s_writes);
        if (writes == NULL) goto fail;
        PyObject *wf = PySequence_Fast(writes, "OpInfo.writes must be a sequence");
        Py_DECREF(writes);
        if (wf == NULL) goto fail;
        Py_ssize_t nw = PySequence_Fast_GET_SIZE(wf), na = PyTuple_GET_SIZE(a);
        for (Py_ssize_t k = 0; k < nw; k++) {
            Py_ssize_t i = PyLong_AsSsize_t(PySequence_Fast_ITEMS(wf)[k]);
            if (i == -1 && PyErr_Occurred()) {
                Py_DECREF(wf);
                goto fail;
            }
            if (i < 0 || i >= na) continue;
            PyObject *v = PyTuple_GET_ITEM(a, i);
            int it = PyObject_IsInstance(v, op_tensor);
            int e = it < 0 ? -1 : 0;
            if (it > 0) {
                e = append_record_item(outs, s_output, PyUnicode_FromFormat("args[%zd]", i), v);
            } else if (it == 0 && (PyList_Check(v) || PyTuple_Check(v))) {
                PyObject *base = PyUnicode_FromFormat("args[%zd]", i);
                Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
                for (Py_ssize_t j = 0; base != NULL && e == 0 && j < n; j++) {
                    PyObject *x = PySequence_Fast_ITEMS(v)[j];
                    int xt = PyObject_IsInstance(x, op_tensor);
                    if (xt < 0) e = -1;
                    else if (xt) e = append_record_item(outs, s_output, element_name(base, j), x);
                }
                if (base == NULL) e = -1;
                Py_XDECREF(base);
            }
            if (e < 0) {
                Py_DECREF(wf);
                goto fail;
            }
        }
        Py_DECREF(wf);
    }
    return outs;
fail:
    Py_DECREF(outs);
    return NULL;
}

/* VersionCache.note_written(the tensors of outs). */
static int
note_written(PyObject *vcache, PyObject *outs)
{
    PyObject *by_id = PyObject_GetAttr(vcache, s_by_id);
    if (by_id == NULL) return -1;
    PyObject *written = PyObject_GetAttr(vcache, s_written);
    int rc = -1;
    if (written == NULL || !PyDict_Check(by_id) || !PyList_Check(written)) {
        if (written != NULL) PyErr_SetString(PyExc_TypeError, "note_written: unexpected version cache");
        goto out;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outs); i++) {
        PyObject *t = PyTuple_GET_ITEM(PyList_GET_ITEM(outs, i), 2);
        PyObject *key = PyLong_FromVoidPtr(t);
        if (key == NULL) goto out;
        PyObject *sl = PyDict_GetItemWithError(by_id, key);
        Py_DECREF(key);
        if (sl == NULL) {
            if (PyErr_Occurred()) goto out;
            continue;
        }
        Py_INCREF(sl);
        PyObject *v = SLOT_FIELD(sl, version, "version");
        PyObject *entry = v == NULL ? NULL : PyTuple_Pack(3, t, sl, v);
        Py_DECREF(sl);
        Py_XDECREF(v);
        if (entry == NULL) goto out;
        int e = PyList_Append(written, entry);
        Py_DECREF(entry);
        if (e < 0) goto out;
    }
    rc = 0;
out:
    Py_DECREF(by_id);
    Py_XDECREF(written);
    return rc;
}

static PyObject *
op_post(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "op_post(mode, pre, args, kwargs, out) takes 5 arguments");
        return NULL;
    }
    if (op_out_names == NULL || op_plain_py == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "op_post: the native record path is not configured");
        return NULL;
    }
    PyObject *mode = args[0], *pre = args[1], *a = args[2], *out = args[4];
    if (!PyTuple_Check(pre) || PyTuple_GET_SIZE(pre) != 5 || !PyTuple_Check(a)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *call = PyTuple_GET_ITEM(pre, 0), *info = PyTuple_GET_ITEM(pre, 1), *phase = PyTuple_GET_ITEM(pre, 2),
             *taint = PyTuple_GET_ITEM(pre, 3), *source = PyTuple_GET_ITEM(pre, 4);
    if (call == Py_None || source != Py_None) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    int t_taint = PyObject_IsTrue(taint);
    if (t_taint != 0) {
        if (t_taint < 0) return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *result = NULL, *rec = NULL, *hz = NULL, *outs = NULL, *vcache = NULL;
    int ok = attr_true(info, s_plain_out);
    if (ok <= 0) {
        if (ok == 0) result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if ((hz = PyObject_GetAttr(mode, s_hazards)) == NULL) goto done;
    int busy_hz = hazards_active(hz);
    if (busy_hz != 0) {
        if (busy_hz > 0) result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    /* The Python method's statements (no hazard state, none to track: see the checks above). */
    if ((rec = PyObject_GetAttr(mode, s_rec)) == NULL) goto done;
    if (set_busy(rec, 1) < 0) goto done;
    if ((outs = op_outputs_c(info, a, out)) == NULL) goto done;
    int fresh = attr_true(info, s_writing);
    if (fresh < 0) goto done;
    if (PyList_GET_SIZE(outs) > 0) {
        int skip = attr_true(info, s_skip), empty = attr_true(info, s_empty), aout = attr_true(info, s_async_out);
        if (skip < 0 || empty < 0 || aout < 0) goto done;
        int backward = PyObject_RichCompareBool(phase, s_backward, Py_EQ);
        if (backward < 0) goto done;
        if (append_fast_c(rec, call, outs, !(skip || empty || aout), fresh ? Py_True : Py_False,
                          backward ? Py_False : Py_True) < 0) goto done;
        if (fresh) {
            if ((vcache = PyObject_GetAttr(rec, s_vcache)) == NULL || note_written(vcache, outs) < 0) goto done;
        }
    }
    if (set_busy(rec, 0) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(rec); Py_XDECREF(hz); Py_XDECREF(outs); Py_XDECREF(vcache);
    return result;
}

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
    unsigned long long *y = (unsigned long long *)(uintptr_t)lanes_addr;
    const unsigned char *keys = (const unsigned char *)(uintptr_t)rt_keys_addr;
    int trc;
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
    if ((next = PyLong_FromSsize_t(used + 1)) == NULL || PyObject_SetAttr(rt_pool, s_used, next) < 0) goto out;
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
    if (p == NULL) return -1;
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
        if (nbytes >= (1 << 16)) { /* (a small one: not worth handing the interpreter to another thread) */
            Py_BEGIN_ALLOW_THREADS
            rc = tree_api->tree(isa, (const unsigned char *)(uintptr_t)addr, nbytes, keys, (int)nkeys, y + 2 * k);
            Py_END_ALLOW_THREADS
        } else {
            rc = tree_api->tree(isa, (const unsigned char *)(uintptr_t)addr, nbytes, keys, (int)nkeys, y + 2 * k);
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

/* ------------------------------------------------------------------------------------------
 * by_identity(items): (distinct, index, first) of a list: the distinct objects in order of
 * first appearance (by identity), each item's position among them, and the item position where
 * each first appears. records.call_index in C: the flush groups a window's records by call.
 * ------------------------------------------------------------------------------------------ */
static PyObject *
by_identity(PyObject *module, PyObject *items)
{
    if (!PyList_Check(items)) {
        PyErr_SetString(PyExc_TypeError, "by_identity(items: list)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    PyObject *distinct = PyList_New(0), *index = PyList_New(n), *first = PyList_New(0), *seen = PyDict_New();
    PyObject *result = NULL, *prev = NULL, *prev_i = NULL;
    if (distinct == NULL || index == NULL || first == NULL || seen == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(items, i);
        PyObject *pos;
        if (x == prev) { /* records of one call are mostly consecutive */
            pos = Py_NewRef(prev_i);
        } else {
            PyObject *key = PyLong_FromVoidPtr(x);
            if (key == NULL) goto done;
            pos = PyDict_GetItemWithError(seen, key);
            if (pos != NULL) {
                Py_INCREF(pos);
            } else if (PyErr_Occurred()) {
                Py_DECREF(key);
                goto done;
            } else {
                PyObject *at = PyLong_FromSsize_t(i);
                pos = PyLong_FromSsize_t(PyList_GET_SIZE(distinct));
                int e = at == NULL || pos == NULL || PyDict_SetItem(seen, key, pos) < 0 ||
                        PyList_Append(distinct, x) < 0 || PyList_Append(first, at) < 0;
                Py_XDECREF(at);
                if (e) {
                    Py_XDECREF(pos);
                    Py_DECREF(key);
                    goto done;
                }
            }
            Py_DECREF(key);
            prev = x;
            Py_XSETREF(prev_i, Py_NewRef(pos));
        }
        PyList_SET_ITEM(index, i, pos);
    }
    result = PyTuple_Pack(3, distinct, index, first);
done:
    Py_XDECREF(distinct); Py_XDECREF(index); Py_XDECREF(first); Py_XDECREF(seen); Py_XDECREF(prev_i);
    return result;
}

/* ------------------------------------------------------------------------------------------
 * A step boundary's batch of single-tensor records (hot.append_batch), its two loops in C:
 *   batch_slots(rec, specs, fresh) -> (slots, missing tensors, their new slots): every spec's
 *       cached digest, else a new Slot (cached at the tensor's version, as append_batch does
 *       once the batch started; the caller starts the missing digests);
 *   batch_records(rec, specs, slots) -> the call of each record, appended to the buffer.
 * A spec is a call.RecordSpec: (call, kind, name, module, phase, role, arg, tensor).
 * ------------------------------------------------------------------------------------------ */

enum { SP_CALL, SP_KIND, SP_NAME, SP_MODULE, SP_PHASE, SP_ROLE, SP_ARG, SP_TENSOR, SP_FIELDS };

static int
check_specs(PyObject *specs)
{
    if (!PyList_Check(specs)) {
        PyErr_SetString(PyExc_TypeError, "specs must be a list of RecordSpec");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(specs); i++) {
        PyObject *sp = PyList_GET_ITEM(specs, i);
        if (!PyTuple_Check(sp) || PyTuple_GET_SIZE(sp) != SP_FIELDS) {
            PyErr_SetString(PyExc_TypeError, "specs must be a list of RecordSpec");
            return -1;
        }
    }
    return 0;
}

static PyObject *
batch_slots(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "batch_slots(rec, specs, fresh) takes 3 arguments");
        return NULL;
    }
    PyObject *rec = args[0], *specs = args[1];
    int fresh = PyObject_IsTrue(args[2]);
    if (fresh < 0 || check_specs(specs) < 0) return NULL;
    if (cfg_plain == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "batch_slots: configure() was not called");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(specs);
    PyObject *vcache = NULL, *by_id = NULL, *slots = PyList_New(n), *versions = PyList_New(n), *mt = PyList_New(0),
             *ms = PyList_New(0), *result = NULL;
    if (slots == NULL || versions == NULL || mt == NULL || ms == NULL) goto done;
    if ((vcache = PyObject_GetAttr(rec, s_vcache)) == NULL || (by_id = PyObject_GetAttr(vcache, s_by_id)) == NULL)
        goto done;
    if (!PyDict_Check(by_id)) {
        PyErr_SetString(PyExc_TypeError, "batch_slots: the version cache must be a dict");
        goto done;
    }
    /* Every lookup first, then the new slots (a tensor twice in one batch misses twice, as in Python). */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(PyList_GET_ITEM(specs, i), SP_TENSOR);
        PyObject *version = PyObject_GetAttr(t, s_version);
        if (version == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) goto done;
            PyErr_Clear();
            version = Py_NewRef(Py_None);
        }
        PyList_SET_ITEM(versions, i, version);
        PyObject *hit = Py_NewRef(Py_None);
        if (version != Py_None && !fresh) {
            PyObject *key = PyLong_FromVoidPtr(t);
            if (key == NULL) goto done;
            Py_SETREF(hit, cache_get(by_id, key, t, version));
            Py_DECREF(key);
            if (hit == NULL) goto done;
        }
        PyList_SET_ITEM(slots, i, hit);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_ITEM(slots, i) != Py_None) continue;
        PyObject *t = PyTuple_GET_ITEM(PyList_GET_ITEM(specs, i), SP_TENSOR);
        PyObject *sl = new_slot(Py_None);
        if (sl == NULL) goto done;
        PyList_SetItem(slots, i, sl); /* steals sl, drops the None */
        if (PyList_Append(mt, t) < 0 || PyList_Append(ms, sl) < 0) goto done;
        PyObject *version = PyList_GET_ITEM(versions, i);
        if (version != Py_None) {
            PyObject *key = PyLong_FromVoidPtr(t);
            int e = key == NULL || cache_put(vcache, key, t, sl, version, NULL) < 0;
            Py_XDECREF(key);
            if (e) goto done;
        }
    }
    result = PyTuple_Pack(3, slots, mt, ms);
done:
    Py_XDECREF(vcache); Py_XDECREF(by_id); Py_XDECREF(slots); Py_XDECREF(versions); Py_XDECREF(mt); Py_XDECREF(ms);
    return result;
}

static PyObject *
batch_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "batch_records(rec, specs, slots) takes 3 arguments");
        return NULL;
    }
    PyObject *rec = args[0], *specs = args[1], *slots = args[2];
    if (check_specs(specs) < 0) return NULL;
    if (!PyList_Check(slots) || PyList_GET_SIZE(slots) != PyList_GET_SIZE(specs)) {
        PyErr_SetString(PyExc_TypeError, "batch_records: one slot per spec");
        return NULL;
    }
    if (cfg_plain == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "batch_records: configure() was not called");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(specs);
    PyObject *records = NULL, *rows = NULL, *occ = NULL, *step = NULL, *mb = NULL, *seq = NULL, *calls = PyList_New(n),
             *result = NULL;
    if (calls == NULL) goto done;
    if ((records = PyObject_GetAttr(rec, s_records)) == NULL || (rows = PyObject_GetAttr(records, s_rows)) == NULL ||
        (occ = PyObject_GetAttr(rec, s_occ)) == NULL || (step = PyObject_GetAttr(rec, s_step)) == NULL ||
        (mb = PyObject_GetAttr(rec, s_microbatch)) == NULL || (seq = PyObject_GetAttr(rec, s_seq)) == NULL)
        goto done;
    if (!PyList_Check(rows) || !PyDict_Check(occ)) {
        PyErr_SetString(PyExc_TypeError, "batch_records: unexpected recorder state");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *sp = PyList_GET_ITEM(specs, i), *sl = PyList_GET_ITEM(slots, i);
        PyObject *t = PyTuple_GET_ITEM(sp, SP_TENSOR);
        PyObject *call = Py_NewRef(PyTuple_GET_ITEM(sp, SP_CALL));
        PyObject *dt = NULL, *dstr = NULL, *shape = NULL, *stup = NULL, *numel = NULL, *next = NULL;
        int e = 0;
        if (call == Py_None) {
            PyObject *key = PyTuple_Pack(5, mb, PyTuple_GET_ITEM(sp, SP_PHASE), PyTuple_GET_ITEM(sp, SP_MODULE),
                                         PyTuple_GET_ITEM(sp, SP_KIND), PyTuple_GET_ITEM(sp, SP_NAME));
            PyObject *k = key == NULL ? NULL : PyDict_GetItemWithError(occ, key);
            PyObject *o = k != NULL ? Py_NewRef(k) : (key == NULL || PyErr_Occurred()) ? NULL : PyLong_FromLong(0);
            PyObject *o1 = o == NULL ? NULL : PyNumber_Add(o, one);
            e = o1 == NULL || PyDict_SetItem(occ, key, o1) < 0;
            if (!e) {
                Py_SETREF(call, PyTuple_Pack(9, step, mb, PyTuple_GET_ITEM(sp, SP_PHASE), PyTuple_GET_ITEM(sp, SP_MODULE),
                                             PyTuple_GET_ITEM(sp, SP_KIND), PyTuple_GET_ITEM(sp, SP_NAME), o, Py_None,
                                             Py_False));
                e = call == NULL;
            }
            Py_XDECREF(key); Py_XDECREF(o); Py_XDECREF(o1);
        }
        e = e || (dt = PyObject_GetAttr(t, s_dtype)) == NULL || (dstr = memo_or_call(cfg_dtype_str, dt, cfg_dtype_fn)) == NULL ||
            (shape = PyObject_GetAttr(t, s_shape)) == NULL || (stup = memo_or_call(cfg_shapes, shape, cfg_shape_fn)) == NULL ||
            (numel = PyObject_CallMethodNoArgs(t, s_numel)) == NULL;
        if (!e) {
            PyObject *row[9] = {call, seq, PyTuple_GET_ITEM(sp, SP_ROLE), PyTuple_GET_ITEM(sp, SP_ARG), dstr, stup, numel,
                                sl, cfg_no_hazards};
            for (int k = 0; k < 9 && !e; k++) e = PyList_Append(rows, row[k]) < 0;
        }
        if (!e) {
            e = (next = PyNumber_Add(seq, one)) == NULL;
            if (!e) Py_SETREF(seq, next);
        }
        Py_XDECREF(dt); Py_XDECREF(dstr); Py_XDECREF(shape); Py_XDECREF(stup); Py_XDECREF(numel);
        if (e) {
            Py_XDECREF(call);
            goto done;
        }
        PyList_SET_ITEM(calls, i, call); /* steals */
    }
    if (PyObject_SetAttr(rec, s_seq, seq) < 0) goto done;
    result = Py_NewRef(calls);
done:
    Py_XDECREF(records); Py_XDECREF(rows); Py_XDECREF(occ); Py_XDECREF(step); Py_XDECREF(mb); Py_XDECREF(seq);
    Py_XDECREF(calls);
    return result;
}

static PyMethodDef module_methods[] = {
    {"copy_bytes", (PyCFunction)(void (*)(void))copy_bytes, METH_FASTCALL,
     "copy_bytes(dst, src, n): copy n bytes between two addresses (memcpy)."},
    {"configure", (PyCFunction)configure, METH_VARARGS,
     "configure(plain, tensor, int64, dtype_str, dtype_fn, shapes, shape_fn, staging, digest, storage_ptrs, "
     "no_hazards, limit): the Python objects append_plain uses."},
    {"append_plain", (PyCFunction)(void (*)(void))append_plain, METH_FASTCALL,
     "append_plain(rec, call, tensors, fresh, defer): hot.append_plain in C; NotImplemented: use Python's."},
    {"configure_op", (PyCFunction)configure_op, METH_VARARGS,
     "configure_op(parameter, has_subclass, append_plain_py, defer_max, defer_bytes): what append_fast uses."},
    {"configure_dispatch", (PyCFunction)configure_dispatch, METH_VARARGS,
     "configure_dispatch(out_names): what op_pre and op_post use (with what configure and configure_op set)."},
    {"op_pre", (PyCFunction)(void (*)(void))op_pre, METH_FASTCALL,
     "op_pre(mode, func, args, kwargs): CaptureMode._pre for plain ops; NotImplemented: use Python's."},
    {"op_post", (PyCFunction)(void (*)(void))op_post, METH_FASTCALL,
     "op_post(mode, pre, args, kwargs, out): CaptureMode._post for plain ops; NotImplemented: use Python's."},
    {"configure_roots", (PyCFunction)configure_roots, METH_VARARGS,
     "configure_roots(tree_capsule, special_dtypes, strided, batched, pool, versions_state, v2_scheme, keys, nkeys, "
     "cpu): what roots_fill and append_plain's record-time route use."},
    {"roots_fill", (PyCFunction)(void (*)(void))roots_fill, METH_FASTCALL,
     "roots_fill(tensors, slots, held, lanes_addr, first_row, keys_addr, nkeys, device): version-2 roots of plain contiguous "
     "CPU tensors into held's lanes and their slots; returns the indices not taken."},
    {"batch_slots", (PyCFunction)(void (*)(void))batch_slots, METH_FASTCALL,
     "batch_slots(rec, specs, fresh): (slots, missing tensors, their new slots) of a step boundary's batch."},
    {"batch_records", (PyCFunction)(void (*)(void))batch_records, METH_FASTCALL,
     "batch_records(rec, specs, slots): a step boundary's records appended; the call of each."},
    {"by_identity", (PyCFunction)by_identity, METH_O,
     "by_identity(items): (distinct, index, first): the distinct objects of a list by identity, each item's "
     "position among them, and where each first appears."},
    {"configure_gather", (PyCFunction)configure_gather, METH_VARARGS,
     "configure_gather(tensor, arg_names, flat_args, flat_marker, open_marker, close_marker): what gather uses."},
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL,
     "gather(args, kwargs, dest_pos, dest_kw): ops.gather in C."},
    {"append_fast", (PyCFunction)(void (*)(void))append_fast, METH_FASTCALL,
     "append_fast(rec, call, tensors, digest_it, fresh, defer): hot.append_fast in C."},
    {"record_op", (PyCFunction)(void (*)(void))record_op, METH_FASTCALL,
     "record_op(rec, name, module, phase, tensors, args_src, digest_it, defer): hot.record_op in C."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_hostpath", "Native helpers of capture's record path.", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__hostpath(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) {
        return NULL;
    }
    PyObject *tp = PyType_FromSpec(&slot_spec);
    if (tp == NULL || intern_names() < 0 || intern_op_names() < 0 || intern_dispatch_names() < 0 || intern_root_names() < 0) {
        Py_XDECREF(tp);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(tp);
    SlotType = (PyTypeObject *)tp; /* kept for the module's lifetime (never unloaded) */
    if (PyModule_AddObject(m, "Slot", tp) < 0) {
        Py_DECREF(tp);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
