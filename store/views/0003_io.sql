-- 0003_io: block I/O latency, exact from block_request rows (nearest-rank percentiles, no buckets).
-- The p-th percentile of n durations is the smallest duration d with cume_dist(d) >= p, i.e. the
-- ceil(p * n)-th smallest; block_request_percentile gives each request its cume_dist, so the
-- requests at or above a percentile are `WHERE percentile >= 0.999`.

-- view: block_request_named
-- block_request with the submitter's names and the session-relative second it started in.
CREATE VIEW block_request_named AS
SELECT r.*,
       t.tid AS tid,                                       -- submitting thread id
       coalesce(t.name, p.name) AS thread_name,            -- its name (its process's when never read)
       p.pid AS pid,                                       -- its process id
       p.name AS process_name,                             -- its process name
       (r.ts - s.started_ts) / 1000000000 AS window_s      -- whole seconds since the session start
FROM block_request r
JOIN session s ON s.id = r.session_id
LEFT JOIN thread t ON t.id = r.thread_id
LEFT JOIN process p ON p.id = t.process_id;

-- view: block_request_percentile
-- Each request with its rank among the requests of its session, device and op by dur.
CREATE VIEW block_request_percentile AS
SELECT n.*,
       cume_dist() OVER w AS percentile,                   -- fraction of requests (same device, op) with dur <= this one
       count(*) OVER (PARTITION BY session_id, device, op) AS requests  -- requests of that device and op
FROM block_request_named n
WINDOW w AS (PARTITION BY session_id, device, op ORDER BY dur);

-- view: block_latency
-- Exact latency per session, device and op: requests, p50/p99/p999/max of the whole request
-- (dur), of the queued stage and of the device stage (ns), bytes moved.
CREATE VIEW block_latency AS
WITH q AS (
  SELECT session_id, device, op, dur, queued_dur, device_dur, size_bytes,
         cume_dist() OVER (PARTITION BY session_id, device, op ORDER BY dur) AS cd,
         cume_dist() OVER (PARTITION BY session_id, device, op ORDER BY queued_dur) AS cq,
         cume_dist() OVER (PARTITION BY session_id, device, op ORDER BY device_dur) AS cv
  FROM block_request
)
SELECT session_id, device, op,
       count(*) AS requests,
       sum(size_bytes) AS bytes,
       min(dur) FILTER (WHERE cd >= 0.5) AS p50_dur,
       min(dur) FILTER (WHERE cd >= 0.99) AS p99_dur,
       min(dur) FILTER (WHERE cd >= 0.999) AS p999_dur,
       max(dur) AS max_dur,
       min(queued_dur) FILTER (WHERE cq >= 0.5) AS p50_queued_dur,
       min(queued_dur) FILTER (WHERE cq >= 0.99) AS p99_queued_dur,
       min(queued_dur) FILTER (WHERE cq >= 0.999) AS p999_queued_dur,
       max(queued_dur) AS max_queued_dur,
       min(device_dur) FILTER (WHERE cv >= 0.5) AS p50_device_dur,
       min(device_dur) FILTER (WHERE cv >= 0.99) AS p99_device_dur,
       min(device_dur) FILTER (WHERE cv >= 0.999) AS p999_device_dur,
       max(device_dur) AS max_device_dur
FROM q GROUP BY session_id, device, op;

-- view: block_latency_window
-- The same per one-second window of the session (window_s: whole seconds since its start).
CREATE VIEW block_latency_window AS
WITH q AS (
  SELECT session_id, device, op, window_s, dur, queued_dur, device_dur,
         cume_dist() OVER (PARTITION BY session_id, device, op, window_s ORDER BY dur) AS cd
  FROM block_request_named
)
SELECT session_id, device, op, window_s,
       count(*) AS requests,
       min(dur) FILTER (WHERE cd >= 0.5) AS p50_dur,
       min(dur) FILTER (WHERE cd >= 0.99) AS p99_dur,
       min(dur) FILTER (WHERE cd >= 0.999) AS p999_dur,
       max(dur) AS max_dur,
       sum(queued_dur) AS queued_dur,                      -- ns of queued stage summed over the window's requests
       sum(device_dur) AS device_dur                       -- ns on device summed
FROM q GROUP BY session_id, device, op, window_s;
