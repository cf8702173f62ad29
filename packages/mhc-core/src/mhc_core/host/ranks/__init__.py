"""The ranks of a TP group and their memory: what an op runs over, above ``binaries``.

``groups`` (tp = 1, a torch process group, loopback ranks), ``allocation`` and ``cuda_ipc`` (where
the mailboxes live: symmetric memory or CUDA IPC), ``mailbox`` (one rank's Lamport mailbox and its
layout), ``startup`` (the votes every rank agrees on before each collective step) and ``fallback``
(whether the fused ops can run on a group at all). Imports ``binaries``, never ``calls`` or the ops.
"""
