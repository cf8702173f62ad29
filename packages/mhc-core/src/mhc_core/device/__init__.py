"""Device code: what runs in (or describes) a kernel.

Shared by both protocols and the models' kernels, here: ``ptx`` (every inline-PTX instruction),
``protocol`` (the Lamport mailbox on the device: slots, publishing, polling and summing, re-arming),
``publish`` (the publish kernels: the one-shot's whole row, the two-shot's scatter), ``reduce``
(warp / block / cluster reductions), ``quant``, ``fastmath``, ``sinkhorn``, ``handoff`` (Lamport
rows to a side-stream kernel), and the kernel description every kernel class derives from
(``kernel.DeviceKernel``, ``signature``: its parameters and their compile-time fakes, ``bundle``,
``configs``: every core kernel's compile-time constants).

Each protocol's own kernels, in its folder: ``one_shot/`` (``collective``: poll every rank's row,
sum) and ``two_shot/`` (``reduce``: sum this rank's slice, gather it to every rank). Nothing here
imports the host layer (``mhc_core.host``).
"""
