"""Host code: what builds, launches and orders the kernels.

``op`` (``LamportOp``: what every fused op shares), ``allreduce`` (the standalone op), ``groups``
(tp = 1, process groups, loopback ranks), ``mailbox``, ``compiler`` (compiling, the cache, ptxas
reports), ``launch`` (binding a compiled kernel's arguments and launching it), ``spin`` (the
bound, the error report, the exceptions), ``streams`` (ordering across streams and captures),
``validation``, ``moe`` (``MoEOutput``) and ``library`` (the ``torch.ops.mhc`` custom ops). Host
modules import device modules (the kernels they build), never the other way round.
"""
