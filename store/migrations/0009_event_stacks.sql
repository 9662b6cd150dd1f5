-- Schema v9: the Python stack of the thread at more kinds of events than CUDA calls, so that a
-- report names the Python line behind an off-CPU wait, an I/O request, a collective or a marker.
-- Same deduplicated python_stack rows as CUDA calls (0003_python); NULL where none was captured.

ALTER TABLE offcpu_interval ADD COLUMN python_stack_id INTEGER REFERENCES python_stack(id); -- Python stack of the thread when it blocked (not captured for preemptions)
ALTER TABLE block_request ADD COLUMN python_stack_id INTEGER REFERENCES python_stack(id); -- Python stack of the submitting thread where the bio was queued in its context
ALTER TABLE nccl_call ADD COLUMN python_stack_id INTEGER REFERENCES python_stack(id); -- Python stack at the NCCL call's entry
ALTER TABLE step_mark ADD COLUMN python_stack_id INTEGER REFERENCES python_stack(id); -- Python stack at the recorder.step call
ALTER TABLE lineage_mark ADD COLUMN python_stack_id INTEGER REFERENCES python_stack(id); -- Python stack where the lineage scope was entered or left
ALTER TABLE checkpoint_mark ADD COLUMN python_stack_id INTEGER REFERENCES python_stack(id); -- Python stack where the checkpoint scope was entered or left

-- Markers are rare (one per step or scope), so their indexes are kept from the start rather than
-- built at stop: the step view finds each step's end through them even while recording.
CREATE INDEX IF NOT EXISTS step_mark_thread_ts ON step_mark(thread_id, ts);
CREATE INDEX IF NOT EXISTS step_mark_session_step ON step_mark(session_id, step);
CREATE INDEX IF NOT EXISTS lineage_mark_thread_ts ON lineage_mark(thread_id, ts);
