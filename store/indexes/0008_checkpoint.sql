CREATE INDEX IF NOT EXISTS checkpoint_extent_by_file ON checkpoint_extent (file_id, file_offset);
CREATE INDEX IF NOT EXISTS checkpoint_op_by_file ON checkpoint_op (file_id, op, ts);
CREATE INDEX IF NOT EXISTS checkpoint_verify_by_file ON checkpoint_verify (file_id, id);
CREATE INDEX IF NOT EXISTS checkpoint_file_by_modified ON checkpoint_file (modifies_file_id);
