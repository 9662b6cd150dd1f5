-- Schema v14: wake-ups from interrupt context. A timer, a device interrupt or a softirq that wakes a
-- thread runs on top of whatever task it interrupted; that task is not the waker, so such a wake-up
-- names its context instead of a thread.

ALTER TABLE offcpu_interval ADD COLUMN waker_context TEXT; -- 'timer', 'interrupt' or 'softirq' when no task woke it (waker_thread_id NULL), else NULL
