"""Device code: what runs in (or describes) a kernel.

``ptx`` (every inline-PTX instruction), ``protocol`` (the Lamport mailbox on the device),
``reduce`` (warp / block / cluster reductions), ``fastmath``, ``sinkhorn``, ``handoff`` (Lamport
rows to a side-stream kernel), the publish and collective kernels, and the kernel description
every kernel class derives from (``kernel.DeviceKernel``, ``signature``: its parameters and
their compile-time fakes). Nothing here imports the host layer (``mhc_core.host``).
"""
