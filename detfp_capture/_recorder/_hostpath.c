/* The native record path (optional: without it the record path runs in Python and writes the
 * same trace; tests/golden/test_capture_routes.py and tests/unit/test_record_native_paths.py hold
 * the two to each other). This file: the module, the Slot type and the byte copy; the rest in
 * hostpath_c/, #included below (one translation unit):
 *   append.c    append_plain's helpers (the version cache, the deferred branch, a record row);
 *   plain.c     append_plain, one call's records (hot.append_plain_py);
 *   ops.c       gather, flat_args, append_fast, record_op, counted records;
 *   calls.c     record_plain (Recorder.record_call for the hooks' plain calls);
 *   dispatch.c  op_pre (CaptureMode._pre for plain ops), a writing op's barrier;
 *   post.c      op_post (CaptureMode._post for plain ops);
 *   roots.c     digests computed at record time on CPU (roots_fill, root_now);
 *   batch.c     by_identity and args_key (the flush's records by call, their arguments' memo
 *               key), a step boundary's batch;
 *   resolve.c   the flush's per-slot loops around the bulk resolution of batched digests.
 * Each function says which Python it stands for; a call it does not handle returns
 * NotImplemented before changing anything, and the Python does it.
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
#include <time.h>

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

/* A weak reference the capture holds until a flush (a cached digest's tensor), not tracked by
 * the cyclic collector. One without a callback holds no strong reference, so it cannot be part
 * of a cycle; tracked, the window's hundreds of them survive the young collections, are promoted,
 * and bring on full collections of the whole heap (as the Python Slot did). The collector
 * clears a dead referent's weak references through the referent, tracked or not. */
static void
untrack_ref(PyObject *ref)
{
    if (PyWeakref_CheckRefExact(ref) && ((PyWeakReference *)ref)->wr_callback == NULL && PyObject_GC_IsTracked(ref)) {
        PyObject_GC_UnTrack(ref);
    }
}

static PyObject *
untracked_ref(PyObject *module, PyObject *t)
{
    PyObject *ref = PyWeakref_NewRef(t, NULL);
    if (ref != NULL) {
        untrack_ref(ref);
    }
    return ref;
}


/* The record path's functions, by job (one translation unit: they share the state above). */
#include "hostpath_c/append.c"
#include "hostpath_c/plain.c"
#include "hostpath_c/ops.c"
#include "hostpath_c/calls.c"
#include "hostpath_c/dispatch.c"
#include "hostpath_c/post.c"
#include "hostpath_c/roots.c"
#include "hostpath_c/batch.c"
#include "hostpath_c/resolve.c"

static PyMethodDef module_methods[] = {
    {"untracked_ref", (PyCFunction)untracked_ref, METH_O,
     "untracked_ref(t): weakref.ref(t), not tracked by the cyclic collector (no callback: no cycle)."},
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
     "roots_fill(tensors, slots, held, lanes_addr, first_row): version-2 roots of plain contiguous CPU tensors "
     "into held's lanes and their slots; returns the indices not taken."},
    {"batch_slots", (PyCFunction)(void (*)(void))batch_slots, METH_FASTCALL,
     "batch_slots(rec, specs, fresh): (slots, missing tensors, their new slots) of a step boundary's batch."},
    {"batch_records", (PyCFunction)(void (*)(void))batch_records, METH_FASTCALL,
     "batch_records(rec, specs, slots): a step boundary's records appended; the call of each."},
    {"configure_args", (PyCFunction)configure_args, METH_O, "configure_args(flat_marker): what args_key uses."},
    {"args_key", (PyCFunction)args_key, METH_O, "args_key(src): args._args_key in C (the same keys)."},
    {"root_stats", (PyCFunction)root_stats, METH_NOARGS,
     "root_stats(): (calls, bytes, seconds in the tree function) of the record-time route in this process."},
    {"rows_plan", (PyCFunction)(void (*)(void))rows_plan, METH_FASTCALL,
     "rows_plan(items, meta_words): _digest.resolve._rows_plan in C (the same plan)."},
    {"scatter", (PyCFunction)(void (*)(void))scatter, METH_FASTCALL,
     "scatter(his, los, order, words): _digest.resolve._scatter in C."},
    {"split_rows", (PyCFunction)(void (*)(void))split_rows, METH_FASTCALL,
     "split_rows(slots, batched): (the batched rows without a pointer flag, the rest)."},
    {"assign_rows", (PyCFunction)(void (*)(void))assign_rows, METH_FASTCALL,
     "assign_rows(rows, his, los): each slot's words set (pending None); the slots whose hi is None."},
    {"by_identity", (PyCFunction)by_identity, METH_O,
     "by_identity(items): (distinct, index, first): the distinct objects of a list by identity, each item's "
     "position among them, and where each first appears."},
    {"configure_gather", (PyCFunction)configure_gather, METH_VARARGS,
     "configure_gather(arg_names, flat_marker, open_marker, close_marker): what gather uses."},
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL,
     "gather(args, kwargs, dest_pos, dest_kw): args.gather in C."},
    {"append_fast", (PyCFunction)(void (*)(void))append_fast, METH_FASTCALL,
     "append_fast(rec, call, tensors, digest_it, fresh, defer): hot.append_fast_py in C."},
    {"record_op", (PyCFunction)(void (*)(void))record_op, METH_FASTCALL,
     "record_op(rec, name, module, phase, tensors, args_src, digest_it, defer): hot.record_op_py in C."},
    {"record_plain", (PyCFunction)(void (*)(void))record_plain, METH_FASTCALL,
     "record_plain(rec, kind, name, module, phase, tensors, compiled, fresh): Recorder.record_call's plain case in C."},
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
    if (tp == NULL || intern_names() < 0 || intern_op_names() < 0 || intern_dispatch_names() < 0 || intern_root_names() < 0 || intern_resolve_names() < 0) {
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
