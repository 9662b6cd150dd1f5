-- Schema v17: why a Python stack could not be read, and the code objects read back. The walker
-- (bpf/pystack.h) reads the target's memory without faulting pages in: a page swapped out or not
-- resident fails the read. A code object whose head failed is read back from user space
-- (/proc/PID/mem faults it in); a read that ended the walk is not retried (the thread has run on
-- since), and says what failed and the page's state.

ALTER TABLE python_stack ADD COLUMN failure TEXT; -- why a read failed, e.g. 'code object page swapped out', 'frame page not resident'; NULL when none did
ALTER TABLE python_stack ADD COLUMN reread INTEGER NOT NULL DEFAULT 0; -- code objects the walker could not read and user space read back (their frames are complete)
