"""Ready flags between a main-stream kernel and a side-stream kernel that runs alongside it.

The side kernel is launched before its producer finishes (it waits only for what
came before the producer on the main stream), so it starts the moment the data
is there instead of one kernel launch after the producer ends. Protocol, one
int32 flag per item, 0 when idle:

- producer: write the item, then ``signal`` (release store of 1) from the same thread;
- consumer: ``wait`` (acquire loads until 1; bounded like every poll), read the item,
  then ``clear`` the flag for the next round. The next producer may only start after
  the consumer finished (the op joins the side stream first), so no round sees an
  old 1.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Boolean, Int32, Int64, Uint32

from . import protocol, ptx
from .constants import ERROR_CODE, ERROR_READY_TIMEOUT, ERROR_TOKEN


@cute.jit
def signal(flags: Int64, index: Int32) -> None:
    """Release ``flags[index] = 1`` after this thread's writes."""
    ptx.store_release_u32(flags + Int64(index) * 4, Uint32(1))


@cute.jit
def clear(flags: Int64, index: Int32) -> None:
    ptx.store_u32(flags + Int64(index) * 4, Uint32(0))


@cute.jit
def wait(flags: Int64, index: Int32, spin_limit_ns: Int64, error_flag: Int64) -> Boolean:
    """Spin until ``flags[index]`` is set; False if ``spin_limit_ns`` (> 0) passed first (reported
    in the host-mapped ``error_flag`` as ``ERROR_READY_TIMEOUT`` for ``index``)."""
    address = flags + Int64(index) * 4
    waiting = Boolean(True)
    ready = Boolean(True)
    started = Int64(0)
    while waiting:
        waiting = ptx.load_acquire_u32(address) == Uint32(0)
        if waiting & (spin_limit_ns > Int64(0)):
            started, expired = protocol.spin_clock(started, spin_limit_ns)
            if expired:
                ptx.store_system_u32(error_flag + Int64(ERROR_TOKEN * 4), Uint32(index))
                ptx.store_system_u32(error_flag + Int64(ERROR_CODE * 4), Uint32(ERROR_READY_TIMEOUT))
                ready = Boolean(False)
                waiting = Boolean(False)
    return ready
