-- Views: CUDA graphs. A graph is captured on a stream (cudaStreamBeginCapture ..
-- cudaStreamEndCapture), instantiated into an executable graph (cudaGraphInstantiate writes its
-- handle: that row's `pointer`) and replayed by cudaGraphLaunch (the handle is that row's
-- `event_handle`), many times: torch.compile's "reduce-overhead" mode, CUDA graph trees, vLLM and
-- SGLang decode steps. One replay runs many kernels the recorder sees no launch of, so a replay
-- and the synchronisation that waits for it are named by the graph and where it was made.

-- view: cuda_graph
-- One row per executable graph a session instantiated: where (the instantiation's Python line),
-- and its replays.
CREATE VIEW cuda_graph AS
SELECT
    i.session_id,
    i.pointer AS graph_exec,            -- the executable graph's handle (cudaGraphExec_t)
    i.event_handle AS graph,            -- the graph it was made from (cudaGraph_t)
    i.id AS instantiate_call_id,        -- cuda_call of the instantiation
    i.ts AS instantiated_ts,            -- ns, CLOCK_MONOTONIC
    i.thread_id,
    (SELECT p.python_line FROM cuda_call_python p WHERE p.cuda_call_id = i.id) AS instantiated_at, -- 'capture() at model.py:88'
    (SELECT count(*) FROM cuda_call l JOIN cuda_api la ON la.id = l.api_id
      WHERE l.session_id = i.session_id AND l.event_handle = i.pointer
        AND la.family IN ('cudaGraphLaunch', 'cuGraphLaunch')) AS replays, -- its cudaGraphLaunch calls
    (SELECT coalesce(sum(l.dur), 0) FROM cuda_call l JOIN cuda_api la ON la.id = l.api_id
      WHERE l.session_id = i.session_id AND l.event_handle = i.pointer
        AND la.family IN ('cudaGraphLaunch', 'cuGraphLaunch')) AS replay_dur -- ns inside those calls
FROM cuda_call i
JOIN cuda_api a ON a.id = i.api_id
WHERE a.family IN ('cudaGraphInstantiate', 'cudaGraphInstantiateWithFlags', 'cuGraphInstantiate',
                   'cuGraphInstantiateWithFlags')
  AND i.pointer IS NOT NULL;

-- view: cuda_graph_launch
-- Causal link: a graph replay -> the graph it launched (NULL columns when its instantiation was
-- not recorded, e.g. made before the recorder attached).
CREATE VIEW cuda_graph_launch AS
SELECT
    l.id AS cuda_call_id, l.session_id, l.ts, l.dur, l.thread_id, l.stream,
    l.event_handle AS graph_exec,       -- the executable graph replayed
    g.instantiate_call_id,              -- cuda_call of its instantiation
    g.instantiated_at                   -- its Python line
FROM cuda_call l
JOIN cuda_api a ON a.id = l.api_id
LEFT JOIN cuda_graph g ON g.session_id = l.session_id AND g.graph_exec = l.event_handle
WHERE a.family IN ('cudaGraphLaunch', 'cuGraphLaunch');

-- view: cuda_sync_graph
-- Causal link: a synchronisation -> the graph replays it waited for: those its thread launched
-- since its previous synchronisation (on the same stream, for a stream synchronisation).
CREATE VIEW cuda_sync_graph AS
SELECT
    s.id AS sync_call_id, s.session_id,
    g.cuda_call_id AS graph_launch_call_id,
    g.graph_exec, g.instantiated_at, g.ts AS launched_ts
FROM cuda_call s
JOIN cuda_api sa ON sa.id = s.api_id
JOIN cuda_graph_launch g ON g.thread_id = s.thread_id AND g.ts < s.ts
 AND (s.stream IS NULL OR g.stream = s.stream)
 AND g.ts > coalesce((SELECT max(p.ts) FROM cuda_call p JOIN cuda_api pa ON pa.id = p.api_id
                      WHERE p.thread_id = s.thread_id AND p.ts < s.ts
                        AND pa.family IN ('cudaStreamSynchronize', 'cudaDeviceSynchronize',
                                          'cudaEventSynchronize', 'cuStreamSynchronize',
                                          'cuCtxSynchronize', 'cuEventSynchronize')), 0)
WHERE sa.family IN ('cudaStreamSynchronize', 'cudaDeviceSynchronize', 'cudaEventSynchronize',
                    'cuStreamSynchronize', 'cuCtxSynchronize', 'cuEventSynchronize');
