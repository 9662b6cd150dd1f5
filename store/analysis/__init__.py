"""What a recording means: stalls, their causes and evidence, waits, hangs, losses, jobs."""
