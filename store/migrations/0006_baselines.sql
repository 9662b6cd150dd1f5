-- Schema v6: baselines computed once when a session stops, so reports do not sort every call of
-- the session again. Sessions without rows here (recording, or killed) are computed on the fly by
-- the cuda_baseline view.

-- table: cuda_baseline_stored
-- The expected duration of a CUDA call per API family and size class, for a complete session.
CREATE TABLE cuda_baseline_stored (
    session_id INTEGER NOT NULL REFERENCES session(id),
    family TEXT NOT NULL,               -- API family, e.g. 'cudaMalloc'
    size_class INTEGER NOT NULL,        -- bit length of size_bytes, -1 without size
    calls INTEGER NOT NULL,             -- calls in the baseline
    median_dur INTEGER NOT NULL,        -- ns, median duration
    PRIMARY KEY (session_id, family, size_class)
);
