"""The flight recorder: a session that keeps only its last minutes and saves the incidents by itself.

`recorder start --keep 10m` runs a normal session whose Writer also deletes what fell out of the
window (window.py over store/flight/__init__.py); once a second `FlightRecorder.tick()` looks for a
trigger (triggers.py) in what was just written (a stalled step by the report's stall rule, marked or,
for a process that marks none, inferred live as the report infers them (recorder/steps_live.py); on a
thread with no steps either way a CUDA call slow against its own baseline (recorder/slow_calls.py); a
kernel-log device error or OOM kill) and in the calls the session's layers hold in flight (a CUDA or
NCCL call in flight longer than --hang). A trigger saves [its time - before, its time + after] into
<db>.incidents/<UTC time>-<trigger>.db once the after part has been recorded (incidents.py); the copy
runs in a thread of its own so the ring buffers keep being drained. SIGUSR1 saves the kept window at
once (trigger 'signal').

Trigger storms: a trigger that fires while an incident is waiting for its after part joins it
(named in its detail); each trigger kind fires at most once per `cooldown`, and at most
`max_per_hour` incidents are saved per hour; the rest are counted in the status file.

Telling someone: each incident saved is explained (its step and primary cause kind, kept for the
metrics file of recorder/metrics.py), handed to the `--on-incident` command (recorder/incident_hook.py)
with a one-line summary and uploaded with --ship (shipping.py).

The flight recorder is given the session's handle (recorder/core/participant.py), never the
session, and imports no layer (an import contract in pyproject.toml).
"""

from recorder.flight.incidents import incident_facts, incident_name, incident_summary, save_incident
from recorder.flight.options import NS, TRIGGERS, FlightOptions, parse_size
from recorder.flight.recorder import FlightRecorder
from recorder.flight.window import Window, vacuum_statements

__all__ = ["NS", "TRIGGERS", "FlightOptions", "FlightRecorder", "Window", "incident_facts", "incident_name",
           "incident_summary", "parse_size", "save_incident", "vacuum_statements"]
