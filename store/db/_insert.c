/* store.db._insert: write packed integer rows into a table through the connection Python's sqlite3
 * module already holds, without a Python object per value and without the GIL.
 *
 * Why: a cuda_call row costs ~3 us through sqlite3.Connection.executemany on a small VM, and as
 * much through a prepared INSERT stepped once per row from C: each execution opens a table cursor
 * and seeks the end of the table again. Here a whole batch is one statement,
 *     INSERT INTO t (columns) SELECT c0, c1, ... FROM stall_packed(?1)
 * where stall_packed is a table-valued function (an eponymous virtual table) reading the packed
 * rows that ?1 points to (sqlite3_bind_pointer), so the cursor is opened once per batch.
 *
 * Packed rows (recorder/_ingest.c makes them): per row, `slots` signed 64-bit values and a 64-bit
 * mask whose bit i marks slot i NULL. A column program (one letter per column of the INSERT) says
 * how slots become values:
 *   'i'  one slot, an INTEGER (NULL when its mask bit is set)
 *   'd'  three slots, the TEXT "x,y,z" of three unsigned 32-bit values (NULL when the first slot's
 *        mask bit is set): a kernel launch's grid or block dimensions
 *
 * The sqlite3 functions are looked up in the library that the sqlite3 module itself has loaded
 * (bind(path) with its path from /proc/self/maps; dlopen(RTLD_NOLOAD) refuses any other), so the
 * handle and the functions always come from one SQLite; sqlite3.h is used for its types only. The
 * handle is the first member of CPython's connection object after its object header
 * (Modules/_sqlite/connection.h, 3.8-3.14); filename(conn) lets the caller check it by asking
 * SQLite for the database's file name.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <sqlite3.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_COLUMNS 48
#define POINTER_TYPE "stall_recorder_packed_rows"

static struct {
    int (*prepare_v2)(sqlite3 *, const char *, int, sqlite3_stmt **, const char **);
    int (*bind_pointer)(sqlite3_stmt *, int, void *, const char *, void (*)(void *));
    int (*step)(sqlite3_stmt *);
    int (*finalize)(sqlite3_stmt *);
    int (*get_autocommit)(sqlite3 *);
    int (*exec)(sqlite3 *, const char *, int (*)(void *, int, char **, char **), void *, char **);
    const char *(*errmsg)(sqlite3 *);
    const char *(*db_filename)(sqlite3 *, const char *);
    int (*create_module_v2)(sqlite3 *, const char *, const sqlite3_module *, void *,
                            void (*)(void *));
    int (*declare_vtab)(sqlite3 *, const char *);
    void (*result_int64)(sqlite3_context *, sqlite3_int64);
    void (*result_null)(sqlite3_context *);
    void (*result_text)(sqlite3_context *, const char *, int, void (*)(void *));
    void *(*value_pointer)(sqlite3_value *, const char *);
} api;
static int bound;

/* One batch: the rows and how each column of the vtab reads them. */
struct batch {
    const int64_t *rows;
    Py_ssize_t count;
    int stride;                 /* int64 values per row: slots + the mask */
    int slots;
    int columns;
    int slot_of[MAX_COLUMNS];
    char kind_of[MAX_COLUMNS];
};

struct cursor {
    sqlite3_vtab_cursor base;
    const struct batch *batch;
    Py_ssize_t row;
};

static int vt_connect(sqlite3 *db, void *aux, int argc, const char *const *argv,
                      sqlite3_vtab **out, char **err)
{
    char schema[64 + MAX_COLUMNS * 6] = "CREATE TABLE x(";
    size_t n = strlen(schema);
    for (int i = 0; i < MAX_COLUMNS; i++)
        n += (size_t)snprintf(schema + n, sizeof(schema) - n, "c%d,", i);
    snprintf(schema + n, sizeof(schema) - n, "src HIDDEN)");
    int rc = api.declare_vtab(db, schema);
    if (rc != SQLITE_OK)
        return rc;
    *out = calloc(1, sizeof(sqlite3_vtab));
    return *out ? SQLITE_OK : SQLITE_NOMEM;
}

static int vt_disconnect(sqlite3_vtab *vt)
{
    free(vt);
    return SQLITE_OK;
}

/* Only a scan with src = ?: the batch pointer is the function's argument. */
static int vt_best_index(sqlite3_vtab *vt, sqlite3_index_info *info)
{
    for (int i = 0; i < info->nConstraint; i++) {
        const struct sqlite3_index_constraint *c = &info->aConstraint[i];
        if (c->iColumn == MAX_COLUMNS && c->op == SQLITE_INDEX_CONSTRAINT_EQ) {
            if (!c->usable)
                return SQLITE_CONSTRAINT;
            info->aConstraintUsage[i].argvIndex = 1;
            info->aConstraintUsage[i].omit = 1;
            info->idxNum = 1;
            info->estimatedCost = 1000;
            return SQLITE_OK;
        }
    }
    info->idxNum = 0;
    info->estimatedCost = 1e12;
    return SQLITE_OK;
}

static int vt_open(sqlite3_vtab *vt, sqlite3_vtab_cursor **out)
{
    struct cursor *c = calloc(1, sizeof(*c));
    if (!c)
        return SQLITE_NOMEM;
    *out = &c->base;
    return SQLITE_OK;
}

static int vt_close(sqlite3_vtab_cursor *cur)
{
    free(cur);
    return SQLITE_OK;
}

static int vt_filter(sqlite3_vtab_cursor *cur, int idx, const char *idx_str, int argc,
                     sqlite3_value **argv)
{
    struct cursor *c = (struct cursor *)cur;
    c->batch = idx == 1 && argc == 1 ? api.value_pointer(argv[0], POINTER_TYPE) : NULL;
    c->row = 0;
    return SQLITE_OK;
}

static int vt_next(sqlite3_vtab_cursor *cur)
{
    ((struct cursor *)cur)->row++;
    return SQLITE_OK;
}

static int vt_eof(sqlite3_vtab_cursor *cur)
{
    struct cursor *c = (struct cursor *)cur;
    return !c->batch || c->row >= c->batch->count;
}

static char *u32_text(char *p, uint32_t v)
{
    char digits[10];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *p++ = digits[--n];
    return p;
}

static int vt_column(sqlite3_vtab_cursor *cur, sqlite3_context *ctx, int col)
{
    struct cursor *c = (struct cursor *)cur;
    const struct batch *b = c->batch;
    if (col >= b->columns) {
        api.result_null(ctx);
        return SQLITE_OK;
    }
    const int64_t *v = b->rows + c->row * b->stride;
    int slot = b->slot_of[col];
    if ((uint64_t)v[b->slots] >> slot & 1) {
        api.result_null(ctx);
    } else if (b->kind_of[col] == 'd') {
        char text[40], *p = text;
        p = u32_text(p, (uint32_t)v[slot]);
        *p++ = ',';
        p = u32_text(p, (uint32_t)v[slot + 1]);
        *p++ = ',';
        p = u32_text(p, (uint32_t)v[slot + 2]);
        api.result_text(ctx, text, (int)(p - text), SQLITE_TRANSIENT);
    } else {
        api.result_int64(ctx, v[slot]);
    }
    return SQLITE_OK;
}

static int vt_rowid(sqlite3_vtab_cursor *cur, sqlite3_int64 *rowid)
{
    *rowid = ((struct cursor *)cur)->row;
    return SQLITE_OK;
}

static const sqlite3_module packed_module = {
    .iVersion = 1,
    .xCreate = NULL, /* eponymous only: used as stall_packed(?1), never created */
    .xConnect = vt_connect,
    .xBestIndex = vt_best_index,
    .xDisconnect = vt_disconnect,
    .xDestroy = vt_disconnect,
    .xOpen = vt_open,
    .xClose = vt_close,
    .xFilter = vt_filter,
    .xNext = vt_next,
    .xEof = vt_eof,
    .xColumn = vt_column,
    .xRowid = vt_rowid,
};

static PyObject *py_bind(PyObject *self, PyObject *arg)
{
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path)
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!lib) {
        PyErr_Format(PyExc_OSError, "%s is not loaded in this process", path);
        return NULL;
    }
#define LOOK(field, name)                                                                  \
    if (!(*(void **)&api.field = dlsym(lib, name))) {                                      \
        PyErr_Format(PyExc_OSError, "%s has no %s", path, name);                           \
        return NULL;                                                                       \
    }
    LOOK(prepare_v2, "sqlite3_prepare_v2")
    LOOK(bind_pointer, "sqlite3_bind_pointer")
    LOOK(step, "sqlite3_step")
    LOOK(finalize, "sqlite3_finalize")
    LOOK(get_autocommit, "sqlite3_get_autocommit")
    LOOK(exec, "sqlite3_exec")
    LOOK(errmsg, "sqlite3_errmsg")
    LOOK(db_filename, "sqlite3_db_filename")
    LOOK(create_module_v2, "sqlite3_create_module_v2")
    LOOK(declare_vtab, "sqlite3_declare_vtab")
    LOOK(result_int64, "sqlite3_result_int64")
    LOOK(result_null, "sqlite3_result_null")
    LOOK(result_text, "sqlite3_result_text")
    LOOK(value_pointer, "sqlite3_value_pointer")
#undef LOOK
    bound = 1;
    Py_RETURN_NONE;
}

static sqlite3 *handle_of(PyObject *conn)
{
    return *(sqlite3 **)((char *)conn + sizeof(PyObject));
}

static sqlite3 *open_handle(PyObject *conn)
{
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "bind() the sqlite3 library first");
        return NULL;
    }
    sqlite3 *db = handle_of(conn);
    if (!db)
        PyErr_SetString(PyExc_ValueError, "the connection is closed");
    return db;
}

/* filename(conn) -> the file name SQLite has for the connection's main database ('' in memory) */
static PyObject *py_filename(PyObject *self, PyObject *conn)
{
    sqlite3 *db = open_handle(conn);
    if (!db)
        return NULL;
    const char *name = api.db_filename(db, "main");
    return PyUnicode_FromString(name ? name : "");
}

/* register(conn): make stall_packed(?) available on the connection */
static PyObject *py_register(PyObject *self, PyObject *conn)
{
    sqlite3 *db = open_handle(conn);
    if (!db)
        return NULL;
    if (api.create_module_v2(db, "stall_packed", &packed_module, NULL, NULL) != SQLITE_OK) {
        PyErr_Format(PyExc_OSError, "cannot register stall_packed: %s", api.errmsg(db));
        return NULL;
    }
    Py_RETURN_NONE;
}

/* insert(conn, sql, program, slots, packed) -> rows
 * sql: INSERT INTO t (columns) SELECT c0, ... FROM stall_packed(?1), as many columns as program.
 * Runs inside the connection's current transaction, opening one (BEGIN) when none is open, as the
 * sqlite3 module does before a write; the caller commits. */
static PyObject *py_insert(PyObject *self, PyObject *args)
{
    PyObject *conn;
    const char *sql, *program;
    int slots;
    Py_buffer packed;
    if (!PyArg_ParseTuple(args, "Ossiy*", &conn, &sql, &program, &slots, &packed))
        return NULL;
    sqlite3 *db = open_handle(conn);
    struct batch b = {.rows = packed.buf, .slots = slots, .stride = slots + 1};
    int needed = 0;
    for (const char *p = program; *p && b.columns < MAX_COLUMNS; p++) {
        b.slot_of[b.columns] = needed;
        b.kind_of[b.columns++] = *p;
        needed += *p == 'd' ? 3 : 1;
    }
    if (!db || slots < 1 || slots > 63 || needed != slots || program[b.columns] ||
        packed.len % ((Py_ssize_t)b.stride * 8)) {
        PyBuffer_Release(&packed);
        if (db)
            PyErr_SetString(PyExc_ValueError, "packed rows do not match the column program");
        return NULL;
    }
    b.count = packed.len / ((Py_ssize_t)b.stride * 8);
    int rc = SQLITE_OK;
    const char *failed = NULL;
    sqlite3_stmt *st = NULL;

    Py_BEGIN_ALLOW_THREADS
    if (api.get_autocommit(db) && (rc = api.exec(db, "BEGIN", NULL, NULL, NULL)) != SQLITE_OK)
        failed = "BEGIN";
    else if ((rc = api.prepare_v2(db, sql, -1, &st, NULL)) != SQLITE_OK)
        failed = "prepare";
    else if ((rc = api.bind_pointer(st, 1, &b, POINTER_TYPE, NULL)) != SQLITE_OK)
        failed = "bind";
    else if ((rc = api.step(st)) != SQLITE_DONE)
        failed = "insert";
    if (st)
        api.finalize(st);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&packed);
    if (failed) {
        PyObject *sqlite3_mod = PyImport_ImportModule("sqlite3");
        PyObject *exc = sqlite3_mod ? PyObject_GetAttrString(sqlite3_mod, "OperationalError") : NULL;
        Py_XDECREF(sqlite3_mod);
        if (exc) {
            PyErr_Format(exc, "%s of %zd packed rows failed (code %d): %s", failed, b.count, rc,
                         api.errmsg(db));
            Py_DECREF(exc);
        }
        return NULL;
    }
    return PyLong_FromSsize_t(b.count);
}

static PyMethodDef methods[] = {
    {"bind", py_bind, METH_O, "bind(path): use the sqlite3 library loaded from path"},
    {"filename", py_filename, METH_O, "filename(conn): the main database file of a connection"},
    {"register", py_register, METH_O, "register(conn): make stall_packed(?) available"},
    {"insert", py_insert, METH_VARARGS, "insert(conn, sql, program, slots, packed) -> rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "store.db._insert",
    "Packed integer rows into SQLite through the sqlite3 module's own connection.", -1, methods,
};

PyMODINIT_FUNC PyInit__insert(void)
{
    return PyModule_Create(&module);
}
