/* Part of _hostpath.c: record_plain: Recorder.record_call for the calls nothing is asked of per record.
 * Included by _hostpath.c after ops.c (whose occurrence count and append_fast_c it uses) and
 * compiled with it as one unit; not built on its own.
 *
 *   record_plain(rec, kind, name, module, phase, tensors, compiled, fresh)
 *       Recorder.record_call(kind, name, module, phase, tensors, compiled=compiled, fresh=fresh):
 *       the next occurrence, the call tuple (no arguments), the records appended as
 *       append_records appends them without hazards, rows or a deferred digest (append_fast_c:
 *       the plain appends, or Recorder.append_records for a subclass or per-record options).
 *
 * The module, gradient and step hooks record through it (seam.RecordPath.record_plain): their
 * calls carry no argument tuple and, with no hazard state, no hazards. */

static PyObject *
record_plain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "record_plain(rec, kind, name, module, phase, tensors, compiled, fresh) takes 8 arguments");
        return NULL;
    }
    if (op_plain_py == NULL || cfg_plain == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "record_plain: configure() and configure_op() were not called");
        return NULL;
    }
    PyObject *rec = args[0], *kind = args[1], *name = args[2], *mod = args[3], *phase = args[4], *tensors = args[5];
    int is_compiled = PyObject_IsTrue(args[6]);
    if (is_compiled < 0) return NULL;
    PyObject *compiled = is_compiled ? Py_True : Py_False;
    PyObject *mb = NULL, *occ = NULL, *n = NULL, *step = NULL, *call = NULL;
    if ((mb = PyObject_GetAttr(rec, s_microbatch)) == NULL) goto fail;
    if ((occ = PyObject_GetAttr(rec, s_occ)) == NULL) goto fail;
    if ((n = next_occurrence(occ, mb, phase, mod, kind, name)) == NULL) goto fail;
    if ((step = PyObject_GetAttr(rec, s_step)) == NULL) goto fail;
    if ((call = PyTuple_Pack(9, step, mb, phase, mod, kind, name, n, Py_None, compiled)) == NULL) goto fail;
    int has = PyObject_IsTrue(tensors);
    if (has < 0) goto fail;
    if (has && append_fast_c(rec, call, tensors, 1, args[7], Py_False) < 0) goto fail;
    Py_DECREF(mb); Py_DECREF(occ); Py_DECREF(n); Py_DECREF(step);
    return call;
fail:
    Py_XDECREF(mb); Py_XDECREF(occ); Py_XDECREF(n); Py_XDECREF(step);
    Py_XDECREF(call);
    return NULL;
}
