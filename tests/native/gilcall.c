/* _gilcall: a C extension that calls the stand-in CUDA runtime while HOLDING the GIL, as PyTorch's
 * own extensions call libcudart from C++. Tests call it beside ctypes (which releases the GIL) so
 * both ways of reaching CUDA are covered. Built per interpreter by tests/native/native_libs.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>

typedef struct { unsigned int x, y, z; } dim3;
typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*launch_fn)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*sync_fn)(void *);

static void *lib;

static void *need(const char *name)
{
    if (!lib) {
        PyErr_SetString(PyExc_RuntimeError, "call _gilcall.open(path) first");
        return NULL;
    }
    void *f = dlsym(lib, name);
    if (!f)
        PyErr_Format(PyExc_RuntimeError, "symbol %s not found", name);
    return f;
}

static PyObject *gil_open(PyObject *self, PyObject *args)
{
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return PyErr_Format(PyExc_OSError, "dlopen %s: %s", path, dlerror());
    Py_RETURN_NONE;
}

static PyObject *gil_malloc(PyObject *self, PyObject *args)
{
    unsigned long long size;
    if (!PyArg_ParseTuple(args, "K", &size))
        return NULL;
    malloc_fn f = (malloc_fn)need("cudaMalloc");
    if (!f)
        return NULL;
    void *ptr = NULL;
    int r = f(&ptr, (size_t)size); /* GIL held on purpose */
    return Py_BuildValue("iK", r, (unsigned long long)(uintptr_t)ptr);
}

static PyObject *gil_free(PyObject *self, PyObject *args)
{
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K", &ptr))
        return NULL;
    free_fn f = (free_fn)need("cudaFree");
    if (!f)
        return NULL;
    return PyLong_FromLong(f((void *)(uintptr_t)ptr));
}

static PyObject *gil_launch(PyObject *self, PyObject *args)
{
    unsigned long long func, stream, shmem;
    dim3 g, b;
    if (!PyArg_ParseTuple(args, "K(III)(III)KK", &func, &g.x, &g.y, &g.z, &b.x, &b.y, &b.z,
                          &shmem, &stream))
        return NULL;
    launch_fn f = (launch_fn)need("cudaLaunchKernel");
    if (!f)
        return NULL;
    return PyLong_FromLong(f((void *)(uintptr_t)func, g, b, NULL, (size_t)shmem,
                             (void *)(uintptr_t)stream));
}

static PyObject *gil_sync(PyObject *self, PyObject *args)
{
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "K", &stream))
        return NULL;
    sync_fn f = (sync_fn)need("cudaStreamSynchronize");
    if (!f)
        return NULL;
    return PyLong_FromLong(f((void *)(uintptr_t)stream));
}

#if PY_VERSION_HEX < 0x030C0000
/* A thread started as threading starts one on 3.10 and 3.11: its creator makes its thread state,
 * which carries the creator's thread id until the new thread sets its own. Here the new thread
 * first calls cudaMalloc(size) natively, before it has set it, as a library's start-up code
 * could; then it sets it, takes the GIL and calls fn(). */
struct prebound {
    PyThreadState *tstate;
    PyObject *fn;
    malloc_fn f;
    size_t size;
    int failed;
};

static void *prebound_run(void *arg)
{
    struct prebound *b = arg;
    void *ptr = NULL;
    b->f(&ptr, b->size);
    b->tstate->thread_id = PyThread_get_thread_ident();
#if PY_VERSION_HEX >= 0x030B0000 && defined(PY_HAVE_THREAD_NATIVE_ID) /* 3.11 */
    b->tstate->native_thread_id = PyThread_get_thread_native_id();
#endif
    PyEval_AcquireThread(b->tstate);
    PyObject *r = PyObject_CallNoArgs(b->fn);
    if (r)
        Py_DECREF(r);
    else {
        PyErr_Print();
        b->failed = 1;
    }
    PyThreadState_Clear(b->tstate);
    PyThreadState_DeleteCurrent();
    return NULL;
}

static PyObject *gil_prebound(PyObject *self, PyObject *args)
{
    unsigned long long size;
    PyObject *fn;
    if (!PyArg_ParseTuple(args, "KO", &size, &fn))
        return NULL;
    malloc_fn f = (malloc_fn)need("cudaMalloc");
    if (!f)
        return NULL;
    struct prebound b = {PyThreadState_New(PyThreadState_Get()->interp), fn, f, (size_t)size, 0};
    if (!b.tstate)
        return PyErr_NoMemory();
    pthread_t t;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_create(&t, NULL, prebound_run, &b);
    if (rc == 0)
        pthread_join(t, NULL);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyThreadState_Clear(b.tstate);
        PyThreadState_Delete(b.tstate);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (b.failed)
        return PyErr_Format(PyExc_RuntimeError, "the thread's call failed (printed above)");
    Py_RETURN_NONE;
}
#endif

static PyMethodDef methods[] = {
    {"open", gil_open, METH_VARARGS, "dlopen the stand-in libcudart"},
    {"cudaMalloc", gil_malloc, METH_VARARGS, "cudaMalloc(size) -> (err, ptr), GIL held"},
    {"cudaFree", gil_free, METH_VARARGS, "cudaFree(ptr) -> err, GIL held"},
    {"cudaLaunchKernel", gil_launch, METH_VARARGS,
     "cudaLaunchKernel(func, grid, block, shmem, stream) -> err, GIL held"},
    {"cudaStreamSynchronize", gil_sync, METH_VARARGS, "cudaStreamSynchronize(stream), GIL held"},
#if PY_VERSION_HEX < 0x030C0000
    {"run_in_prebound_thread", gil_prebound, METH_VARARGS,
     "run_in_prebound_thread(size, fn): a new thread calls cudaMalloc(size) before its thread state "
     "is bound to it, then fn() with it"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gilcall", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gilcall(void) { return PyModule_Create(&module); }
