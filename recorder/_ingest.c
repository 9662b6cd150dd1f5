/* recorder._ingest: cuda_call rows from the cuda_events ring's records, packed for store._insert.
 *
 * Why: at 100k+ calls/s the recorder's one busy core spends ~1.5 us per call building a 19-value
 * Python tuple (struct unpacking, dictionary lookups, grid/block strings) and ~5 us binding it in
 * the sqlite3 module. Here a call costs three dictionary lookups and 192 bytes of packed
 * integers, and store._insert binds them without the GIL in the writer thread.
 *
 * pack_cuda() does exactly what Session._cuda_rows does for a record whose thread, Python stack
 * and native stack are already known (the common case: a process makes the same calls from the
 * same threads); every other record (a new thread, a stack record not read yet, a native stack
 * not resolved yet, no native stack) is returned as a miss for that Python path, which also
 * holds back what must wait. The record layout comes from recorder.events.CUDA (offsets are
 * passed in), so there is still one definition of it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* order of the offsets tuple (recorder.session.CUDA_PACK_FIELDS) */
enum { F_TS, F_DUR, F_CGROUP, F_RET, F_SIZE, F_STREAM, F_FUNCTION, F_POINTER, F_HANDLE, F_PID,
       F_TID, F_API, F_KIND, F_GX, F_GY, F_GZ, F_BX, F_BY, F_BZ, F_SHMEM, F_FLAGS, F_NATIVE,
       F_COUNT };

/* api_flags bits (recorder.session._API_FLAGS) */
#define A_SIZE 1
#define A_STREAM 2
#define A_LAUNCH 4
#define A_POINTER 8
#define A_HANDLE 16
#define A_KIND 32

/* slots of a packed row (the cuda_call columns; grid and block take three each) */
enum { S_SESSION, S_TS, S_DUR, S_THREAD, S_API, S_RET, S_SIZE, S_SIZE_CLASS, S_STREAM,
       S_FUNCTION, S_POINTER, S_HANDLE, S_KIND, S_GRID, S_BLOCK = S_GRID + 3,
       S_SHMEM = S_BLOCK + 3, S_CGROUP, S_PY_STACK, S_NATIVE, S_COUNT };

#define CUDA_FLAG_FAILED 1 /* the call failed: its pointer was not written */

static inline uint64_t u64_at(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t u32_at(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* d[key] as a C integer, or -1 when absent or not a non-negative int; pop removes it */
static long long lookup(PyObject *d, PyObject *key, int pop)
{
    if (!key)
        return -2;
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (!v)
        return PyErr_Occurred() ? -2 : -1;
    if (!PyLong_CheckExact(v))
        return -1;
    long long r = PyLong_AsLongLong(v);
    if (r < 0)
        return PyErr_Occurred() ? -2 : -1;
    if (pop && PyDict_DelItem(d, key) < 0)
        return -2;
    return r;
}

static PyObject *pair(uint64_t a, long long b)
{
    return Py_BuildValue("(KL)", (unsigned long long)a, b);
}

/* pack_cuda(joined, framed_size, offsets, session_id, threads, join, natives, api_flags[, at])
 *   -> (packed, rows, misses)
 * joined: framed cuda_event records (an 8-byte ring header, then the record); at: the byte offsets
 * of the records to look at (default: all); misses: the byte offsets in joined of the records left
 * to the Python path. */
static PyObject *py_pack_cuda(PyObject *self, PyObject *args)
{
    Py_buffer in, flags_buf;
    Py_ssize_t framed;
    PyObject *offsets, *threads, *join, *natives, *at = NULL;
    long long session;
    if (!PyArg_ParseTuple(args, "y*nO!LO!O!O!y*|O!", &in, &framed, &PyTuple_Type, &offsets,
                          &session, &PyDict_Type, &threads, &PyDict_Type, &join, &PyDict_Type,
                          &natives, &flags_buf, &PyList_Type, &at))
        return NULL;
    PyObject *result = NULL, *packed = NULL, *misses = NULL;
    Py_ssize_t off[F_COUNT];
    if (PyTuple_GET_SIZE(offsets) != F_COUNT || framed < 16 || in.len % framed) {
        PyErr_SetString(PyExc_ValueError, "records do not match the cuda_event layout given");
        goto out;
    }
    for (int i = 0; i < F_COUNT; i++) {
        off[i] = 8 + PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, i));
        if (off[i] < 8 || off[i] + 8 > framed + (i >= F_PID ? 4 : 0)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "a cuda_event offset lies outside the record");
            goto out;
        }
    }
    const Py_ssize_t n = at ? PyList_GET_SIZE(at) : in.len / framed, stride = (S_COUNT + 1) * 8;
    const unsigned char *api_flags = flags_buf.buf;
    packed = PyBytes_FromStringAndSize(NULL, n * stride);
    misses = PyList_New(0);
    if (!packed || !misses)
        goto out;
    int64_t *row = (int64_t *)PyBytes_AS_STRING(packed);
    Py_ssize_t rows = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t start = i * framed;
        if (at) {
            start = PyLong_AsSsize_t(PyList_GET_ITEM(at, i));
            if (start < 0 || start % framed || start + framed > in.len) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "an offset is not a record's in joined");
                goto out;
            }
        }
        const char *r = (const char *)in.buf + start;
        uint64_t ts = u64_at(r + off[F_TS]);
        uint32_t pid = u32_at(r + off[F_PID]), tid = u32_at(r + off[F_TID]);
        uint32_t api = u32_at(r + off[F_API]);
        int32_t native_map = (int32_t)u32_at(r + off[F_NATIVE]);
        long long thread = -1, stack = -1, native = -1;
        if (api < (uint32_t)flags_buf.len && native_map >= 0) {
            PyObject *k = PyLong_FromUnsignedLong(tid);
            thread = lookup(threads, k, 0);
            Py_XDECREF(k);
            if (thread > 0) {
                k = pair(pid, native_map);
                native = lookup(natives, k, 0);
                Py_XDECREF(k);
            }
            if (thread > 0 && native >= 0) {
                k = Py_BuildValue("(KkI)", (unsigned long long)ts, (unsigned long)pid, tid);
                stack = lookup(join, k, 1);
                Py_XDECREF(k);
            }
        }
        if (thread == -2 || native == -2 || stack == -2)
            goto out;
        if (thread <= 0 || native < 0 || stack < 0) {
            PyObject *miss = PyLong_FromSsize_t(start);
            if (!miss || PyList_Append(misses, miss) < 0) {
                Py_XDECREF(miss);
                goto out;
            }
            Py_DECREF(miss);
            continue;
        }
        unsigned f = api_flags[api];
        uint64_t size = u64_at(r + off[F_SIZE]);
        uint64_t mask = 0;
        int64_t *v = row + rows * (S_COUNT + 1);
        v[S_SESSION] = session;
        v[S_TS] = (int64_t)ts;
        v[S_DUR] = (int64_t)u64_at(r + off[F_DUR]);
        v[S_THREAD] = thread;
        v[S_API] = api;
        v[S_RET] = (int64_t)u64_at(r + off[F_RET]);
        v[S_SIZE] = (int64_t)size;
        v[S_SIZE_CLASS] = size ? 64 - __builtin_clzll(size) : 0;
        if (!(f & A_SIZE))
            mask |= 1ull << S_SIZE | 1ull << S_SIZE_CLASS;
        v[S_STREAM] = (int64_t)u64_at(r + off[F_STREAM]);
        if (!(f & A_STREAM))
            mask |= 1ull << S_STREAM;
        v[S_FUNCTION] = (int64_t)u64_at(r + off[F_FUNCTION]);
        v[S_POINTER] = (int64_t)u64_at(r + off[F_POINTER]);
        if (!(f & A_POINTER) || u32_at(r + off[F_FLAGS]) & CUDA_FLAG_FAILED)
            mask |= 1ull << S_POINTER;
        v[S_HANDLE] = (int64_t)u64_at(r + off[F_HANDLE]);
        if (!(f & A_HANDLE))
            mask |= 1ull << S_HANDLE;
        v[S_KIND] = (int32_t)u32_at(r + off[F_KIND]);
        if (!(f & A_KIND))
            mask |= 1ull << S_KIND;
        v[S_GRID] = u32_at(r + off[F_GX]);
        v[S_GRID + 1] = u32_at(r + off[F_GY]);
        v[S_GRID + 2] = u32_at(r + off[F_GZ]);
        v[S_BLOCK] = u32_at(r + off[F_BX]);
        v[S_BLOCK + 1] = u32_at(r + off[F_BY]);
        v[S_BLOCK + 2] = u32_at(r + off[F_BZ]);
        v[S_SHMEM] = u32_at(r + off[F_SHMEM]);
        if (!(f & A_LAUNCH))
            mask |= 1ull << S_FUNCTION | 1ull << S_GRID | 1ull << S_BLOCK | 1ull << S_SHMEM;
        v[S_CGROUP] = (int64_t)u64_at(r + off[F_CGROUP]);
        v[S_PY_STACK] = stack;
        v[S_NATIVE] = native;
        v[S_COUNT] = (int64_t)mask;
        rows++;
    }
    if (_PyBytes_Resize(&packed, rows * stride) < 0)
        goto out;
    result = Py_BuildValue("(OnO)", packed, rows, misses);
out:
    Py_XDECREF(packed);
    Py_XDECREF(misses);
    PyBuffer_Release(&in);
    PyBuffer_Release(&flags_buf);
    return result;
}

static PyMethodDef methods[] = {
    {"pack_cuda", py_pack_cuda, METH_VARARGS,
     "pack_cuda(joined, framed_size, offsets, session_id, threads, join, natives, api_flags)"
     " -> (packed, rows, misses)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "recorder._ingest",
    "cuda_call rows from cuda_event records, packed for store._insert.", -1, methods,
};

PyMODINIT_FUNC PyInit__ingest(void)
{
    return PyModule_Create(&module);
}
