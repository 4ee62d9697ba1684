/* Part of _hostpath.c: the dispatch mode's per-op helpers: gather, flat_args, counted and fast appends, record_op.
 * Included by _hostpath.c and compiled with it as one unit (the parts share its static state);
 * not built on its own. */

/* ------------------------------------------------------------------------------------------
 * The dispatch mode's other per-op helpers, in C for the same reason as append_plain:
 *   gather(args, kwargs, dest_pos, dest_kw)        args.gather
 *   append_fast(rec, call, tensors, digest_it, fresh, defer)   hot.append_fast_py
 *   record_op(rec, name, module, phase, tensors, args_src, digest_it, defer)   hot.record_op_py
 * configure_op() and configure_gather() hand over what they use from Python (and configure(),
 * which hot.py calls first: torch.Tensor among others).
 * ------------------------------------------------------------------------------------------ */

static PyObject *op_param = NULL;        /* torch.nn.Parameter */
static PyObject *op_has_subclass = NULL; /* subclass.has_subclass */
static PyObject *op_plain_py = NULL;     /* hot.append_plain_py */
static PyObject *op_mark_flat = NULL, *op_mark_open = NULL, *op_mark_close = NULL; /* args' flat-tuple markers */
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
    PyObject *names, *mflat, *mopen, *mclose;
    if (!PyArg_ParseTuple(args, "O!OOO:configure_gather", &PyTuple_Type, &names, &mflat, &mopen, &mclose)) {
        return NULL;
    }
#define SET(var, v) Py_INCREF(v); Py_XSETREF(var, v);
    SET(op_arg_names, names) SET(op_mark_flat, mflat) SET(op_mark_open, mopen) SET(op_mark_close, mclose)
#undef SET
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

/* The tensors of a list or tuple argument ``a``, named ``base[j]``. */
static int
gather_list(PyObject *tensors, PyObject *role, PyObject *base, PyObject *a)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
    PyObject **xs = PySequence_Fast_ITEMS(a);
    for (Py_ssize_t j = 0; j < n; j++) {
        int is_t = PyObject_IsInstance(xs[j], cfg_tensor);
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
    if (op_mark_flat == NULL || cfg_tensor == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gather: configure() and configure_gather() were not called");
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
        int is_t = PyObject_IsInstance(v, cfg_tensor);
        if (is_t < 0) goto done;
        if (is_t) {
            if (append_record_item(tensors, role, arg_name(i), v) < 0) goto done;
            continue;
        }
        if ((PyList_Check(v) || PyTuple_Check(v)) && PySequence_Fast_GET_SIZE(v) > 0) {
            PyObject *first = PySequence_Fast_ITEMS(v)[0];
            int ok = first == Py_None ? 1 : PyObject_IsInstance(first, cfg_tensor);
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
            int is_t = PyObject_IsInstance(v, cfg_tensor);
            if (is_t > 0) {
                e = append_record_item(tensors, role, PyUnicode_Concat(s_kwargs_prefix, k), v);
            } else if (is_t == 0) {
                int listed = 0;
                if ((PyList_Check(v) || PyTuple_Check(v)) && PySequence_Fast_GET_SIZE(v) > 0) {
                    listed = PyObject_IsInstance(PySequence_Fast_ITEMS(v)[0], cfg_tensor);
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
    PyObject *flat = flat_args_c(other, kwl);
    if (flat == NULL) goto done;
    result = PyTuple_Pack(2, tensors, flat);
    Py_DECREF(flat);
done:
    Py_XDECREF(tensors); Py_XDECREF(other); Py_XDECREF(kwl);
    return result;
}

/* waiting.run(staging=False): every digest waiting for a batch, taken now. */
static int
waiting_run(PyObject *waiting)
{
    PyObject *kwn = PyTuple_Pack(1, s_staging_kw);
    PyObject *meth = kwn == NULL ? NULL : PyObject_GetAttr(waiting, s_run);
    PyObject *ran = NULL;
    if (meth != NULL) {
        PyObject *argv[1] = {Py_False};
        ran = PyObject_Vectorcall(meth, argv, 0, kwn);
        Py_DECREF(meth);
    }
    Py_XDECREF(kwn);
    if (ran == NULL) return -1;
    Py_DECREF(ran);
    return 0;
}

/* The k-th argument OpInfo.writes names (wf: it as a fast sequence) among the positional args a:
 * 1 with *v borrowed and *i its position; 0 when out of range (Python skips it); -1 on error. */
static int
written_arg(PyObject *wf, Py_ssize_t k, PyObject *a, Py_ssize_t *i, PyObject **v)
{
    *i = PyLong_AsSsize_t(PySequence_Fast_ITEMS(wf)[k]);
    if (*i == -1 && PyErr_Occurred()) return -1;
    if (*i < 0 || *i >= PyTuple_GET_SIZE(a)) return 0;
    *v = PyTuple_GET_ITEM(a, *i);
    return 1;
}

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
        PyObject *dt = PyObject_GetAttr(t, s_dtype);
        int e = dt == NULL ||
                push_record(rows, call, &seq, PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1), t, dt, NULL, Py_None) < 0;
        Py_XDECREF(dt);
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

/* hot.append_fast_py; and Recorder.append_records' counted path (digest_it False) when no tensor
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
    if (full && waiting_run(waiting) < 0) goto out;
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

/* Recorder.occurrence inlined: the call's occurrence in its step (a new int), counted in ``occ``
 * (the recorder's dict) under (microbatch, phase, module, kind, name). */
static PyObject *
next_occurrence(PyObject *occ, PyObject *mb, PyObject *phase, PyObject *mod, PyObject *kind, PyObject *name)
{
    if (!PyDict_Check(occ)) {
        PyErr_SetString(PyExc_TypeError, "the recorder's occurrences must be a dict");
        return NULL;
    }
    PyObject *key = PyTuple_Pack(5, mb, phase, mod, kind, name);
    if (key == NULL) return NULL;
    PyObject *n = PyDict_GetItemWithError(occ, key);
    n = n != NULL ? Py_NewRef(n) : PyErr_Occurred() ? NULL : PyLong_FromLong(0);
    PyObject *n1 = n == NULL ? NULL : PyNumber_Add(n, one);
    if (n1 == NULL || PyDict_SetItem(occ, key, n1) < 0) Py_CLEAR(n);
    Py_XDECREF(n1);
    Py_DECREF(key);
    return n;
}

/* Recorder.record_call's body (occurrence inlined): the call tuple (step, microbatch, phase,
 * module, kind, name, occurrence, args_src, compiled), its tensors appended by append_fast_c.
 * record_op (kind "op") and record_plain (calls.c: no arguments) are its two entries. */
static PyObject *
record_call_c(PyObject *rec, PyObject *kind, PyObject *name, PyObject *mod, PyObject *phase, PyObject *tensors,
              PyObject *args_src, PyObject *compiled, int digest_it, PyObject *fresh, PyObject *defer)
{
    PyObject *mb = NULL, *occ = NULL, *n = NULL, *step = NULL, *call = NULL;
    if ((mb = PyObject_GetAttr(rec, s_microbatch)) == NULL) goto fail;
    if ((occ = PyObject_GetAttr(rec, s_occ)) == NULL) goto fail;
    if ((n = next_occurrence(occ, mb, phase, mod, kind, name)) == NULL) goto fail;
    if ((step = PyObject_GetAttr(rec, s_step)) == NULL) goto fail;
    if ((call = PyTuple_Pack(9, step, mb, phase, mod, kind, name, n, args_src, compiled)) == NULL) goto fail;
    int has = PyObject_IsTrue(tensors);
    if (has < 0) goto fail;
    if (has && append_fast_c(rec, call, tensors, digest_it, fresh, defer) < 0) goto fail;
    Py_DECREF(mb); Py_DECREF(occ); Py_DECREF(n); Py_DECREF(step);
    return call;
fail:
    Py_XDECREF(mb); Py_XDECREF(occ); Py_XDECREF(n); Py_XDECREF(step);
    Py_XDECREF(call);
    return NULL;
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
    int digest_it = PyObject_IsTrue(args[6]);
    if (digest_it < 0) return NULL;
    return record_call_c(args[0], s_op, args[1], args[2], args[3], args[4], args[5], Py_False, digest_it, Py_False,
                         args[7]);
}
