-- Secondary indexes for 0002_kernel_log, built at stop time (not while recording, to keep inserts
-- cheap). Every typed table is looked up by time window and by device within a session.
CREATE INDEX IF NOT EXISTS kernel_log_session_ts ON kernel_log(session_id, ts);  -- records by time
CREATE INDEX IF NOT EXISTS kernel_log_session_event ON kernel_log(session_id, event_kind);  -- unknown lines, per-kind counts
CREATE INDEX IF NOT EXISTS nvme_event_session_ctrl_ts ON nvme_event(session_id, controller, ts);  -- timeouts/resets per controller, to join block requests
CREATE INDEX IF NOT EXISTS block_error_session_dev_ts ON block_error(session_id, dev, ts);  -- errors per block device
CREATE INDEX IF NOT EXISTS swiotlb_event_session_ts ON swiotlb_event(session_id, ts);  -- bounce exhaustion by time
CREATE INDEX IF NOT EXISTS iommu_fault_session_device_ts ON iommu_fault(session_id, device, ts);  -- faults per device
CREATE INDEX IF NOT EXISTS aer_event_session_device_ts ON aer_event(session_id, device, ts);  -- AER lines per device
CREATE INDEX IF NOT EXISTS gpu_xid_session_device_ts ON gpu_xid(session_id, device, ts);  -- Xids per GPU
CREATE INDEX IF NOT EXISTS oom_kill_session_pid_ts ON oom_kill(session_id, pid, ts);  -- OOM lines per victim
