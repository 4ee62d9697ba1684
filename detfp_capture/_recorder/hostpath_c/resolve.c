/* Part of _hostpath.c: the flush's resolution of batched digests, its per-slot loops.
 * Included by _hostpath.c and compiled with it as one unit (the parts share its static state);
 * not built on its own.
 *   rows_plan(items, meta_words)        _digest.resolve._rows_plan
 *   scatter(his, los, order, words)     _digest.resolve._scatter
 *   split_rows(slots, batched)          flush.resolve_slots: batched rows apart from the rest
 *   assign_rows(rows, his, los)         flush.resolve_slots: the words into the slots */

static PyObject *s_scheme;

static int
intern_resolve_names(void)
{
    return (s_scheme = PyUnicode_InternFromString("scheme")) == NULL ? -1 : 0;
}

static PyObject *
rows_plan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "rows_plan(items: list, meta_words)");
        return NULL;
    }
    PyObject *items = args[0], *meta_words = args[1];
    PyObject *plan = PyList_New(0), *groups = PyDict_New(), *metas_memo = PyDict_New(), *result = NULL;
    /* groups: (device, scheme) -> (index in plan, {arena: index in parts}) */
    if (plan == NULL || groups == NULL || metas_memo == NULL) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *it = PyList_GET_ITEM(items, i);
        PyObject *arena = SLOT_FIELD(it, arena, "arena"), *dev = NULL, *sch = NULL, *key = NULL, *row = NULL, *ii = NULL;
        int e = arena == NULL || (dev = SLOT_FIELD(it, device, "device")) == NULL ||
                (sch = PyObject_GetAttr(arena, s_scheme)) == NULL || (key = PyTuple_Pack(2, dev, sch)) == NULL ||
                (row = SLOT_FIELD(it, row, "row")) == NULL || (ii = PyLong_FromSsize_t(i)) == NULL;
        PyObject *g = e ? NULL : PyDict_GetItemWithError(groups, key);
        if (!e && g == NULL) {
            if (PyErr_Occurred()) {
                e = 1;
            } else { /* a new group: (device, scheme, parts, order, metas) and its arena index */
                PyObject *parts = PyList_New(0), *order = PyList_New(0), *metas = PyList_New(0), *where = PyDict_New();
                PyObject *pos = PyLong_FromSsize_t(PyList_GET_SIZE(plan));
                PyObject *entry = parts && order && metas ? PyTuple_Pack(5, dev, sch, parts, order, metas) : NULL;
                g = entry && where && pos ? PyTuple_Pack(2, pos, where) : NULL;
                e = g == NULL || PyList_Append(plan, entry) < 0 || PyDict_SetItem(groups, key, g) < 0;
                Py_XDECREF(parts); Py_XDECREF(order); Py_XDECREF(metas); Py_XDECREF(where); Py_XDECREF(pos);
                Py_XDECREF(entry);
                if (g != NULL) Py_DECREF(g); /* the dict holds it */
            }
        }
        if (!e) {
            PyObject *entry = PyList_GET_ITEM(plan, PyLong_AsSsize_t(PyTuple_GET_ITEM(g, 0)));
            PyObject *parts = PyTuple_GET_ITEM(entry, 2), *where = PyTuple_GET_ITEM(g, 1);
            PyObject *at = PyDict_GetItemWithError(where, arena);
            if (at == NULL && !PyErr_Occurred()) {
                PyObject *rows = PyList_New(0), *idx = PyList_New(0);
                PyObject *part = rows && idx ? PyTuple_Pack(3, arena, rows, idx) : NULL;
                PyObject *n = PyLong_FromSsize_t(PyList_GET_SIZE(parts));
                e = part == NULL || n == NULL || PyList_Append(parts, part) < 0 || PyDict_SetItem(where, arena, n) < 0;
                Py_XDECREF(rows); Py_XDECREF(idx); Py_XDECREF(part);
                at = n;
                Py_XDECREF(n); /* the dict holds it */
            }
            e = e || at == NULL;
            if (!e) {
                PyObject *part = PyList_GET_ITEM(parts, PyLong_AsSsize_t(at));
                e = PyList_Append(PyTuple_GET_ITEM(part, 1), row) < 0 || PyList_Append(PyTuple_GET_ITEM(part, 2), ii) < 0;
            }
        }
        Py_XDECREF(arena); Py_XDECREF(dev); Py_XDECREF(sch); Py_XDECREF(key); Py_XDECREF(row); Py_XDECREF(ii);
        if (e) goto done;
    }
    /* Each group's order (its arenas' items, arena by arena) and meta words, then its parts as
     * (arena, rows) pairs. */
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(plan); g++) {
        PyObject *entry = PyList_GET_ITEM(plan, g);
        PyObject *sch = PyTuple_GET_ITEM(entry, 1), *parts = PyTuple_GET_ITEM(entry, 2), *order = PyTuple_GET_ITEM(entry, 3),
                 *metas = PyTuple_GET_ITEM(entry, 4);
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(parts); k++) {
            PyObject *part = PyList_GET_ITEM(parts, k);
            PyObject *idx = PyTuple_GET_ITEM(part, 2);
            for (Py_ssize_t j = 0; j < PyList_GET_SIZE(idx); j++) {
                PyObject *ii = PyList_GET_ITEM(idx, j);
                PyObject *it = PyList_GET_ITEM(items, PyLong_AsSsize_t(ii));
                PyObject *dt = SLOT_FIELD(it, dtype, "dtype"), *shape = dt ? SLOT_FIELD(it, shape, "shape") : NULL;
                PyObject *mkey = shape ? PyTuple_Pack(3, sch, dt, shape) : NULL;
                PyObject *m = mkey ? PyDict_GetItemWithError(metas_memo, mkey) : NULL;
                int e = mkey == NULL;
                if (!e && m == NULL) {
                    if (PyErr_Occurred()) {
                        e = 1;
                    } else {
                        m = PyObject_CallFunctionObjArgs(meta_words, sch, dt, shape, NULL);
                        e = m == NULL || PyDict_SetItem(metas_memo, mkey, m) < 0;
                        Py_XDECREF(m); /* the memo holds it */
                    }
                }
                e = e || PyList_Append(order, ii) < 0 || PyList_Append(metas, m) < 0;
                Py_XDECREF(dt); Py_XDECREF(shape); Py_XDECREF(mkey);
                if (e) goto done;
            }
            PyObject *pair = PyTuple_Pack(2, PyTuple_GET_ITEM(part, 0), PyTuple_GET_ITEM(part, 1));
            if (pair == NULL) goto done;
            PyList_SetItem(parts, k, pair); /* steals pair */
        }
    }
    result = Py_NewRef(plan);
done:
    Py_XDECREF(plan); Py_XDECREF(groups); Py_XDECREF(metas_memo);
    return result;
}

static PyObject *
scatter(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[2]) ||
        !PyList_Check(args[3]) || PyList_GET_SIZE(args[3]) != 2 * PyList_GET_SIZE(args[2])) {
        PyErr_SetString(PyExc_TypeError, "scatter(his: list, los: list, order: list, words: list of two per item)");
        return NULL;
    }
    PyObject *his = args[0], *los = args[1], *order = args[2], *words = args[3];
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(order); k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(order, k));
        if (i == -1 && PyErr_Occurred()) return NULL;
        if (i < 0 || i >= PyList_GET_SIZE(his) || i >= PyList_GET_SIZE(los)) {
            PyErr_SetString(PyExc_IndexError, "scatter: index out of range");
            return NULL;
        }
        if (PyList_SetItem(his, i, Py_NewRef(PyList_GET_ITEM(words, 2 * k))) < 0 ||
            PyList_SetItem(los, i, Py_NewRef(PyList_GET_ITEM(words, 2 * k + 1))) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
split_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "split_rows(slots: list, batched)");
        return NULL;
    }
    PyObject *slots = args[0], *batched = args[1];
    PyObject *rows = PyList_New(0), *rest = PyList_New(0), *result = NULL;
    if (rows == NULL || rest == NULL) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(slots); i++) {
        PyObject *s = PyList_GET_ITEM(slots, i);
        PyObject *pending = SLOT_FIELD(s, pending, "pending");
        if (pending == NULL) goto done;
        int row = pending == batched;
        Py_DECREF(pending);
        if (row) {
            PyObject *ap = SLOT_FIELD(s, arena_pointer, "arena_pointer");
            int t = ap == NULL ? -1 : PyObject_IsTrue(ap);
            Py_XDECREF(ap);
            if (t < 0) goto done;
            row = !t;
        }
        if (PyList_Append(row ? rows : rest, s) < 0) goto done;
    }
    result = PyTuple_Pack(2, rows, rest);
done:
    Py_XDECREF(rows); Py_XDECREF(rest);
    return result;
}

static PyObject *
assign_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[2]) ||
        PyList_GET_SIZE(args[1]) != PyList_GET_SIZE(args[0]) || PyList_GET_SIZE(args[2]) != PyList_GET_SIZE(args[0])) {
        PyErr_SetString(PyExc_TypeError, "assign_rows(rows, his, los): lists of one length");
        return NULL;
    }
    PyObject *rows = args[0], *his = args[1], *los = args[2];
    PyObject *left = PyList_New(0);
    if (left == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rows); i++) {
        PyObject *s = PyList_GET_ITEM(rows, i), *hi = PyList_GET_ITEM(his, i);
        int e;
        if (hi == Py_None) {
            e = PyList_Append(left, s) < 0;
        } else {
            e = SET_SLOT(s, hi, "hi", hi) || SET_SLOT(s, lo, "lo", PyList_GET_ITEM(los, i)) ||
                SET_SLOT(s, pending, "pending", Py_None);
        }
        if (e) {
            Py_DECREF(left);
            return NULL;
        }
    }
    return left;
}
