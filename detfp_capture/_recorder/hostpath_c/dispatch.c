/* Part of _hostpath.c: op_pre: CaptureMode._pre for plain ops, and a writing op's barrier (post.c: op_post).
 * Included by _hostpath.c and compiled with it as one unit (the parts share its static state);
 * not built on its own. */

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
    *s_nb_pending, *s_writes, *s_skip, *s_async_out, *s_output, *s_out, *s_out_kwargs, *s_evict;

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
    I(s_skip, "skip") I(s_async_out, "async_out") I(s_output, "output") I(s_out, "out")
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
    int is_t = PyObject_IsInstance(v, cfg_tensor);
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
    /* Python gathers the written arguments first, then their storages: the same order here. */
    for (int pass = 0; pass < 2; pass++) {
        PyObject *f = pass == 0 ? wf : of;
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(f); k++) {
            PyObject *w = NULL;
            if (pass == 0) {
                Py_ssize_t i;
                int got = written_arg(f, k, args, &i, &w);
                if (got < 0) goto fail;
                if (got == 0) continue;
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
            if (waiting_run(waiting) < 0) goto out;
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
    if (op_out_names == NULL || op_mark_flat == NULL || op_plain_py == NULL || cfg_storage_ptrs == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "op_pre: the native record path is not configured");
        return NULL;
    }
    PyObject *mode = args[0], *func = args[1], *a = args[2], *kw = args[3];
    PyObject *result = NULL, *rec = NULL, *infos = NULL, *info = NULL, *hz = NULL, *cfg = NULL,
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
    Py_XDECREF(rec); Py_XDECREF(infos); Py_XDECREF(info); Py_XDECREF(hz); Py_XDECREF(cfg);
    Py_XDECREF(mods); Py_XDECREF(vcache); Py_XDECREF(scope); Py_XDECREF(where); Py_XDECREF(gathered);
    Py_XDECREF(name); Py_XDECREF(dpos); Py_XDECREF(dkw); Py_XDECREF(call);
    return result;
}
