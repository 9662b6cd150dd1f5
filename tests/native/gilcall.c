/* _gilcall: a C extension that calls the stand-in CUDA runtime while HOLDING the GIL, as PyTorch's
 * own extensions call libcudart from C++. Tests call it beside ctypes (which releases the GIL) so
 * both ways of reaching CUDA are covered. Built per interpreter by tests/native/native_libs.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

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

static PyMethodDef methods[] = {
    {"open", gil_open, METH_VARARGS, "dlopen the stand-in libcudart"},
    {"cudaMalloc", gil_malloc, METH_VARARGS, "cudaMalloc(size) -> (err, ptr), GIL held"},
    {"cudaFree", gil_free, METH_VARARGS, "cudaFree(ptr) -> err, GIL held"},
    {"cudaLaunchKernel", gil_launch, METH_VARARGS,
     "cudaLaunchKernel(func, grid, block, shmem, stream) -> err, GIL held"},
    {"cudaStreamSynchronize", gil_sync, METH_VARARGS, "cudaStreamSynchronize(stream), GIL held"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gilcall", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gilcall(void) { return PyModule_Create(&module); }
