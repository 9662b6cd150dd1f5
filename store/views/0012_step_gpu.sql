-- Views: GPU utilisation per step. NVML's samples (gpu_sample: the driver's sample buffer where it
-- has one, else polls) read against the steps, so a step that starved its GPU says so.

-- view: step_gpu
-- Per step and GPU: the utilisation samples taken while the step ran, their mean and minimum.
-- Found through the (session_id, ts) index, so `WHERE step_mark_id = ?` is cheap on any session.
CREATE VIEW step_gpu AS
SELECT st.step_mark_id, st.session_id, st.step, st.thread_id,
       g.gpu_index,                            -- NVML device index
       count(*) AS samples,                    -- samples inside the step
       round(avg(g.util_gpu), 1) AS util_gpu_mean, -- % mean utilisation over the step
       min(g.util_gpu) AS util_gpu_min         -- % lowest sample of the step
FROM step st
JOIN gpu_sample g ON g.session_id = st.session_id AND g.ts >= st.ts AND g.ts < st.end_ts
                 AND g.util_gpu IS NOT NULL
GROUP BY st.step_mark_id, g.gpu_index;
