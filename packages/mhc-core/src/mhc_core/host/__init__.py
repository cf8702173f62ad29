"""Host code: what builds, launches and orders the kernels, in floors that import only downward.

- the ops, here: ``op`` (``LamportOp``: what every fused op shares), ``allreduce`` (the standalone
  op), ``lifetime`` (usability, poisoning, ``close``), ``library`` (the ``torch.ops.mhc`` custom
  ops) and ``boundary_ops`` (a model's boundary ops, generated from its declaration);
- ``calls/``: the call path (each call's rules, native programs, the call forms, eager and
  two-phase calls, warm-up, stream ordering, the spin bound and its errors);
- ``ranks/``: the ranks of a TP group and their memory (groups, mailbox allocation, CUDA IPC, the
  mailbox, the startup votes, the fallback signal);
- ``binaries/``: compiled code (the compiler, shipped and cached kernels, verified loading,
  launching, device support, the C++ executor ``native/``).

``calls`` and ``ranks`` import ``binaries`` and not each other; nothing below the ops imports them
(``tests/core/test_imports_cpu.py``). Host modules import device modules (the kernels they build),
never the other way round.
"""
