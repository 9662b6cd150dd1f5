-- Secondary indexes for schema v1, built when a session stops (not during capture, where they
-- would cost half the ingest rate). Every statement is idempotent.
CREATE INDEX IF NOT EXISTS offcpu_interval_thread_ts ON offcpu_interval(thread_id, ts);
CREATE INDEX IF NOT EXISTS cuda_call_thread_ts ON cuda_call(thread_id, ts);
CREATE INDEX IF NOT EXISTS cuda_call_api ON cuda_call(session_id, api_id, size_class, dur);
CREATE INDEX IF NOT EXISTS thread_session_tid ON thread(session_id, tid);
