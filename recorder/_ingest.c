/* recorder._ingest: the recorder's per-event work in C where Python's per-object cost dominates.
 *
 * drain_records() reads a ring of variable-size records (the pystacks ring) in one call,
 * join_known_stacks() joins the stack records seen before, and pack_cuda() makes cuda_call rows
 * from the cuda_events ring's records, packed for store.db._insert.
 *
 * Why: at 100k+ calls/s the recorder's one busy core spends ~1.5 us per call building a 19-value
 * Python tuple (struct unpacking, dictionary lookups, grid/block strings) and ~5 us binding it in
 * the sqlite3 module. Here a call costs three dictionary lookups and 192 bytes of packed
 * integers, and store.db._insert binds them without the GIL in the writer thread.
 *
 * pack_cuda() does exactly what Session._cuda_rows does for a record whose thread, Python stack
 * and native stack are already known (the common case: a process makes the same calls from the
 * same threads); every other record (a new thread, a stack record not read yet, a native stack
 * not resolved yet, no native stack) is returned as a miss for that Python path, which also
 * holds back what must wait. The record layout comes from recorder.core.events.CUDA (offsets are
 * passed in), so there is still one definition of it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* order of the offsets tuple (recorder.session.CUDA_PACK_FIELDS) */
enum { F_TS, F_DUR, F_CGROUP, F_RET, F_SIZE, F_STREAM, F_FUNCTION, F_POINTER, F_HANDLE, F_DIGEST, F_PID,
       F_TID, F_API, F_KIND, F_GX, F_GY, F_GZ, F_BX, F_BY, F_BZ, F_SHMEM, F_FLAGS, F_NATIVE,
       F_DRIVER, F_COUNT };

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
       S_SHMEM = S_BLOCK + 3, S_CGROUP, S_PY_STACK, S_NATIVE, S_DRIVER, S_COUNT };

#define CUDA_FLAG_FAILED 1 /* the call failed: its pointer was not written */
#define CUDA_FLAG_NO_STACK 2 /* a fast launch kept without stacks: no stack to look up */
#define CUDA_NO_API 0xFFFFFFFFu

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

static PyObject *pair(uint64_t a, uint64_t b)
{
    return Py_BuildValue("(KK)", (unsigned long long)a, (unsigned long long)b);
}

/* pack_cuda(joined, framed_size, offsets, session_id, threads, join, digests, natives, api_flags,
 *           learn) -> (packed, misses)
 * joined: framed cuda_event records (an 8-byte ring header, then the record); misses: the byte
 * offsets in joined of the records left to the Python path. A record's Python stack is
 * digests[py_digest] when it carries a digest (its stack was sent before), else
 * join.pop((ts, pid, tid)). learn(ts, pid, tid, native_digest) is called, in record order, for a
 * record whose thread or native stack is not in threads / natives yet; it adds them (as the
 * Python path would at that record) and the record is looked up again. */
static PyObject *py_pack_cuda(PyObject *self, PyObject *args)
{
    Py_buffer in, flags_buf;
    Py_ssize_t framed;
    PyObject *offsets, *threads, *join, *digests, *natives, *learn;
    long long session;
    if (!PyArg_ParseTuple(args, "y*nO!LO!O!O!O!y*O", &in, &framed, &PyTuple_Type, &offsets,
                          &session, &PyDict_Type, &threads, &PyDict_Type, &join, &PyDict_Type,
                          &digests, &PyDict_Type, &natives, &flags_buf, &learn))
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
    const Py_ssize_t n = in.len / framed, stride = (S_COUNT + 1) * 8;
    const unsigned char *api_flags = flags_buf.buf;
    packed = PyBytes_FromStringAndSize(NULL, n * stride);
    misses = PyList_New(0);
    if (!packed || !misses)
        goto out;
    int64_t *row = (int64_t *)PyBytes_AS_STRING(packed);
    Py_ssize_t rows = 0;
    uint32_t last_tid = 0, last_pid = 0;
    uint64_t last_native_digest = 0;
    long long last_thread = -1, last_native = -1, last_stack = -1;
    uint64_t last_digest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t start = i * framed;
        const char *r = (const char *)in.buf + start;
        uint64_t ts = u64_at(r + off[F_TS]);
        uint32_t pid = u32_at(r + off[F_PID]), tid = u32_at(r + off[F_TID]);
        uint32_t api = u32_at(r + off[F_API]);
        uint64_t native_digest = u64_at(r + off[F_NATIVE]);
        const int no_stack = (u32_at(r + off[F_FLAGS]) & CUDA_FLAG_NO_STACK) != 0;
        long long thread = -1, stack = -1, native = -1;
        if (api < (uint32_t)flags_buf.len && (native_digest || no_stack)) {
            PyObject *k;
            for (int attempt = 0;; attempt++) {
                /* a thread's calls come in runs, and few native stacks repeat: the last answers
                 * are reused (learn only adds entries, never changes one) */
                if (tid == last_tid) {
                    thread = last_thread;
                } else {
                    k = PyLong_FromUnsignedLong(tid);
                    thread = lookup(threads, k, 0);
                    Py_XDECREF(k);
                    if (thread > 0) {
                        last_tid = tid;
                        last_thread = thread;
                    }
                }
                if (thread > 0 && no_stack) {
                    native = 0; /* NULL, with the Python stack (masked below) */
                } else if (thread > 0) {
                    if (pid == last_pid && native_digest == last_native_digest) {
                        native = last_native;
                    } else {
                        k = pair(pid, native_digest);
                        native = lookup(natives, k, 0);
                        Py_XDECREF(k);
                        if (native >= 0) {
                            last_pid = pid;
                            last_native_digest = native_digest;
                            last_native = native;
                        }
                    }
                }
                if (thread == -2 || native == -2)
                    goto out;
                if ((thread > 0 && native >= 0) || attempt || learn == Py_None)
                    break;
                PyObject *r2 = PyObject_CallFunction(learn, "KkIK", (unsigned long long)ts,
                                                     (unsigned long)pid, tid,
                                                     (unsigned long long)native_digest);
                if (!r2)
                    goto out;
                Py_DECREF(r2);
            }
            uint64_t digest = u64_at(r + off[F_DIGEST]);
            if (thread > 0 && no_stack) {
                stack = 0;
            } else if (thread > 0 && native >= 0 && digest) {
                if (digest == last_digest) {
                    stack = last_stack;
                } else {
                    k = PyLong_FromUnsignedLongLong(digest);
                    stack = lookup(digests, k, 0);
                    Py_XDECREF(k);
                    if (stack >= 0) {
                        last_digest = digest;
                        last_stack = stack;
                    }
                }
            } else if (thread > 0 && native >= 0) {
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
        if (no_stack)
            mask |= 1ull << S_PY_STACK | 1ull << S_NATIVE;
        uint32_t driver = u32_at(r + off[F_DRIVER]);
        v[S_DRIVER] = driver;
        if (driver == CUDA_NO_API)
            mask |= 1ull << S_DRIVER;
        v[S_COUNT] = (int64_t)mask;
        rows++;
    }
    if (_PyBytes_Resize(&packed, rows * stride) < 0)
        goto out;
    result = PyTuple_Pack(2, packed, misses);
out:
    Py_XDECREF(packed);
    Py_XDECREF(misses);
    PyBuffer_Release(&in);
    PyBuffer_Release(&flags_buf);
    return result;
}

/* drain_records(data, consumer, page, mask, free_every) -> list[bytes]
 *
 * recorder/core/ringbuf.py Ring.drain for a ring of records of any size, in one call: data is the
 * producer mapping (the producer position on its first page, the data area twice after it),
 * consumer the consumer page. Every record committed when called is copied out in order; a busy
 * (reserved, not committed) record stops the walk; discarded ones are skipped. The consumer
 * position is stored every free_every records and at the end, so the producer gets space back. */
#define RB_BUSY (1u << 31)
#define RB_DISCARD (1u << 30)
#define RB_HEADER 8

static PyObject *py_drain_records(PyObject *self, PyObject *args)
{
    Py_buffer data, consumer;
    Py_ssize_t page, free_every;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "y*w*nKn", &data, &consumer, &page, &mask, &free_every))
        return NULL;
    PyObject *out = NULL;
    if (consumer.len < 8 || data.len < page + 2 * (Py_ssize_t)(mask + 1) || page < 8 ||
        free_every < 1) {
        PyErr_SetString(PyExc_ValueError, "not a ring buffer's mappings");
        goto done;
    }
    uint64_t *cons_at = consumer.buf;
    const char *base = (const char *)data.buf + page;
    uint64_t cons = __atomic_load_n(cons_at, __ATOMIC_RELAXED);
    uint64_t prod = __atomic_load_n((const uint64_t *)data.buf, __ATOMIC_ACQUIRE);
    out = PyList_New(0);
    if (!out)
        goto done;
    Py_ssize_t freed = 0;
    while (cons < prod) {
        const char *at = base + (cons & mask);
        uint32_t len = __atomic_load_n((const uint32_t *)at, __ATOMIC_ACQUIRE);
        if (len & RB_BUSY)
            break;
        uint32_t size = len & ~(RB_BUSY | RB_DISCARD);
        if (size > mask + 1 - RB_HEADER)
            break; /* not a record: leave it for the Python reader, which counts it */
        if (!(len & RB_DISCARD)) {
            PyObject *rec = PyBytes_FromStringAndSize(at + RB_HEADER, size);
            if (!rec || PyList_Append(out, rec) < 0) {
                Py_XDECREF(rec);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(rec);
        }
        cons += (size + RB_HEADER + 7) & ~7ull;
        if (++freed == free_every) {
            __atomic_store_n(cons_at, cons, __ATOMIC_RELEASE);
            freed = 0;
        }
    }
    __atomic_store_n(cons_at, cons, __ATOMIC_RELEASE);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&consumer);
    return out;
}

/* join_known_stacks(records, key_size, seen, join, reported, pending, targets) -> list[bytes]
 *
 * StackRecorder.add's loop for the records it has seen before (recorder/core/stacks.py): a pystacks
 * record whose bytes after (ts, pid, tid) map, in `seen`, to a stack resolved for good is joined
 * under (ts, pid, tid) in `join` when that is all the loop would do with it: no retry of a process
 * waiting to be configured (waits and pid in pending), no capability row to write (pid in targets,
 * not in reported, not in pending). Every other record is returned for the Python loop. */
static int member(PyObject *container, uint32_t pid)
{
    PyObject *key = PyLong_FromUnsignedLong(pid);
    if (!key)
        return -1;
    int r = PySet_Check(container) ? PySet_Contains(container, key)
                                   : PyDict_Contains(container, key);
    Py_DECREF(key);
    return r;
}

static PyObject *py_join_known_stacks(PyObject *self, PyObject *args)
{
    PyObject *records, *seen, *join, *reported, *pending, *targets;
    Py_ssize_t key_size;
    if (!PyArg_ParseTuple(args, "O!nO!O!O!O!O!", &PyList_Type, &records, &key_size, &PyDict_Type,
                          &seen, &PyDict_Type, &join, &PySet_Type, &reported, &PySet_Type, &pending,
                          &PyDict_Type, &targets))
        return NULL;
    if (key_size != 16) {
        PyErr_SetString(PyExc_ValueError, "a pystacks record opens with (u64 ts, u32 pid, u32 tid)");
        return NULL;
    }
    PyObject *misses = PyList_New(0);
    if (!misses)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(records);
    uint32_t last_pid = 0; /* no process has pid 0 */
    int in_pending = 0, in_reported = 0, in_targets = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PyList_GET_ITEM(records, i);
        int joined = 0;
        if (PyBytes_Check(rec) && PyBytes_GET_SIZE(rec) >= key_size) {
            const char *p = PyBytes_AS_STRING(rec);
            uint64_t ts = u64_at(p);
            uint32_t pid = u32_at(p + 8), tid = u32_at(p + 12);
            PyObject *k = Py_BuildValue("(ky#)", (unsigned long)pid, p + key_size,
                                        PyBytes_GET_SIZE(rec) - key_size);
            PyObject *hit = k ? PyDict_GetItemWithError(seen, k) : NULL;
            Py_XDECREF(k);
            if (!hit && PyErr_Occurred())
                goto fail;
            if (hit && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2 &&
                PyLong_CheckExact(PyTuple_GET_ITEM(hit, 0))) {
                int waits = PyObject_IsTrue(PyTuple_GET_ITEM(hit, 1));
                if (pid != last_pid) { /* the sets do not change during the call */
                    in_pending = member(pending, pid);
                    in_reported = member(reported, pid);
                    in_targets = member(targets, pid);
                    if (in_pending < 0 || in_reported < 0 || in_targets < 0)
                        goto fail;
                    last_pid = pid;
                }
                if (waits < 0)
                    goto fail;
                if (!(waits && in_pending) && !(!in_reported && !in_pending && in_targets)) {
                    PyObject *jk = Py_BuildValue("(KkI)", (unsigned long long)ts, (unsigned long)pid,
                                                 tid);
                    if (!jk || PyDict_SetItem(join, jk, PyTuple_GET_ITEM(hit, 0)) < 0) {
                        Py_XDECREF(jk);
                        goto fail;
                    }
                    Py_DECREF(jk);
                    joined = 1;
                }
            }
        }
        if (!joined && PyList_Append(misses, rec) < 0)
            goto fail;
    }
    return misses;
fail:
    Py_DECREF(misses);
    return NULL;
}

static PyMethodDef methods[] = {
    {"pack_cuda", py_pack_cuda, METH_VARARGS,
     "pack_cuda(joined, framed_size, offsets, session_id, threads, join, digests, natives, api_flags[, at])"
     " -> (packed, misses)"},
    {"drain_records", py_drain_records, METH_VARARGS,
     "drain_records(data, consumer, page, mask, free_every) -> records"},
    {"join_known_stacks", py_join_known_stacks, METH_VARARGS,
     "join_known_stacks(records, key_size, seen, join, reported, pending, targets) -> records left"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "recorder._ingest",
    "The recorder's hot loop in C: ring records, known stacks, packed cuda_call rows.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__ingest(void)
{
    return PyModule_Create(&module);
}
