-- Secondary indexes for schema v29 (launch counts), built at the stop.
CREATE INDEX IF NOT EXISTS cuda_launch_count_thread_ts ON cuda_launch_count(thread_id, ts);
CREATE INDEX IF NOT EXISTS cuda_launch_sample_thread_ts ON cuda_launch_sample(thread_id, ts);
