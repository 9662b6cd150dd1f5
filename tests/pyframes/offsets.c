/* offsetof() of every field recorder/core/pyframes.py's OFFSETS table uses, against one interpreter's
 * own headers (built per interpreter by tests/test_pyframes.py): the table cannot drift silently. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#if PY_VERSION_HEX >= 0x030b0000
#include "internal/pycore_frame.h"
#else
#include <frameobject.h>
#endif
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#define P(name, expr) printf("%s %zu\n", name, (size_t)(expr))
int main(void) {
  P("runtime_interpreters_head", offsetof(_PyRuntimeState, interpreters.head));
  P("interp_next", offsetof(PyInterpreterState, next));
#if PY_VERSION_HEX < 0x030b0000
  P("interp_threads_head", offsetof(PyInterpreterState, tstate_head));
#else
  P("interp_threads_head", offsetof(PyInterpreterState, threads.head));
#endif
  P("tstate_next", offsetof(PyThreadState, next));
  P("tstate_thread_id", offsetof(PyThreadState, thread_id));
#if PY_VERSION_HEX < 0x030b0000
  P("tstate_frame", offsetof(PyThreadState, frame));
  P("frame_back", offsetof(PyFrameObject, f_back));
  P("frame_code", offsetof(PyFrameObject, f_code));
  P("frame_instr", offsetof(PyFrameObject, f_lasti));
#elif PY_VERSION_HEX < 0x030d0000
  P("tstate_frame", offsetof(PyThreadState, cframe));
  P("cframe_current_frame", offsetof(_PyCFrame, current_frame));
  P("frame_code", offsetof(_PyInterpreterFrame, f_code));
  P("frame_back", offsetof(_PyInterpreterFrame, previous));
  P("frame_instr", offsetof(_PyInterpreterFrame, prev_instr));
  P("frame_owner", offsetof(_PyInterpreterFrame, owner));
#else
  P("tstate_frame", offsetof(PyThreadState, current_frame));
  P("frame_code", offsetof(_PyInterpreterFrame, f_executable));
  P("frame_back", offsetof(_PyInterpreterFrame, previous));
  P("frame_instr", offsetof(_PyInterpreterFrame, instr_ptr));
  P("frame_owner", offsetof(_PyInterpreterFrame, owner));
#endif
  P("code_filename", offsetof(PyCodeObject, co_filename));
  P("code_name", offsetof(PyCodeObject, co_name));
#if PY_VERSION_HEX >= 0x030b0000
  P("code_qualname", offsetof(PyCodeObject, co_qualname));
  P("code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
#endif
#if PY_VERSION_HEX >= 0x030c0000
  P("code_version", offsetof(PyCodeObject, co_version));
#endif
  P("code_firstlineno", offsetof(PyCodeObject, co_firstlineno));
  P("code_linetable", offsetof(PyCodeObject, co_linetable));
  P("str_hash", offsetof(PyASCIIObject, hash));
  P("str_state", offsetof(PyASCIIObject, state));
  P("str_ascii_size", sizeof(PyASCIIObject));
  P("str_compact_size", sizeof(PyCompactUnicodeObject));
  P("bytes_data", offsetof(PyBytesObject, ob_sval));
  return 0;
}
