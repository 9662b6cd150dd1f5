/* recorder._markers: the native side of the marker API (recorder.step, recorder.lineage,
 * recorder.checkpoint).
 *
 * Each marker is an exported, never-inlined C function whose arguments are the whole message, so
 * a recorder attaches one uprobe to it and reads the registers: no shared memory, no socket, and
 * nothing to do when no recorder is attached (a call costs what a C call from Python costs).
 * The label strings passed to stall_recorder_lineage are kept alive by the Python side for the
 * life of the process, so a recorder can read them from /proc/PID/mem after the event.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MARKER __attribute__((visibility("default"), noinline, used))

/* The thread now works on training step `step`. */
MARKER void stall_recorder_step(uint64_t step)
{
    __asm__ volatile("" : : "r"(step) : "memory");
}

/* The thread's current lineage tag is now `tag` (0: none), named by label[0..len). */
MARKER void stall_recorder_lineage(uint64_t tag, const char *label, uint64_t len)
{
    __asm__ volatile("" : : "r"(tag), "r"(label), "r"(len) : "memory");
}

/* The thread begins (phase 1) or ends (phase 2) writing checkpoint file path[0..len). */
MARKER void stall_recorder_checkpoint(const char *path, uint64_t len, uint64_t phase, uint64_t tag)
{
    __asm__ volatile("" : : "r"(path), "r"(len), "r"(phase), "r"(tag) : "memory");
}

static PyObject *py_step(PyObject *self, PyObject *arg)
{
    unsigned long long step = PyLong_AsUnsignedLongLongMask(arg);
    if (step == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    stall_recorder_step(step);
    Py_RETURN_NONE;
}

static PyObject *py_lineage(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "lineage(tag, label_bytes)");
        return NULL;
    }
    unsigned long long tag = PyLong_AsUnsignedLongLongMask(args[0]);
    if (tag == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    char *label = NULL;
    Py_ssize_t len = 0;
    if (args[1] != Py_None && PyBytes_AsStringAndSize(args[1], &label, &len) < 0)
        return NULL;
    stall_recorder_lineage(tag, label, (uint64_t)len);
    Py_RETURN_NONE;
}

static PyObject *py_checkpoint(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "checkpoint(path_bytes, phase, tag)");
        return NULL;
    }
    char *path;
    Py_ssize_t len;
    if (PyBytes_AsStringAndSize(args[0], &path, &len) < 0)
        return NULL;
    unsigned long long phase = PyLong_AsUnsignedLongLongMask(args[1]);
    unsigned long long tag = PyLong_AsUnsignedLongLongMask(args[2]);
    if (PyErr_Occurred())
        return NULL;
    stall_recorder_checkpoint(path, (uint64_t)len, phase, tag);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"step", py_step, METH_O, "step(n): the calling thread works on step n"},
    {"lineage", (PyCFunction)(void (*)(void))py_lineage, METH_FASTCALL,
     "lineage(tag, label_bytes): the calling thread's lineage tag"},
    {"checkpoint", (PyCFunction)(void (*)(void))py_checkpoint, METH_FASTCALL,
     "checkpoint(path_bytes, phase, tag): begin (1) or end (2) of a checkpoint write"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_markers", NULL, -1, methods};

PyMODINIT_FUNC PyInit__markers(void) { return PyModule_Create(&module); }
