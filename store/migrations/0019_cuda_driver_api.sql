-- Schema v19: one row per CUDA call through the runtime and the driver. The runtime calls the
-- driver's exported API (cudaLaunchKernel calls cuLaunchKernel, cudaMalloc cuMemAlloc_v2, ...);
-- such a driver call is no row of its own but the detail of the runtime call's row. Driver calls
-- made directly (cuBLAS, cuDNN, Triton launch through cuLaunchKernelEx) are rows of their own.

ALTER TABLE cuda_call ADD COLUMN driver_api_id INTEGER; -- cuda_api.id of the driver API this runtime call went through (the first its probes saw inside it); NULL: none seen, or a driver call
