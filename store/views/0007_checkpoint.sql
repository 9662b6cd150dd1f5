-- Views: checkpoint integrity, from the tables of store/migrations/0008_checkpoint.sql. A checkpoint
-- file is judged on what the recorder saw written (extents, syncs, closes, renames, its writer's
-- exit) against what was on disk after it was complete (size, mtime, sha256), and on what happened
-- to it afterwards (writes, the stat at the session stop, rechecks). Each view reads every table
-- once (no per-file rescans of checkpoint_extent): about 1.5-3 s per million writes on 2 vCPUs.

-- view: checkpoint_extent_gap
-- Holes in what was written to a checkpoint file: byte ranges below the highest offset written that
-- no successful write covered. Writes of unknown offset (O_APPEND) are left out. One row per hole.
CREATE VIEW checkpoint_extent_gap AS
WITH written AS (
    SELECT session_id, file_id, file_offset,
           max(file_offset + size_bytes) OVER (
               PARTITION BY file_id ORDER BY file_offset
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS covered_to
    FROM checkpoint_extent
    WHERE error = 0 AND size_bytes > 0 AND file_offset IS NOT NULL
)
SELECT
    session_id,
    file_id,                                              -- the checkpoint_file
    coalesce(covered_to, 0) AS file_offset,               -- bytes: where the hole begins
    file_offset - coalesce(covered_to, 0) AS size_bytes   -- bytes: how long the hole is
FROM written
WHERE file_offset > coalesce(covered_to, 0);

-- view: checkpoint_file_io
-- Per checkpoint file, what its writers did to it: writes and bytes, the end of what was written,
-- opens and closes, syncs, truncation, errors, and the path it ended up at after renames.
CREATE VIEW checkpoint_file_io AS
SELECT
    f.id AS file_id,                                      -- the checkpoint_file
    f.session_id,
    coalesce(w.writes, 0) AS writes,                      -- write syscalls (any of checkpoint_extent.syscall)
    coalesce(w.bytes_written, 0) AS bytes_written,        -- bytes written by successful writes
    w.extent_end,                                         -- bytes: highest offset + size written (known offsets), NULL without writes
    coalesce(w.unknown_offsets, 0) AS unknown_offsets,    -- writes whose offset is unknown (O_APPEND)
    coalesce(w.write_errors, 0) AS write_errors,          -- writes that returned an error
    w.first_write_ts,                                     -- ns: the first write was entered
    w.last_write_end_ts,                                  -- ns: the last write returned
    coalesce(o.opens, 0) AS opens,                        -- opens for writing
    coalesce(o.closes, 0) AS closes,                      -- close calls
    o.last_close_ts,                                      -- ns: the last close was entered
    coalesce(o.syncs, 0) AS syncs,                        -- successful fsync and fdatasync calls
    o.last_sync_ts,                                       -- ns: the last successful fsync/fdatasync was entered
    coalesce(o.op_errors, 0) AS op_errors,                -- fsync, fdatasync, ftruncate or close calls that failed
    t.last_truncate_ts,                                   -- ns: the last successful ftruncate returned
    t.last_truncate_size,                                 -- bytes: the length the last ftruncate set
    r.rename_ts,                                          -- ns: the last rename that moved it, NULL if never moved
    coalesce(r.final_path, f.path) AS final_path          -- absolute path after the last rename (else the path opened)
FROM checkpoint_file f
LEFT JOIN (
    SELECT file_id, count(*) AS writes,
           sum(CASE WHEN error = 0 THEN size_bytes ELSE 0 END) AS bytes_written,
           max(CASE WHEN error = 0 AND file_offset IS NOT NULL THEN file_offset + size_bytes END) AS extent_end,
           sum(file_offset IS NULL) AS unknown_offsets,
           sum(error != 0) AS write_errors,
           min(ts) AS first_write_ts,
           max(ts + dur) AS last_write_end_ts
    FROM checkpoint_extent GROUP BY file_id
) w ON w.file_id = f.id
LEFT JOIN (
    SELECT file_id,
           sum(op = 'open') AS opens,
           sum(op = 'close') AS closes,
           max(CASE WHEN op = 'close' THEN ts END) AS last_close_ts,
           sum(op IN ('fsync', 'fdatasync') AND error = 0) AS syncs,
           max(CASE WHEN op IN ('fsync', 'fdatasync') AND error = 0 THEN ts END) AS last_sync_ts,
           sum(op IN ('fsync', 'fdatasync', 'ftruncate', 'close') AND error != 0) AS op_errors
    FROM checkpoint_op GROUP BY file_id
) o ON o.file_id = f.id
-- with max(), SQLite takes the other columns from the row that has the maximum
LEFT JOIN (
    SELECT file_id, max(ts + dur) AS last_truncate_ts, size_bytes AS last_truncate_size
    FROM checkpoint_op WHERE op = 'ftruncate' AND error = 0 GROUP BY file_id
) t ON t.file_id = f.id
LEFT JOIN (
    SELECT file_id, max(ts) AS rename_ts, path AS final_path
    FROM checkpoint_op WHERE op = 'rename' AND error = 0 GROUP BY file_id
) r ON r.file_id = f.id;

-- view: checkpoint_integrity
-- One row per checkpoint file (rewrites of a completed one are not rows of their own: they make it
-- 'changed'), with its status and every reason for it. status, first match wins:
--   open        still open, or its recorder.checkpoint() scope not left, and its writer alive
--   missing     gone from its path when the recorder came to hash it
--   incomplete  gap (a hole in the written extents), no_fsync (no successful fsync/fdatasync after
--               the last write and before the rename that gave it its final name, or before close),
--               size_mismatch (size on disk at hashing != the end of what was written, or the
--               length of a later ftruncate), writer_died (its process ended with it open or inside
--               its scope), write_error (a write, sync, truncate or close failed)
--   changed     written_after_completion (opened again and written outside any scope),
--               modified_before_hash (its mtime when hashed is after its last write),
--               changed_at_stop / missing_at_stop / replaced_at_stop (the stat at the session stop),
--               sha256_differs / missing_at_recheck / replaced_at_recheck (verify_checkpoints);
--               a checkpoint later superseded at its path by another of the session is judged
--               without those later looks (they see the newer file)
--   verified    hashed, and none of the above
--   unverified  not hashed (yet, or the session stopped first, or it could not be read)
CREATE VIEW checkpoint_integrity AS
WITH base AS (
    SELECT
        f.id AS file_id, f.session_id, f.thread_id, f.ts AS open_ts, f.dur AS open_dur, f.path,
        f.opted_by, f.scope_path, f.scope_ts, f.scope_end_ts, f.tag,
        io.writes, io.bytes_written, io.extent_end, io.unknown_offsets, io.write_errors,
        io.last_write_end_ts, io.opens, io.closes, io.last_close_ts, io.syncs, io.last_sync_ts,
        io.op_errors, io.last_truncate_ts, io.last_truncate_size, io.rename_ts, io.final_path,
        t.tid, p.pid, p.exit_ts AS writer_exit_ts,
        v.id AS verify_id, v.state AS verify_state, v.ts AS verified_ts, v.size_bytes AS verified_size,
        v.mtime_ts AS verified_mtime_ts, v.sha256
    FROM checkpoint_file f
    JOIN checkpoint_file_io io ON io.file_id = f.id
    LEFT JOIN thread t ON t.id = f.thread_id
    LEFT JOIN process p ON p.id = t.process_id
    LEFT JOIN checkpoint_verify v ON v.id = (
        SELECT min(x.id) FROM checkpoint_verify x
        WHERE x.file_id = f.id AND x.method = 'sha256' AND x.trigger IN ('completed', 'writer_exited'))
    WHERE f.opted_by != 'rewrite'
),
derived AS (
    SELECT b.*,
        CASE WHEN b.unknown_offsets > 0 THEN NULL
             WHEN b.last_truncate_ts > coalesce(b.last_write_end_ts, 0) THEN b.last_truncate_size
             ELSE max(coalesce(b.extent_end, 0), coalesce(b.last_truncate_size, 0)) END AS expected_size,
        (b.closes < b.opens OR (b.scope_ts IS NOT NULL AND b.scope_end_ts IS NULL)) AS unfinished,
        coalesce(gp.gaps, 0) AS gaps,
        gp.first_gap_offset,
        b.writes > 0 AND NOT EXISTS (
            SELECT 1 FROM checkpoint_op s
            WHERE s.file_id = b.file_id AND s.op IN ('fsync', 'fdatasync') AND s.error = 0
              AND s.ts >= b.last_write_end_ts AND (b.rename_ts IS NULL OR s.ts < b.rename_ts)) AS no_fsync,
        b.verified_mtime_ts > max(coalesce(b.last_write_end_ts, 0), coalesce(b.last_truncate_ts, 0),
                                  b.open_ts + b.open_dur) + 1000000 AS modified_before_hash,
        min(coalesce(rw.extent_ts, rw.truncate_ts), coalesce(rw.truncate_ts, rw.extent_ts)) AS changed_ts,
        lead(b.file_id) OVER (PARTITION BY b.session_id, b.final_path ORDER BY b.open_ts) AS superseded_by_file_id
    FROM base b
    LEFT JOIN (
        SELECT file_id, count(*) AS gaps, min(file_offset) AS first_gap_offset
        FROM checkpoint_extent_gap GROUP BY file_id
    ) gp ON gp.file_id = b.file_id
    LEFT JOIN (
        SELECT r.modifies_file_id AS file_id,
               (SELECT min(e.ts) FROM checkpoint_extent e WHERE e.file_id IN (
                   SELECT id FROM checkpoint_file WHERE modifies_file_id = r.modifies_file_id)
                 AND e.error = 0 AND e.size_bytes > 0) AS extent_ts,
               (SELECT min(t.ts) FROM checkpoint_op t WHERE t.file_id IN (
                   SELECT id FROM checkpoint_file WHERE modifies_file_id = r.modifies_file_id)
                 AND t.op = 'ftruncate' AND t.error = 0) AS truncate_ts
        FROM checkpoint_file r WHERE r.modifies_file_id IS NOT NULL GROUP BY r.modifies_file_id
    ) rw ON rw.file_id = b.file_id
),
later AS (
    SELECT d.*,
        CASE WHEN d.superseded_by_file_id IS NULL THEN (
            SELECT group_concat(DISTINCT CASE
                       WHEN x.method = 'sha256' AND x.state = 'hashed' AND x.sha256 != d.sha256 THEN 'sha256_differs'
                       WHEN x.state IN ('changed', 'missing', 'replaced') THEN
                           x.state || (CASE x.trigger WHEN 'session_stop' THEN '_at_stop' ELSE '_at_recheck' END)
                       END)
            FROM checkpoint_verify x
            WHERE x.file_id = d.file_id AND x.id > d.verify_id) END AS later_changes
    FROM derived d
),
judged AS (
    SELECT l.*,
        nullif(trim(
            CASE WHEN l.gaps > 0 THEN 'gap,' ELSE '' END
            || CASE WHEN l.no_fsync THEN 'no_fsync,' ELSE '' END
            || CASE WHEN l.verify_state = 'hashed' AND l.expected_size IS NOT NULL
                         AND l.verified_size != l.expected_size AND NOT coalesce(l.modified_before_hash, 0)
                    THEN 'size_mismatch,' ELSE '' END
            || CASE WHEN l.unfinished AND l.writer_exit_ts IS NOT NULL THEN 'writer_died,' ELSE '' END
            || CASE WHEN l.write_errors + l.op_errors > 0 THEN 'write_error,' ELSE '' END, ','), '') AS incomplete_reasons,
        nullif(trim(
            CASE WHEN l.changed_ts IS NOT NULL THEN 'written_after_completion,' ELSE '' END
            || CASE WHEN l.modified_before_hash THEN 'modified_before_hash,' ELSE '' END
            || coalesce(l.later_changes, ''), ','), '') AS changed_reasons
    FROM later l
)
SELECT
    j.file_id,                                            -- the checkpoint_file
    j.session_id,
    j.pid,                                                -- process that opened it first
    j.tid,                                                -- thread that opened it first
    j.path,                                               -- absolute path it was opened at
    j.final_path,                                         -- absolute path after its last rename
    j.opted_by,
    j.scope_path,
    j.tag,
    l.label,                                              -- lineage label of the tag, NULL when none
    CASE
        WHEN j.unfinished AND j.writer_exit_ts IS NULL THEN 'open'
        WHEN j.verify_state = 'missing' THEN 'missing'
        WHEN j.incomplete_reasons IS NOT NULL THEN 'incomplete'
        WHEN j.changed_reasons IS NOT NULL THEN 'changed'
        WHEN j.verify_state = 'hashed' THEN 'verified'
        ELSE 'unverified'
    END AS status,                                        -- open, missing, incomplete, changed, verified, unverified (see above)
    nullif(trim(
        CASE WHEN j.verify_state = 'missing' THEN 'missing,' ELSE '' END
        || coalesce(j.incomplete_reasons || ',', '') || coalesce(j.changed_reasons, ''), ','), '') AS reasons, -- comma-separated reasons for the status, NULL when none
    j.open_ts,                                            -- ns: first opened
    CASE WHEN NOT j.unfinished THEN max(j.last_close_ts, coalesce(j.rename_ts, 0), coalesce(j.scope_end_ts, 0))
    END AS complete_ts,                                   -- ns: closed, renamed and its scope left (the latest of them), NULL while unfinished
    j.last_write_end_ts,
    j.last_sync_ts,
    j.rename_ts,
    j.writer_exit_ts,                                     -- ns: its process ended, NULL if alive at the stop
    j.writes,
    j.bytes_written,
    j.extent_end,
    j.expected_size,                                      -- bytes the file should have: the written end, or a later ftruncate's length; NULL with O_APPEND writes
    j.gaps,                                               -- holes in the written extents (checkpoint_extent_gap)
    j.first_gap_offset,                                   -- bytes: where the first hole begins, NULL without holes
    j.syncs,
    j.verify_state,                                       -- state of the first hash (checkpoint_verify), NULL before it
    j.verified_ts,                                        -- ns: the first hash began
    j.verified_size AS size_bytes,                        -- bytes on disk when hashed
    j.sha256,                                             -- sha256 of the content when hashed (lowercase hex)
    j.changed_ts,                                         -- ns: first write after completion (a rewrite), NULL when none
    j.superseded_by_file_id                               -- a later checkpoint of the session that ended at the same path, NULL when none
FROM judged j
LEFT JOIN lineage_label l ON l.session_id = j.session_id AND l.tag = j.tag;
