-- Schema v3: the Python and native stacks of CUDA calls, deduplicated: a stack is stored once per
-- session and referenced by id from every call made with it; frames are rows, innermost first.

-- table: python_code
-- A Python code object (function, method, lambda, module body) seen in a recorded stack.
CREATE TABLE python_code (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    filename TEXT NOT NULL,             -- co_filename as the interpreter has it ('<string>' for exec'd code)
    qualname TEXT NOT NULL,             -- co_qualname, e.g. 'Trainer.step' (co_name before 3.11)
    first_line INTEGER NOT NULL         -- co_firstlineno: the line of the def, not the executing line
);

-- table: python_stack
-- A distinct Python stack (or the reason there is none) at a traced call. status: 'ok', 'truncated'
-- (deeper than 64 frames: the innermost are kept), 'unresolved' (a frame's code object could not be
-- read back; its frame has no code_id), 'read error' (target memory unreadable mid-walk: the frames
-- before it are kept), 'no python thread state' (a thread that never ran Python), 'not configured'
-- (the process was not yet detected), 'unsupported interpreter' (see the python capability row),
-- 'walker not installed'.
CREATE TABLE python_stack (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    hash TEXT NOT NULL,                 -- digest of (status, frames): the deduplication key
    depth INTEGER NOT NULL,             -- frames stored (0 when the stack is unavailable)
    status TEXT NOT NULL                -- 'ok', or why the stack is partial or missing (above)
);

-- table: python_stack_frame
-- One frame of a Python stack; depth 0 is the innermost frame (the call site of the traced call).
CREATE TABLE python_stack_frame (
    stack_id INTEGER NOT NULL REFERENCES python_stack(id), -- the stack it belongs to
    depth INTEGER NOT NULL,             -- 0 = innermost, increasing towards the thread's entry point
    code_id INTEGER REFERENCES python_code(id), -- the code object executing; NULL when unresolved
    line INTEGER,                       -- the executing line (the call in progress), NULL where the code has none
    PRIMARY KEY (stack_id, depth)
) WITHOUT ROWID;

-- table: native_stack
-- A distinct native user stack at a traced call (frame-pointer walk by the kernel at the entry:
-- code built without frame pointers ends the walk early or yields spurious callers).
CREATE TABLE native_stack (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    hash TEXT NOT NULL,                 -- digest of the resolved frames: the deduplication key
    depth INTEGER NOT NULL              -- frames stored
);

-- table: native_stack_frame
-- One frame of a native stack; depth 0 is the traced function itself.
CREATE TABLE native_stack_frame (
    stack_id INTEGER NOT NULL REFERENCES native_stack(id), -- the stack it belongs to
    depth INTEGER NOT NULL,             -- 0 = the probed function, then its callers
    address INTEGER NOT NULL,           -- run-time instruction address (a return address for callers)
    object TEXT,                        -- path of the mapped file holding it, NULL for anonymous memory (JIT, vdso)
    symbol TEXT,                        -- function symbol from the object's .symtab/.dynsym, NULL where none covers it
    symbol_offset INTEGER,              -- bytes from the symbol's start; from the file's start when symbol is NULL
    PRIMARY KEY (stack_id, depth)
) WITHOUT ROWID;

ALTER TABLE cuda_call ADD COLUMN python_stack_id INTEGER REFERENCES python_stack(id); -- Python stack at the call's entry; NULL when its record was lost
ALTER TABLE cuda_call ADD COLUMN native_stack_id INTEGER REFERENCES native_stack(id); -- native user stack at entry; NULL when none was read (counted in the capability row cuda/native stacks)
