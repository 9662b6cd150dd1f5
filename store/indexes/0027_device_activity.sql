-- Imported traces: a step's device activity by time, a thread's host ops by time, runtime calls by
-- correlation (the device activity they launched).
CREATE INDEX IF NOT EXISTS device_activity_session_ts ON device_activity(session_id, ts);
CREATE INDEX IF NOT EXISTS host_op_thread_ts ON host_op(thread_id, ts);
CREATE INDEX IF NOT EXISTS host_op_session_ts ON host_op(session_id, ts);
CREATE INDEX IF NOT EXISTS collective_record_group_seq ON collective_record(pg_name, collective_seq_id);
