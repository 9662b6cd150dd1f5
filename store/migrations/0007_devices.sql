-- Schema v7: the devices behind the events, so that rows naming a disk (block requests), a
-- controller (NVMe kernel log lines) and a PCI function (DMA, IOMMU, AER, Xid) can be joined; and
-- GPU utilisation sampled through NVML. ts are ns of CLOCK_MONOTONIC.

-- table: block_device
-- Block devices of the session with the controller and PCI function behind each, read from sysfs
-- (recorder/layers/io/devices.py) when the session starts and when a request names a device not seen yet. One
-- row per device and session; loop, zram and device-mapper disks have no controller, PCI function,
-- driver or model.
CREATE TABLE block_device (
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  name TEXT NOT NULL,                                  -- kernel name: nvme0n1, nvme0n1p2, sda, loop0
  dev_major INTEGER NOT NULL,                          -- major number
  dev_minor INTEGER NOT NULL,                          -- minor number
  disk TEXT NOT NULL,                                  -- whole disk of a partition (nvme0n1 for nvme0n1p2), else the name
  controller TEXT,                                     -- NVMe controller (nvme0 for nvme0n1; nvme1 for the multipath path nvme0c1n1), NULL for other devices and for a multipath namespace reached through several controllers
  pci_address TEXT,                                    -- PCI function the disk hangs off (0000:01:00.0), NULL if none
  driver TEXT,                                         -- first driver bound to the device behind the disk or above it, SCSI upper-level drivers (sd) skipped: nvme, ahci, virtio_blk; NULL if none
  model TEXT,                                          -- model string where sysfs has one
  PRIMARY KEY (session_id, dev_major, dev_minor)
);

-- table: gpu_sample
-- NVML samples of every GPU while recording, every 100 ms by default (STALL_RECORDER_GPU_INTERVAL_MS),
-- taken by a thread of the recorder (recorder/layers/gpu.py). None when there is no GPU or no NVML: the
-- capability row of layer 'gpu', probe 'nvml' says why. A metric a GPU does not support is NULL and
-- has its own capability row (probe 'power', 'temperature', ...); samples a GPU did not answer are
-- counted in loss (probe 'nvml_sample').
CREATE TABLE gpu_sample (
  id INTEGER PRIMARY KEY,                              -- row id
  session_id INTEGER NOT NULL REFERENCES session(id), -- recording session
  ts INTEGER NOT NULL,                                 -- ns: when the sample was read
  gpu_index INTEGER NOT NULL,                          -- NVML device index
  pci_address TEXT,                                    -- PCI bus id in lower case (0000:10:1c.0)
  name TEXT,                                           -- product name
  util_gpu INTEGER,                                    -- % of NVML's last sample period (1/6 s to 1 s by product) a kernel was running
  util_mem INTEGER,                                    -- % of the last sample period device memory was read or written
  mem_used_bytes INTEGER,                              -- device memory in use
  mem_total_bytes INTEGER,                             -- device memory in all
  sm_clock_mhz INTEGER,                                -- SM clock
  power_mw INTEGER,                                    -- board power draw, milliwatts
  temperature_c INTEGER                                -- GPU temperature, degrees Celsius
);
CREATE INDEX gpu_sample_session_ts ON gpu_sample(session_id, ts);
