/* Part of _hostpath.c: record_plain: Recorder.record_call for the calls nothing is asked of per record.
 * Included by _hostpath.c after ops.c (whose record_call_c it shares with record_op) and
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
    int is_compiled = PyObject_IsTrue(args[6]);
    if (is_compiled < 0) return NULL;
    return record_call_c(args[0], args[1], args[2], args[3], args[4], args[5], Py_None,
                         is_compiled ? Py_True : Py_False, 1, args[7], Py_False);
}
