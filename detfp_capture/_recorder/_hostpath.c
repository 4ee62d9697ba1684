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

static PyMethodDef module_methods[] = {
    {"copy_bytes", (PyCFunction)(void (*)(void))copy_bytes, METH_FASTCALL,
     "copy_bytes(dst, src, n): copy n bytes between two addresses (memcpy)."},
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
    if (tp == NULL || PyModule_AddObject(m, "Slot", tp) < 0) {
        Py_XDECREF(tp);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
