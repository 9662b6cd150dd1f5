-- Schema v10: the rules the views apply, stored as rows. Each threshold and each mapping is written
-- once, here; the views join these tables and the report reads them (to apply them and to quote
-- them), so `UPDATE stall_rule SET ratio = 2` in the sqlite3 shell changes which steps every view
-- and every report calls a stall.

-- table: stall_rule
-- When a step is a stall (views step_baseline, step_baseline_lookup, stall). One row.
CREATE TABLE stall_rule (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    ratio REAL NOT NULL CHECK (ratio > 1),             -- a stall takes at least ratio x its baseline
    min_excess_dur INTEGER NOT NULL CHECK (min_excess_dur >= 0), -- ns, and at least this much more
    min_baseline_steps INTEGER NOT NULL CHECK (min_baseline_steps >= 1), -- steps a baseline needs
    -- steps on each side the rolling baseline (a median) is taken over; step_baseline's and
    -- stall's window frames are written with this number (SQLite takes no expression there)
    neighbours INTEGER NOT NULL CHECK (neighbours = 10)
);
INSERT INTO stall_rule (id, ratio, min_excess_dur, min_baseline_steps, neighbours) VALUES (1, 1.5, 1000000, 3, 10);

-- table: slow_call_rule
-- When a CUDA call is slow (view slow_cuda_call). One row.
CREATE TABLE slow_call_rule (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    ratio REAL NOT NULL CHECK (ratio > 1),             -- a slow call takes at least ratio x its baseline
    min_excess_dur INTEGER NOT NULL CHECK (min_excess_dur >= 0), -- ns, and at least this much more
    min_baseline_calls INTEGER NOT NULL CHECK (min_baseline_calls >= 1) -- calls a baseline needs
);
INSERT INTO slow_call_rule (id, ratio, min_excess_dur, min_baseline_calls) VALUES (1, 2, 200000, 3);

-- table: device_event_cause
-- Which root cause a device or machine event stands for (kind as block_request_device_event and
-- step_machine_event name it): an I/O wait hit by one of these is that cause, and the same event
-- is not repeated among the secondary signals of a step whose root cause it is.
CREATE TABLE device_event_cause (
    kind TEXT PRIMARY KEY,              -- event kind, e.g. 'nvme_timeout_abort'
    cause TEXT NOT NULL                 -- cause kind, e.g. 'nvme_timeout'
) WITHOUT ROWID;
INSERT INTO device_event_cause (kind, cause) VALUES
    ('nvme_timeout', 'nvme_timeout'), ('nvme_abort_status', 'nvme_timeout'),
    ('nvme_resetting', 'nvme_timeout'), ('nvme_controller_down', 'nvme_timeout'),
    ('nvme_reset_failure', 'nvme_timeout'), ('nvme_not_ready', 'nvme_timeout'),
    ('nvme_timeout_abort', 'nvme_timeout'), ('nvme_timeout_reset', 'nvme_timeout'),
    ('nvme_timeout_disable', 'nvme_timeout'), ('nvme_timeout_polled', 'nvme_timeout'),
    ('io_error', 'io_error'), ('iommu_fault', 'iommu_fault'), ('pcie_aer', 'pcie_aer'),
    ('dma_bounce', 'dma_bounce'), ('swiotlb_full', 'dma_bounce'), ('dma_map_slow', 'dma_bounce'),
    ('gpu_xid', 'gpu_xid');

-- table: cause_kind
-- Every root cause a report can name, with how specific it is: among causes of similar size the
-- more specific one is the root cause (a futex sleep inside a collective is explained by the rank
-- that was late, D state inside reclaim by the reclaim, an I/O wait by the NVMe timeout that hit
-- its request).
CREATE TABLE cause_kind (
    kind TEXT PRIMARY KEY,
    specificity INTEGER NOT NULL        -- higher wins among causes within cause_rule.specific_share
) WITHOUT ROWID;
INSERT INTO cause_kind (kind, specificity) VALUES
    ('nvme_timeout', 9), ('io_error', 9), ('iommu_fault', 9), ('pcie_aer', 9), ('gpu_xid', 9),
    ('dma_bounce', 8), ('nccl_straggler', 7), ('memory_reclaim', 7), ('tcp_retransmit', 7),
    ('dirty_throttle', 6), ('io_throttled', 5), ('io_queued', 5), ('slow_io', 5),
    ('cpu_contention', 4), ('slow_cuda_call', 4), ('nccl_wait', 3), ('network_wait', 3),
    ('blocked_io', 2), ('blocked', 1);

-- table: cause_rule
-- How a step's root cause is chosen among its candidate causes. One row.
CREATE TABLE cause_rule (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    specific_share REAL NOT NULL,       -- a more specific cause wins when it explains this share of the top excess
    explained_share REAL NOT NULL,      -- below this share of the stall, no recorded cause explains it
    secondary_share REAL NOT NULL       -- other causes above this share of the stall are secondary signals
);
INSERT INTO cause_rule (id, specific_share, explained_share, secondary_share) VALUES (1, 0.5, 0.2, 0.05);
