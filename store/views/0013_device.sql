-- Views: the device's own timeline and the host's ops of imported profiler traces (`recorder import`),
-- with their names and the call that launched each activity, for the sqlite3 shell and the MCP run_sql.

-- view: host_op_named
-- host_op with its name, thread and process.
CREATE VIEW host_op_named AS
SELECT o.id, o.session_id, o.ts, o.dur, o.thread_id, o.kind,
       s.value AS name,                 -- operator, Python function, runtime call or annotation
       o.correlation, o.external_id,
       t.tid, p.pid
FROM host_op o
JOIN string s ON s.id = o.name_id
JOIN thread t ON t.id = o.thread_id
LEFT JOIN process p ON p.id = t.process_id;

-- view: device_activity_detail
-- device_activity with its name and the runtime call that launched it (its name, thread, and how
-- long the activity waited on the device after the launch returned).
CREATE VIEW device_activity_detail AS
SELECT d.id, d.session_id, d.ts, d.dur, d.kind,
       s.value AS name,                 -- kernel name or 'Memcpy HtoD (Pinned -> Device)', ...
       d.device, d.stream, d.correlation, d.size_bytes, d.grid, d.block,
       d.launch_op_id,
       ls.value AS launch_api,          -- 'cudaLaunchKernel', 'hipMemcpyWithStream', ... NULL when unknown
       l.thread_id AS launch_thread_id,
       d.ts - (l.ts + l.dur) AS queued_dur -- ns from the launch call's return to the start on the device
FROM device_activity d
JOIN string s ON s.id = d.name_id
LEFT JOIN host_op l ON l.id = d.launch_op_id
LEFT JOIN string ls ON ls.id = l.name_id;
