-- Secondary indexes for 0003_python, built at stop time. Calls are looked up by their stack (the
-- python_lines grouping, "every call from this line"); frames by code object.
CREATE INDEX IF NOT EXISTS cuda_call_python_stack ON cuda_call(python_stack_id);  -- calls per Python stack
CREATE INDEX IF NOT EXISTS cuda_call_native_stack ON cuda_call(native_stack_id);  -- calls per native stack
CREATE INDEX IF NOT EXISTS python_stack_frame_code ON python_stack_frame(code_id);  -- stacks through a function
