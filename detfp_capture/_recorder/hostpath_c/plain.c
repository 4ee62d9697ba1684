/* Part of _hostpath.c: append_plain itself (hot.append_plain_py in C), after append.c's helpers
 * (the version cache's get/put, the deferred branch, one record onto the buffer), which it uses.
 * Split from append.c by the C files' size rule (docs/architecture-capture.md). */

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
    /* A copy: the loop calls back into Python, which must not resize what it walks. */
    PyObject *seqlist = PySequence_Tuple(tensors);
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
        PyObject *version = NULL, *s = NULL, *dt = NULL, *numel = NULL, *key = NULL, *ptr = NULL;
        int ok = -1;
        if ((version = version_or_none(t)) == NULL) goto item_done;
        key = PyLong_FromVoidPtr(t);
        if (key == NULL) goto item_done;
        if (version != Py_None && !fresh) {
            s = cache_get(by_id, key, t, version);
            if (s == NULL) goto item_done;
            if (s == Py_None) Py_CLEAR(s);
        }
        if ((dt = PyObject_GetAttr(t, s_dtype)) == NULL) goto item_done;
        if ((numel = PyObject_CallMethodNoArgs(t, s_numel)) == NULL) goto item_done;
        if (s == NULL) {
            if (defer && version != Py_None && dt != cfg_int64 && (PyObject *)Py_TYPE(t) == cfg_tensor) {
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
            if (version != Py_None && cache_put(vcache, by_id, key, t, s, version, ptr) < 0) goto item_done;
        }
        if (push_record(rows, call, &seq, role, arg, t, dt, numel, s) < 0) goto item_done;
        ok = 0;
    item_done:
        Py_XDECREF(version); Py_XDECREF(s); Py_XDECREF(dt); Py_XDECREF(numel); Py_XDECREF(key);
        Py_XDECREF(ptr);
        if (ok < 0) goto done;
    }
    if (PyObject_SetAttr(rec, s_seq, seq) < 0) goto done;
    if (stage_t != NULL) {
        /* (root_now has offered them to the record-time route, once it is configured) */
        PyObject *r = PyObject_CallMethodObjArgs(waiting, s_stage, stage_t, stage_s, rt_pool != NULL ? Py_True : Py_False,
                                                 NULL);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(seqlist); Py_XDECREF(vcache); Py_XDECREF(waiting); Py_XDECREF(records); Py_XDECREF(rows);
    Py_XDECREF(seq); Py_XDECREF(by_id); Py_XDECREF(stage_t); Py_XDECREF(stage_s); Py_XDECREF(inflight);
    return result;
}
