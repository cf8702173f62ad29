"""``--suite two-shot`` (issue #47): both protocols of every model's fused op in loopback tp 4 and 8.

Every rank runs on this one GPU (``run_ranks``), so a figure is the time of all tp ranks' kernels,
and the protocols' ratio is the ratio of the traffic they cause in one GPU's memory; each figure
carries the modelled bytes (``mhc_core.protocols.mailbox_traffic_bytes``, all ranks) and what a
rank would receive over NVLink. The table gives each protocol's time, the two-shot / one-shot ratio,
the crossover this run measures and the cost model's for real GPUs (``mhc_core.protocols.NVLINK_H200``).
"""

from __future__ import annotations

from mhc_core.bench.case import cases
from mhc_core.bench.records import Context, Record, bf16
from mhc_core.protocols import NVLINK_H200, ONE_SHOT, TWO_SHOT, link_bytes, mailbox_traffic_bytes

DEFAULT_M = (1, 8, 16, 32, 64, 128, 256, 512, 1024)
TPS = (4, 8)


def two_shot_suite(ctx: Context, ms: list[int]) -> list[Record]:
    from mhc_core import LoopbackGroup, run_ranks

    if ctx.group is not None:
        raise ValueError("--suite two-shot runs loopback ranks in one process: run it without torchrun")
    records = []
    capacity = max(ms)
    for tp in TPS:
        for case in cases():
            for protocol in (ONE_SHOT, TWO_SHOT):
                group = LoopbackGroup(tp, "cuda")
                ops = [case.build(case.preset(tp), capacity, "cuda", rank, protocol=protocol) for rank in group]
                for m in ms:
                    args = [(bf16(m, case.hidden), *case.inputs(m, case.hidden)) for _ in ops]

                    def step(case=case, ops=ops, args=args):
                        results = run_ranks(ops, "call", args)
                        for op in ops:
                            case.join(op)
                        return results

                    traffic = tp * mailbox_traffic_bytes(protocol, tp, case.hidden, m)
                    note = (
                        f"mailbox bytes (all ranks) {traffic}; per rank over NVLink "
                        f"{link_bytes(protocol, tp, case.hidden, m):.0f}; cost-model crossover (real tp {tp}) "
                        f"{NVLINK_H200.crossover(tp, case.hidden)}"
                    )
                    floor = tp * case.bytes(m, case.hidden) / ctx.bandwidth
                    records.append(
                        Record(
                            "two-shot",
                            tp,
                            m,
                            f"{case.key} {protocol}",
                            ctx.time(step),
                            floor,
                            mailbox_floor_us=floor + traffic / ctx.bandwidth,
                            note=note,
                        )
                    )
                for op in ops:
                    op.close()
    return records
