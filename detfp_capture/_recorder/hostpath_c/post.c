/* Part of _hostpath.c: op_post (CaptureMode._post for plain ops: the outputs' records, the
 * version cache's writes), after dispatch.c, whose interned names and helpers it uses. Split
 * from dispatch.c by the C files' size rule (docs/architecture-capture.md). */

/* ops.op_outputs(info, args, out). New list. */
static PyObject *
op_outputs_c(PyObject *info, PyObject *a, PyObject *out)
{
    PyObject *outs = PyList_New(0);
    if (outs == NULL) return NULL;
    int is_t = PyObject_IsInstance(out, cfg_tensor);
    if (is_t < 0) goto fail;
    if (is_t) {
        if (append_record_item(outs, s_output, Py_NewRef(s_out), out) < 0) goto fail;
        return outs;
    }
    if (PyList_Check(out) || PyTuple_Check(out)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *t = PySequence_Fast_ITEMS(out)[i];
            int it = PyObject_IsInstance(t, cfg_tensor);
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
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(wf); k++) {
            Py_ssize_t i;
            PyObject *v = NULL;
            int got = written_arg(wf, k, a, &i, &v);
            if (got < 0) {
                Py_DECREF(wf);
                goto fail;
            }
            if (got == 0) continue;
            int it = PyObject_IsInstance(v, cfg_tensor);
            int e = it < 0 ? -1 : 0;
            if (it > 0) {
                e = append_record_item(outs, s_output, arg_name(i), v);
            } else if (it == 0 && (PyList_Check(v) || PyTuple_Check(v))) {
                PyObject *base = arg_name(i);
                e = base == NULL ? -1 : gather_list(outs, s_output, base, v);
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
        PyObject *entry = v == NULL || v == Py_None ? NULL : PyTuple_Pack(3, t, sl, v);
        int skip = v == Py_None; /* (a cached Slot always has its version) */
        Py_DECREF(sl);
        Py_XDECREF(v);
        if (skip) continue;
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
        /* digest_it = not (skip or empty or async_out); plain_out already says not empty. */
        int skip = attr_true(info, s_skip), aout = attr_true(info, s_async_out);
        if (skip < 0 || aout < 0) goto done;
        int backward = PyObject_RichCompareBool(phase, s_backward, Py_EQ);
        if (backward < 0) goto done;
        if (append_fast_c(rec, call, outs, !(skip || aout), fresh ? Py_True : Py_False,
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
