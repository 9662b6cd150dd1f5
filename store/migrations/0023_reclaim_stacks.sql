-- Schema v23: the Python stack of a thread where its direct reclaim began. A pure-Python loop
-- that allocates and touches memory reclaims in its page faults, where no other event of the
-- thread has a stack: the report put the reclaim's time on the line of the thread's latest earlier
-- event instead of the allocating line. Same deduplicated python_stack rows as the other events;
-- NULL for reclaims recorded before, or whose capture was lost.

ALTER TABLE reclaim_interval ADD COLUMN python_stack_id INTEGER; -- python_stack(id) of the thread where the reclaim began (the allocating line)
