-- Secondary indexes for the causal views (store/views/0008_causes.sql), built at stop time.
CREATE INDEX IF NOT EXISTS block_request_thread_complete ON block_request (thread_id, complete_ts);  -- requests completing in a step
CREATE INDEX IF NOT EXISTS block_request_session_complete ON block_request (session_id, complete_ts);  -- writeback completing during a wait
CREATE INDEX IF NOT EXISTS thread_process ON thread (process_id);  -- the threads of a step's process
CREATE INDEX IF NOT EXISTS dirty_throttle_thread_ts ON dirty_throttle (thread_id, ts);  -- a step's dirty-page pauses
