-- Schema v18: how an off-CPU interval's end was seen. Some kernels report no sched_switch when a
-- CPU goes from its idle task to a woken thread; the recorder then ends the interval at the
-- thread's return from the syscall it blocked in (microseconds after it ran again, never before),
-- or else at its wake-up (an idle CPU ran it at once), and says so here; one never woken (it was
-- preempted) has an end not seen and a duration of 0.

ALTER TABLE offcpu_interval ADD COLUMN end_seen TEXT; -- NULL: its switch-in; 'syscall return', 'wake-up' or 'not seen' when the kernel reported none (docs/losses.md)
