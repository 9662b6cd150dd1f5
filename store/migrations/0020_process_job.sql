-- Schema v20: each process's place in its job, read once when the recorder first saw the process
-- (recorder/core/job.py): from its initial environment (/proc/PID/environ: what torchrun, srun or
-- the pod spec gave it) and its cgroup path. A value the process does not carry is NULL, never
-- guessed; environ_status says whether the environment could be read at all.

ALTER TABLE process ADD COLUMN environ_status TEXT; -- 'read', 'empty', 'gone' (exited first), 'unreadable: <reason>'; NULL: recorded before v20
ALTER TABLE process ADD COLUMN job_rank INTEGER;    -- $RANK, else $SLURM_PROCID (not `rank`: nccl_comm.rank is the communicator's)
ALTER TABLE process ADD COLUMN job_local_rank INTEGER; -- $LOCAL_RANK, else $SLURM_LOCALID
ALTER TABLE process ADD COLUMN job_world_size INTEGER; -- $WORLD_SIZE, else $SLURM_NTASKS
ALTER TABLE process ADD COLUMN master_addr TEXT;    -- $MASTER_ADDR:$MASTER_PORT (the rendezvous of torch.distributed)
ALTER TABLE process ADD COLUMN run_id TEXT;         -- $TORCHELASTIC_RUN_ID (torchrun's job id)
ALTER TABLE process ADD COLUMN slurm_job_id TEXT;   -- $SLURM_JOB_ID, else job_<ID> of the cgroup path
ALTER TABLE process ADD COLUMN slurm_step_id TEXT;  -- $SLURM_STEP_ID, else step_<ID> of the cgroup path ('0', 'batch', 'extern')
ALTER TABLE process ADD COLUMN pod_uid TEXT;        -- $POD_UID, else the pod<UID> of a kubepods cgroup path
ALTER TABLE process ADD COLUMN pod_namespace TEXT;  -- $POD_NAMESPACE (or MY_/K8S_ spellings), from the downward API
ALTER TABLE process ADD COLUMN pod_name TEXT;       -- $POD_NAME (or MY_/K8S_ spellings), from the downward API
ALTER TABLE process ADD COLUMN cgroup TEXT;         -- cgroup v2 path of the process ('0::' line of /proc/PID/cgroup)
