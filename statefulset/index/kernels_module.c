/*
 * The Python face of the installed kernels library. The kernels themselves are plain C in kernels.c,
 * linked into the same file and called through ctypes (statefulset/index/compiled.py); this file
 * makes that file an ordinary extension module, and holds the functions that are called as Python
 * functions instead, as they build Python objects and so need the Python C API: metrics_read, the
 * compiled loader.metrics() read (statefulset/loading/compiled_read.py), and encode_samples, a task
 * encoder's per-sample loop (statefulset/transforms/encoder.py).
 *
 * setup.py records this file's SHA-256 (source_sha256): statefulset.index.compiled.module_function
 * does not use a module built from another version of it (an editable checkout edited since its
 * last build), and the read falls back to Python.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef SF_MODULE_SHA256
#define SF_MODULE_SHA256 ""
#endif

/* The control block of a read: int64 slots, named in the same order by compiled_read.CONTROL. */
enum {
    MR_KEYS,     /* id() of the template dict (the keys, in order, and the last values) the layout is for */
    MR_VALUES,   /* address of 2 x COUNT float64: the values in the keys' order, then those the template holds */
    MR_COUNT,    /* how many */
    MR_TOKENS,   /* tokens a batch */
    MR_READY,    /* index of workers/ready_batches, or -1 */
    MR_POSITION, /* index of position, or -1 (no per-source values) */
    MR_STORAGE,  /* index of storage/requests (the 10 storage values follow in summary's order), or -1 */
    MR_OWN,      /* address of this process's storage row */
    MR_OFFSET,   /* address of the row counted before the loader was made */
    MR_AHEAD,    /* address of the rows walked ahead (float64, ROW values each), or 0 */
    MR_FIRST,    /* their first position, */
    MR_STEP,     /* the step between them, */
    MR_SPAN,     /* positions covered (rows x step), */
    MR_ROW,      /* values a row (samples then epochs, per source), */
    MR_MAP,      /* address of int64[ROW]: the index in values of each row value */
    MR_PLACE,    /* the position the per-source values are for */
    MR_STAMPS,   /* the ring: address of its int64 (begin, end) stamps, or 0, */
    MR_SLOTS,    /* slots in all, */
    MR_BUNDLE,   /* batches a slot, */
    MR_ROWS,     /* address of its workers' storage rows, or 0, */
    MR_WORKERS,  /* how many */
    MR_SIZE
};
/* storage_stats' row: slots and histogram (compiled_read checks them: metrics_read() returns them). */
#define MR_WIDTH 25
#define MR_FIRST_BUCKET 9
#define MR_BUCKETS 16
#define MR_REQUESTS 0
#define MR_BYTES 1
#define MR_RETRIES 2
#define MR_FAILURES 3
#define MR_IN_FLIGHT 4
#define MR_AHEAD_TAKEN 7
#define MR_AHEAD_READY 8

/* storage_stats.percentile: the same doubles in the same order. */
static double mr_percentile(const double *histogram, double q)
{
    double total = 0.0, seen = 0.0;
    for (int k = 0; k < MR_BUCKETS; k++)
        total += histogram[k];
    if (total <= 0.0)
        return 0.0;
    for (int k = 0; k < MR_BUCKETS; k++) {
        seen += histogram[k];
        if (seen >= q * total)
            return ldexp(1.0, k) / 1000.0;
    }
    return ldexp(1.0, MR_BUCKETS - 1) / 1000.0;
}

/* Meter._storage: the trainer's row less its offset plus the workers' rows (summed first, as numpy's
   add.reduce over axis 0 does), summarised as storage_stats.summary. */
static void mr_storage(const int64_t *c, double *out)
{
    const double *own = (const double *)(intptr_t)c[MR_OWN], *offset = (const double *)(intptr_t)c[MR_OFFSET];
    const double *rows = (const double *)(intptr_t)c[MR_ROWS];
    double total[MR_WIDTH];
    for (int j = 0; j < MR_WIDTH; j++) {
        total[j] = own[j] - offset[j];
        if (rows != NULL && c[MR_WORKERS] > 0) {
            double sum = rows[j];
            for (int64_t w = 1; w < c[MR_WORKERS]; w++)
                sum += rows[w * MR_WIDTH + j];
            total[j] += sum;
        }
    }
    out[0] = total[MR_REQUESTS];
    out[1] = total[MR_BYTES];
    out[2] = total[MR_RETRIES];
    out[3] = total[MR_FAILURES];
    out[4] = total[MR_IN_FLIGHT];
    out[5] = mr_percentile(total + MR_FIRST_BUCKET, 0.5);
    out[6] = mr_percentile(total + MR_FIRST_BUCKET, 0.9);
    out[7] = mr_percentile(total + MR_FIRST_BUCKET, 0.99);
    out[8] = total[MR_AHEAD_TAKEN];
    out[9] = total[MR_AHEAD_READY];
}

/* The per-source values at position from the rows walked ahead: 1, or 0 when not among them. */
static int mr_sources(int64_t *c, double *values, int64_t position)
{
    if (c[MR_ROW] == 0) { /* a stream without per-source values (megatron packing): the position only */
        c[MR_PLACE] = position;
        return 1;
    }
    int64_t off = position - c[MR_FIRST];
    if (c[MR_AHEAD] == 0 || c[MR_STEP] <= 0 || off < 0 || off >= c[MR_SPAN] || off % c[MR_STEP])
        return 0;
    const double *row = (const double *)(intptr_t)c[MR_AHEAD] + (off / c[MR_STEP]) * c[MR_ROW];
    const int64_t *map = (const int64_t *)(intptr_t)c[MR_MAP];
    for (int64_t j = 0; j < c[MR_ROW]; j++)
        values[map[j]] = row[j];
    c[MR_PLACE] = position;
    return 1;
}

/* metrics_read(control, template, wait, batches, restarts, stalls, position, next_t, ready): a new
   dict of the metrics (the template's keys, in order, with the values), or None when the read needs Python (the position is not
   among the rows walked ahead, or the control is for other keys). The caller keeps every array the
   control points at alive while it does; the GIL is held throughout. */
static PyObject *mr_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs == 0) /* the layout it was built for: control slots, storage row width, first bucket, buckets */
        return Py_BuildValue("(iiii)", MR_SIZE, MR_WIDTH, MR_FIRST_BUCKET, MR_BUCKETS);
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "metrics_read takes 9 arguments");
        return NULL;
    }
    int64_t *c = (int64_t *)PyLong_AsVoidPtr(args[0]);
    PyObject *template = args[1];
    double wait = PyFloat_AsDouble(args[2]);
    long long batches = PyLong_AsLongLong(args[3]);
    double restarts = PyFloat_AsDouble(args[4]), stalls = PyFloat_AsDouble(args[5]);
    long long position = PyLong_AsLongLong(args[6]), next_t = PyLong_AsLongLong(args[7]);
    long long ready = PyLong_AsLongLong(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (c == NULL || !PyDict_CheckExact(template) || c[MR_KEYS] != (int64_t)(intptr_t)template ||
        PyDict_GET_SIZE(template) != c[MR_COUNT])
        Py_RETURN_NONE;
    double *values = (double *)(intptr_t)c[MR_VALUES];
    if (c[MR_POSITION] >= 0 && position != c[MR_PLACE]) {
        if (!mr_sources(c, values, position))
            Py_RETURN_NONE;
        values[c[MR_POSITION]] = (double)position;
    }
    values[0] = wait;
    values[1] = (double)batches;
    values[2] = (double)(batches * c[MR_TOKENS]);
    values[3] = restarts;
    values[4] = stalls;
    if (c[MR_READY] >= 0) {
        const int64_t *stamps = (const int64_t *)(intptr_t)c[MR_STAMPS];
        long long found = 0;
        if (stamps != NULL)
            for (int64_t s = 0; s < c[MR_SLOTS]; s++)
                found += stamps[2 * s + 1] >= next_t;
        values[c[MR_READY]] = (double)(ready + c[MR_BUNDLE] * found);
    }
    if (c[MR_STORAGE] >= 0)
        mr_storage(c, values + c[MR_STORAGE]);
    /* The template holds the last read's values as float objects: only the values that changed get a
       new one (most stay: weights, storage, the queue), then the read is a copy of its table (no
       hashing: a clone that increments each key's and value's reference count). values[n..2n): the
       values the template holds, compared bit for bit. */
    Py_ssize_t n = (Py_ssize_t)c[MR_COUNT], at = 0, i = 0;
    double *held = values + n;
    PyObject *key, *old;
    while (PyDict_Next(template, &at, &key, &old) && i < n) {
        if (memcmp(&values[i], &held[i], sizeof(double)) != 0) {
            PyObject *value = PyFloat_FromDouble(values[i]);
            if (value == NULL)
                return NULL;
            int failed = PyDict_SetItem(template, key, value); /* an existing key: its value replaced */
            Py_DECREF(value);
            if (failed < 0)
                return NULL;
            held[i] = values[i];
        }
        i++;
    }
    PyObject *out = PyDict_Copy(template);
    return out;
}

/* encode_samples(cls, call, names, columns, out) -> (kept, stopped): a task encoder's plain per-sample
   loop (statefulset.transforms.encoder.TaskEncoderRunner._encode_plain). For each row i: an instance of
   cls (TokenSample, whose __new__ is object's) made without __init__, its __dict__ the names mapped
   to columns[j][i] in order (what the dataclass's __init__ sets); call(sample); the result appended
   to out. kept: every result was its own sample, whose __dict__ still holds exactly the names, in
   order, mapped to the very objects it was made with. stopped: -1, or the row whose result was None
   or an iterator (appended to out; the loop stops there: the caller refuses it). An exception of
   call propagates with out holding the rows before it. */
static PyObject *es_encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5 || !PyType_Check(args[0]) || !PyTuple_Check(args[2]) || !PyList_Check(args[3]) ||
        !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "encode_samples(cls, call, names: tuple, columns: list, out: list)");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)args[0];
    PyObject *call = args[1], *names = args[2], *columns = args[3], *out = args[4];
    Py_ssize_t width = PyTuple_GET_SIZE(names), rows = -1;
    if (width < 1 || PyList_GET_SIZE(columns) != width || cls->tp_alloc == NULL) {
        PyErr_SetString(PyExc_ValueError, "encode_samples: one column per name, at least one");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < width; j++) {
        PyObject *column = PyList_GET_ITEM(columns, j);
        if (!PyList_Check(column) || (rows >= 0 && PyList_GET_SIZE(column) != rows) ||
            !PyUnicode_CheckExact(PyTuple_GET_ITEM(names, j))) {
            PyErr_SetString(PyExc_ValueError, "encode_samples: columns are lists of one length, names strings");
            return NULL;
        }
        rows = PyList_GET_SIZE(column);
    }
    /* Every row's __dict__ starts as a copy of this one (the names in order, each None): a copy of a
       dict of that size is one allocation, where inserting the names one by one grows it on the way. */
    PyObject *blank = PyDict_New();
    if (blank == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < width; j++) {
        if (PyDict_SetItem(blank, PyTuple_GET_ITEM(names, j), Py_None) < 0) {
            Py_DECREF(blank);
            return NULL;
        }
    }
    int kept = 1;
    Py_ssize_t stopped = -1;
    for (Py_ssize_t i = 0; i < rows; i++) {
        PyObject *values = PyDict_Copy(blank);
        if (values == NULL)
            goto fail;
        for (Py_ssize_t j = 0; j < width; j++) {
            PyObject *value = PyList_GET_ITEM(PyList_GET_ITEM(columns, j), i);
            if (value != Py_None && PyDict_SetItem(values, PyTuple_GET_ITEM(names, j), value) < 0) {
                Py_DECREF(values);
                goto fail;
            }
        }
        PyObject *sample = cls->tp_alloc(cls, 0);
        if (sample == NULL || PyObject_GenericSetDict(sample, values, NULL) < 0) {
            Py_XDECREF(sample);
            Py_DECREF(values);
            goto fail;
        }
        Py_DECREF(values);
        PyObject *result = PyObject_Vectorcall(call, &sample, 1, NULL);
        if (result == NULL) {
            Py_DECREF(sample);
            goto fail;
        }
        if (result != sample) {
            kept = 0;
            int iterator = result != Py_None ? PyObject_HasAttrString(result, "__next__") : 0;
            if (result == Py_None || iterator)
                stopped = i;
        } else if (kept) {
            PyObject *now = PyObject_GenericGetDict(sample, NULL);
            if (now == NULL) {
                Py_DECREF(result);
                Py_DECREF(sample);
                goto fail;
            }
            Py_ssize_t at = 0, j = 0;
            PyObject *key, *value;
            kept = PyDict_GET_SIZE(now) == width;
            while (kept && PyDict_Next(now, &at, &key, &value)) {
                kept = key == PyTuple_GET_ITEM(names, j) && value == PyList_GET_ITEM(PyList_GET_ITEM(columns, j), i);
                j++;
            }
            Py_DECREF(now);
        }
        Py_DECREF(sample);
        int failed = PyList_Append(out, result);
        Py_DECREF(result);
        if (failed < 0)
            goto fail;
        if (stopped >= 0)
            break;
    }
    Py_DECREF(blank);
    return Py_BuildValue("(On)", kept ? Py_True : Py_False, stopped);
fail:
    Py_DECREF(blank);
    return NULL;
}

static PyMethodDef sf_kernels_methods[] = {
    {"metrics_read", (PyCFunction)(void (*)(void))mr_read, METH_FASTCALL,
     "The compiled loader.metrics() read (statefulset.loading.compiled_read)."},
    {"encode_samples", (PyCFunction)(void (*)(void))es_encode, METH_FASTCALL,
     "A task encoder's plain per-sample loop (statefulset.transforms.encoder)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sf_kernels_module = {
    PyModuleDef_HEAD_INIT,
    "_kernels",
    "The compiled kernels of kernels.c (statefulset.index.compiled loads this file with ctypes) and the "
    "compiled metrics read.",
    -1,
    sf_kernels_methods,
};

PyMODINIT_FUNC PyInit__kernels(void)
{
    PyObject *module = PyModule_Create(&sf_kernels_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddStringConstant(module, "source_sha256", SF_MODULE_SHA256) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
