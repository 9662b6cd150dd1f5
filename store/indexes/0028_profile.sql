-- Secondary index for 0028_profile, built at stop time: a step's samples by thread and time.
CREATE INDEX IF NOT EXISTS cpu_sample_thread_ts ON cpu_sample(thread_id, ts);
