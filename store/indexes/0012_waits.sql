-- Retransmits during a wait (offcpu_wait, the report's network causes) are looked up by time.
CREATE INDEX IF NOT EXISTS tcp_retransmit_session_ts ON tcp_retransmit (session_id, ts);
