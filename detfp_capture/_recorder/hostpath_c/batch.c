/* Part of _hostpath.c: by_identity and args_key (the flush's records by call, their arguments' memo
 * key) and a step boundary's batch of records.
 * Included by _hostpath.c and compiled with it as one unit (the parts share its static state);
 * not built on its own. */

/* ------------------------------------------------------------------------------------------
 * by_identity(items): (distinct, index, first) of a list: the distinct objects in order of
 * first appearance (by identity), each item's position among them, and the item position where
 * each first appears. records.by_identity in C: the flush groups a window's records by call.
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
        PyObject *version = version_or_none(t);
        if (version == NULL) goto done;
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
            int e = key == NULL || cache_put(vcache, by_id, key, t, sl, version, NULL) < 0;
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
        PyObject *call = Py_NewRef(PyTuple_GET_ITEM(sp, SP_CALL)), *dt = NULL;
        int e = 0;
        if (call == Py_None) { /* a new call: make_call(step, mb, phase, module, kind, name, occurrence) */
            PyObject *phase = PyTuple_GET_ITEM(sp, SP_PHASE), *mod = PyTuple_GET_ITEM(sp, SP_MODULE),
                     *kind = PyTuple_GET_ITEM(sp, SP_KIND), *name = PyTuple_GET_ITEM(sp, SP_NAME);
            PyObject *o = next_occurrence(occ, mb, phase, mod, kind, name);
            Py_SETREF(call, o == NULL ? NULL : PyTuple_Pack(9, step, mb, phase, mod, kind, name, o, Py_None, Py_False));
            Py_XDECREF(o);
            e = call == NULL;
        }
        e = e || (dt = PyObject_GetAttr(t, s_dtype)) == NULL ||
            push_record(rows, call, &seq, PyTuple_GET_ITEM(sp, SP_ROLE), PyTuple_GET_ITEM(sp, SP_ARG), t, dt, NULL, sl) < 0;
        Py_XDECREF(dt);
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

/* ------------------------------------------------------------------------------------------
 * args_key(src): args._args_key in C, the same keys: a flat_args tuple's memo key, equal only
 * when its text is (floats as ("f", float.hex()), values of other classes than int, str and None
 * as (class, value)); None when src is not flat or a value cannot be a key.
 * ------------------------------------------------------------------------------------------ */
static PyObject *ak_flat = NULL; /* args._FLAT */
static PyObject *s_f, *s_hex;

static PyObject *
configure_args(PyObject *module, PyObject *flat)
{
    if (s_f == NULL && ((s_f = PyUnicode_InternFromString("f")) == NULL || (s_hex = PyUnicode_InternFromString("hex")) == NULL))
        return NULL;
    Py_INCREF(flat);
    Py_XSETREF(ak_flat, flat);
    Py_RETURN_NONE;
}

static PyObject *
args_key(PyObject *module, PyObject *src)
{
    if (ak_flat == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "args_key: configure_args() was not called");
        return NULL;
    }
    if (!PyTuple_Check(src) || PyTuple_GET_SIZE(src) == 0 || PyTuple_GET_ITEM(src, 0) != ak_flat) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(src);
    int exact = 1;
    for (Py_ssize_t i = 0; i < n && exact; i++) {
        PyObject *v = PyTuple_GET_ITEM(src, i);
        exact = Py_IS_TYPE(v, &PyLong_Type) || PyUnicode_CheckExact(v) || v == Py_None;
    }
    if (exact) {
        return Py_NewRef(src); /* (most calls: ints, strings and None only; the key below would equal it) */
    }
    PyObject *key = PyTuple_New(n);
    if (key == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(src, i), *k;
        if (Py_IS_TYPE(v, &PyLong_Type) || PyUnicode_CheckExact(v) || v == Py_None) {
            k = Py_NewRef(v);
        } else if (Py_IS_TYPE(v, &PyFloat_Type)) {
            PyObject *hex = PyObject_CallMethodNoArgs(v, s_hex);
            k = hex == NULL ? NULL : PyTuple_Pack(2, s_f, hex);
            Py_XDECREF(hex);
        } else {
            k = PyTuple_Pack(2, (PyObject *)Py_TYPE(v), v);
        }
        if (k == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        PyTuple_SET_ITEM(key, i, k);
    }
    if (PyObject_Hash(key) == -1) {
        Py_DECREF(key);
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        return NULL;
    }
    return key;
}
