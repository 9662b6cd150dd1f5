-- Schema v26: the words a recording's layers write, with what they mean. Each layer of the recorder
-- declares the `loss.probe` names it may write; the session stores them at its start, so a report
-- words every loss (its layer, what was lost and why) from the recording itself, also the losses of a
-- layer this version of the store does not know. Sessions recorded before have no rows here: their
-- words are the ones store/analysis/losses.py knows.

-- table: layer_vocabulary
-- One word a session's layers may write, per session.
CREATE TABLE layer_vocabulary (
    session_id INTEGER NOT NULL REFERENCES session(id),
    layer TEXT NOT NULL,                -- the layer as reports name it ('block', 'nccl', 'recorder')
    kind TEXT NOT NULL,                 -- 'loss': word is a loss.probe name
    word TEXT NOT NULL,
    what TEXT NOT NULL,                 -- what was lost ('requests')
    why TEXT NOT NULL,                  -- why ('ring buffer full')
    PRIMARY KEY (session_id, kind, word)
);
