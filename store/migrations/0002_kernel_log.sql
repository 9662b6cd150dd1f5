-- 0002_kernel_log: the kernel log (/dev/kmsg) of a session and the typed events parsed from it.
-- Applied after 0001 (which creates `session`). Written by recorder/layers/kmsg/ (`rows_for`).
-- Secondary indexes are built at stop time: store/indexes/0002_kernel_log.sql.

-- table: kernel_log
-- Every /dev/kmsg record read during a session, whether or not a parser recognised it. A record
-- of a watched subsystem (nvme, block, swiotlb, intel_iommu, amd_iommu, aer, nvidia, oom) that no
-- parser knows is kept here with event_kind 'unknown'; a record whose header could not be read is
-- kept with malformed = 1 and its raw bytes. Typed tables point back here through kernel_log_id.
CREATE TABLE kernel_log (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session that read the record
  ts INTEGER NOT NULL,                                 -- ns CLOCK_MONOTONIC: the record's printk time (us resolution) corrected by the measured printk clock offset; read time if the header had none
  printk_ts INTEGER,                                   -- ns of the kernel's own stamp (local_clock, usec * 1000) as printed, uncorrected; NULL if the header had none
  seq INTEGER,                                         -- kernel sequence number of the record (NULL if malformed); gaps are records lost to overwrite
  level INTEGER,                                       -- syslog level 0 emerg .. 7 debug (prio & 7)
  facility INTEGER,                                    -- syslog facility (prio >> 3): 0 kernel, 1 user (records written to /dev/kmsg)
  flag TEXT,                                           -- header flag: '-' whole record, 'c' continuation fragment, '+' continued
  caller TEXT,                                         -- printk caller (T<tid> or C<cpu>) when the kernel adds it, else NULL
  subsystem TEXT,                                      -- watched subsystem the line belongs to (nvme, block, ...), NULL for other lines
  event_kind TEXT,                                     -- '<typed table>.<kind>' of the parsed event, 'unknown' for an unparsed subsystem line, NULL otherwise
  device TEXT,                                         -- device the line names (nvme0, nvme0n1, 0000:01:00.0, ...) or the record's DEVICE= property
  text TEXT NOT NULL,                                  -- message text with \xNN escapes undone
  properties TEXT,                                     -- continuation lines as KEY=value, one per line (SUBSYSTEM=pci, DEVICE=+pci:...), NULL if none
  malformed INTEGER NOT NULL DEFAULT 0,                -- 1 if the header or continuation lines could not be read
  raw BLOB,                                            -- the record's bytes exactly as read, kept only when malformed = 1
  UNIQUE (session_id, seq)                             -- a record re-read after a reader restart is not stored twice
);

-- table: nvme_event
-- NVMe driver messages (drivers/nvme/host/pci.c): command timeouts (old `I/O 4096 QID 7 timeout`
-- and new `I/O tag 489 (d1e9) opcode 0x1 ... QID 3 timeout` forms), abort status, controller
-- resets, controller down, device not ready and disable after reset failure. A timeout line means
-- the request was issued about nvme_core.io_timeout (30 s by default) before ts.
CREATE TABLE nvme_event (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  kernel_log_id INTEGER NOT NULL UNIQUE REFERENCES kernel_log(id), -- the record this event was parsed from
  ts INTEGER NOT NULL,                                 -- ns CLOCK_MONOTONIC: when the kernel logged it (copy of kernel_log.ts)
  kind TEXT NOT NULL,                                  -- timeout, abort_status, resetting, controller_down, power_saving_hint, not_ready, reset_failure
  controller TEXT NOT NULL,                            -- controller device name (nvme0), or the PCI address for messages printed against it
  tag INTEGER,                                         -- blk-mq tag of the timed-out request
  qid INTEGER,                                         -- NVMe queue id (0 = admin queue)
  command_id INTEGER,                                  -- NVMe command identifier (new format only: the hex number in parentheses)
  opcode INTEGER,                                      -- NVMe opcode of the timed-out command (new format only)
  opcode_name TEXT,                                    -- opcode class as printed (I/O Cmd, Admin Cmd)
  action TEXT,                                         -- what the driver does next (aborting, reset controller, disable controller, ...), or the advice text
  req_op TEXT,                                         -- block request operation (READ, WRITE, FLUSH, ...), new format only
  req_op_code INTEGER,                                 -- numeric block request operation (REQ_OP_*)
  size_bytes INTEGER,                                  -- bytes of the timed-out request, new format only
  status INTEGER,                                      -- NVMe completion status of the abort command (Abort status)
  csts INTEGER,                                        -- controller status register (CSTS) when it went down or was not ready
  pci_status INTEGER,                                  -- PCI status register read when the controller went down
  errno INTEGER                                        -- negative errno: PCI_STATUS read failure or reset failure (-19 = ENODEV)
);

-- table: block_error
-- Block layer I/O errors: `[blk_update_request: ]I/O error, dev nvme0n1, sector ... op 0x0:(READ)
-- flags ... phys_seg ... prio class ...` (older kernels stop after the sector; the first words
-- are the block status name: I/O, timeout, critical medium, ...) and `Buffer I/O error on dev`.
CREATE TABLE block_error (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  kernel_log_id INTEGER NOT NULL UNIQUE REFERENCES kernel_log(id), -- the record this event was parsed from
  ts INTEGER NOT NULL,                                 -- ns CLOCK_MONOTONIC: when the kernel logged it
  kind TEXT NOT NULL,                                  -- io_error (request failed) or buffer_io_error (buffer head I/O failed)
  dev TEXT NOT NULL,                                   -- block device name (nvme0n1, sda1)
  error TEXT,                                          -- block status name (I/O, timeout, critical medium, ...), io_error only
  function TEXT,                                       -- kernel function that printed it on older kernels (blk_update_request, print_req_error)
  sector INTEGER,                                      -- first 512-byte sector of the failed request
  op_code INTEGER,                                     -- numeric request operation and flags' op part (REQ_OP_*)
  op TEXT,                                             -- request operation name (READ, WRITE, ...)
  flags INTEGER,                                       -- request cmd_flags (REQ_* bits)
  phys_seg INTEGER,                                    -- physical segments in the request
  prio_class INTEGER,                                  -- I/O priority class (0 none, 1 RT, 2 BE, 3 idle)
  logical_block INTEGER,                               -- file system logical block, buffer_io_error only
  context TEXT                                         -- what the buffer I/O was (async page read, lost async page write, ...)
);

-- table: swiotlb_event
-- SWIOTLB bounce-buffer exhaustion: `<driver> <pci address>: swiotlb buffer is full (sz: N bytes),
-- total T (slots), used U (slots)`. A DMA mapping that needed a bounce buffer found none free; the
-- driver retries or fails the I/O.
CREATE TABLE swiotlb_event (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  kernel_log_id INTEGER NOT NULL UNIQUE REFERENCES kernel_log(id), -- the record this event was parsed from
  ts INTEGER NOT NULL,                                 -- ns CLOCK_MONOTONIC: when the kernel logged it
  kind TEXT NOT NULL,                                  -- buffer_full
  driver TEXT,                                         -- driver of the device that mapped (nvme, mlx5_core), NULL if not printed
  device TEXT,                                         -- device (PCI address 0000:01:00.0), NULL if not printed
  size_bytes INTEGER NOT NULL,                         -- bytes of the mapping that could not be bounced
  total_slots INTEGER,                                 -- slots in the bounce pool (2 KiB each), NULL on older kernels
  used_slots INTEGER                                   -- slots in use at the time, NULL on older kernels
);

-- table: iommu_fault
-- IOMMU faults: Intel VT-d (`DMAR: [DMA Read NO_PASID] Request device [00:1e.3] fault addr ...
-- [fault reason 0x06] ...`, PASID and INTR-REMAP variants, and the `DRHD: handling fault status
-- reg` line that precedes them) and AMD-Vi (`Event logged [IO_PAGE_FAULT ... domain= address=
-- flags=]`, device printed as a prefix or as device=).
CREATE TABLE iommu_fault (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  kernel_log_id INTEGER NOT NULL UNIQUE REFERENCES kernel_log(id), -- the record this event was parsed from
  ts INTEGER NOT NULL,                                 -- ns CLOCK_MONOTONIC: when the kernel logged it
  vendor TEXT NOT NULL,                                -- intel (VT-d / DMAR) or amd (AMD-Vi)
  kind TEXT NOT NULL,                                  -- dma_fault, intr_remap_fault, fault_status (intel); the AMD-Vi event type in lower case (io_page_fault, ...)
  event_type TEXT,                                     -- AMD-Vi event type as printed (IO_PAGE_FAULT, ILLEGAL_DEV_TABLE_ENTRY, ...)
  driver TEXT,                                         -- driver of the faulting device when printed as a prefix (AMD-Vi)
  device TEXT,                                         -- faulting device: bus:dev.fn in lower-case hex, with the PCI segment when printed (0000:04:00.0)
  access TEXT,                                         -- read or write (VT-d DMA faults)
  pasid INTEGER,                                       -- process address space id, NULL for NO_PASID / not printed
  address INTEGER,                                     -- faulting I/O virtual address (two's complement if >= 2^63)
  fault_index INTEGER,                                 -- interrupt remapping table index (INTR-REMAP faults)
  fault_reason INTEGER,                                -- VT-d fault reason code
  reason_text TEXT,                                    -- VT-d fault reason text (PTE Read access is not set, ...)
  domain INTEGER,                                      -- AMD-Vi protection domain id
  flags INTEGER,                                       -- AMD-Vi event flags
  status_reg INTEGER                                   -- VT-d fault status register (fault_status lines)
);

-- table: aer_event
-- PCIe Advanced Error Reporting lines: the root port's `[Multiple ]<severity> error message
-- received from <source>`, `PCIe Bus Error: severity=..., type=..., (<agent>)` (CXL ports: `CXL Bus
-- Error`), `device [vvvv:dddd] error status/mask=...` and one line per set status bit
-- (`[ 7] BadDLLP`, `(First)`). The lines of one error share device and follow each other in seq.
CREATE TABLE aer_event (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  kernel_log_id INTEGER NOT NULL UNIQUE REFERENCES kernel_log(id), -- the record this event was parsed from
  ts INTEGER NOT NULL,                                 -- ns CLOCK_MONOTONIC: when the kernel logged it
  kind TEXT NOT NULL,                                  -- message, bus_error, status, bit
  driver TEXT,                                         -- driver of the device the line is printed against (pcieport, nvme)
  device TEXT,                                         -- PCI address the line is printed against (the reporting port, or the erring device)
  source TEXT,                                         -- PCI address the error message came from (message lines)
  source_id INTEGER,                                   -- requester id (bus << 8 | devfn) printed by older kernels as id=00e0
  multiple INTEGER,                                    -- 1 if several errors were collapsed into this message (Multiple)
  bus TEXT,                                            -- PCIe or CXL (bus_error lines)
  severity TEXT,                                       -- as printed: Correctable/Corrected, Uncorrectable/Uncorrected (Non-Fatal), ... (Fatal)
  error_type TEXT,                                     -- Physical Layer, Data Link Layer, Transaction Layer, Inaccessible
  agent TEXT,                                          -- Receiver ID, Requester ID, Completer ID, Transmitter ID
  vendor_id INTEGER,                                   -- PCI vendor id of the device (status lines)
  device_id INTEGER,                                   -- PCI device id of the device (status lines)
  status INTEGER,                                      -- AER error status register (status lines)
  mask INTEGER,                                        -- AER error mask register (status lines)
  bit INTEGER,                                         -- status bit number (bit lines)
  bit_name TEXT,                                       -- status bit name (RxErr, BadTLP, BadDLLP, ...)
  first_error INTEGER                                  -- 1 if the First Error Pointer names this bit
);

-- table: gpu_xid
-- NVIDIA driver Xid errors: `NVRM: Xid (PCI:0000:10:1c[ GPU-I:01 GPU-CI:00]): 63, pid=..., name=...,
-- <message>` in every driver generation's form. meaning/category come from the recorder's Xid
-- table (48 double-bit ECC, 63/64 row remap / page retirement, 79 fallen off the bus, 94/95
-- contained/uncontained ECC, 13/31/43 application faults, ...); NULL for codes it does not know.
CREATE TABLE gpu_xid (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  kernel_log_id INTEGER NOT NULL UNIQUE REFERENCES kernel_log(id), -- the record this event was parsed from
  ts INTEGER NOT NULL,                                 -- ns CLOCK_MONOTONIC: when the kernel logged it
  kind TEXT NOT NULL,                                  -- xid
  device TEXT NOT NULL,                                -- GPU PCI domain:bus:device as NVRM prints it (0000:10:1c, no function)
  gpu_instance INTEGER,                                -- MIG GPU instance (GPU-I), NULL without MIG
  compute_instance INTEGER,                            -- MIG compute instance (GPU-CI), NULL without MIG
  xid INTEGER NOT NULL,                                -- Xid error code
  pid INTEGER,                                         -- process the driver blames, NULL if '<unknown>' or not printed
  process_name TEXT,                                   -- that process's name, NULL if unknown or not printed
  message TEXT NOT NULL,                               -- the rest of the line after the code (and pid/name)
  meaning TEXT,                                        -- what the code means, from the recorder's Xid table
  category TEXT                                        -- application, memory, bus, driver, hardware, interconnect
);

-- table: oom_kill
-- Out-of-memory handling, one row per line: `invoked oom-killer` (the allocating task and its
-- request), `oom-kill:constraint=...` (where the OOM was and which task was chosen), `Killed
-- process` (the victim and its memory), older `Kill process ... score ... or sacrifice child`, and
-- `oom_reaper: reaped process`. Lines of one OOM share pid and follow each other in seq.
CREATE TABLE oom_kill (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  kernel_log_id INTEGER NOT NULL UNIQUE REFERENCES kernel_log(id), -- the record this event was parsed from
  ts INTEGER NOT NULL,                                 -- ns CLOCK_MONOTONIC: when the kernel logged it
  kind TEXT NOT NULL,                                  -- invoked, constraint, killed, selected, reaped
  scope TEXT,                                          -- memcg (Memory cgroup out of memory) or system (Out of memory); NULL if not printed
  pid INTEGER,                                         -- victim process id (constraint, killed, selected, reaped)
  comm TEXT,                                           -- process name: the allocating task for invoked, the victim otherwise
  uid INTEGER,                                         -- victim's user id, when printed
  gfp_mask INTEGER,                                    -- GFP flags of the allocation that failed (invoked)
  gfp_flags TEXT,                                      -- the same flags by name (GFP_KERNEL), newer kernels
  alloc_order INTEGER,                                 -- log2 of the pages the failed allocation asked for (invoked)
  oom_score_adj INTEGER,                               -- oom_score_adj of the allocating task (invoked) or of the victim (killed)
  score INTEGER,                                       -- badness score of the victim (selected, older kernels)
  constraint_kind TEXT,                                -- CONSTRAINT_NONE, CONSTRAINT_MEMCG, CONSTRAINT_CPUSET, CONSTRAINT_MEMORY_POLICY
  nodemask TEXT,                                       -- allowed NUMA nodes of the allocation as printed ((null) = all)
  cpuset TEXT,                                         -- cpuset of the allocating task
  mems_allowed TEXT,                                   -- memory nodes the task may use (node list)
  oom_memcg TEXT,                                      -- memory cgroup that hit its limit (memcg OOM)
  task_memcg TEXT,                                     -- memory cgroup of the victim
  global_oom INTEGER,                                  -- 1 if the constraint line says global_oom (older kernels)
  total_vm_bytes INTEGER,                              -- victim's virtual memory size
  anon_rss_bytes INTEGER,                              -- victim's anonymous resident memory (after reaping for reaped)
  file_rss_bytes INTEGER,                              -- victim's file-backed resident memory
  shmem_rss_bytes INTEGER,                             -- victim's shared-memory resident memory
  pgtables_bytes INTEGER                               -- victim's page tables
);
