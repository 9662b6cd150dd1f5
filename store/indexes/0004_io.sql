CREATE INDEX IF NOT EXISTS block_request_by_device ON block_request (session_id, device, op, dur);
CREATE INDEX IF NOT EXISTS block_request_by_thread ON block_request (thread_id, ts);
CREATE INDEX IF NOT EXISTS reclaim_interval_by_thread ON reclaim_interval (thread_id, ts);
