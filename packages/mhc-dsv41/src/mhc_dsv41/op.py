"""``AllReduceMHC``: DSV4.1's TP all-reduce fused with mHC post-mix, carried-pre collapse and RMSNorm.

Two kernels per call on the current stream, PDL-chained: a publish (plain, or the
MoE finalize folded in) that lets the collective launch after its stores, and the
collective (``mhc_dsv41.kernel``). At tp = 1 a plain call is one launch: the collective
reads ``x`` itself (nothing to all-reduce; bitwise the mailbox path's outputs); ``finalize``
and the two-phase form keep the publish. Construction is collective over ``group``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from mhc_core.device.publish import TRIGGER_AFTER_STORES
from mhc_core.host.moe import MoEOutput
from mhc_core.host.op import LamportOp, Plan
from mhc_core.host.validation import check_int, check_positive_float, check_tensor
from mhc_core.presets import warn_if_untuned

from . import library  # noqa: F401  (registers the mhc::dsv41_* custom ops)
from .config import DSV41Preset, default_geometry
from .kernel import LamportMHCKernel, MHCConfig

Outputs = tuple[torch.Tensor, torch.Tensor]


class AllReduceMHC(LamportOp):
    """Lamport TP all-reduce fused with mHC post, collapse and RMSNorm.

    ``__call__`` reduces ``x`` across the TP group, writes the post-mixed hc streams
    and the normalized collapse, and leaves the next mixes to the caller.
    ``finalize`` does the same for an unfinalized MoE output, folding the top-k
    reduction and the shared-expert add into the publish. Each instance owns a
    Lamport mailbox of ``3 * tp * max_num_tokens * hidden_size * 2`` bytes.

    Args:
        hidden_size, hc_mult, max_num_tokens, top_k, device: as the reference.
        group: None (tp = 1), a torch process group, or a ``LoopbackGroup`` rank.
        transport: "auto" (unicast; tp = 1: local), "unicast" or "multicast"
            (opt-in; also ``MHC_TRANSPORT``).
        cluster_size, threads, rank_lanes: launch geometry; omitted values follow
            ``mhc_dsv41.config.default_geometry`` (the rule presets use too).
        spin_timeout_ms: device-side bound on every poll (off by default; also
            ``MHC_SPIN_TIMEOUT_MS``).
        check_routes: verify MoE route indices on the device (debug mode).
        norm_eps: the RMSNorm epsilon of every call that passes none (as ``AllReduceMhcBoundary``
            takes it; a preset's ``norm_eps`` with ``from_preset``). A call may still pass its own.
    """

    weight_dtypes = (torch.float32,)

    def __init__(
        self,
        *,
        hidden_size: int,
        hc_mult: int,
        max_num_tokens: int,
        top_k: int,
        device: torch.device | str | int,
        group: Any = None,
        transport: str | None = None,
        cluster_size: int | None = None,
        threads: int | None = None,
        rank_lanes: int | None = None,
        publish_threads: int = 128,
        spin_timeout_ms: float | None = None,
        check_routes: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        self.hc_mult = check_int("hc_mult", hc_mult, minimum=1, maximum=16)
        self.norm_eps = check_positive_float("norm_eps", norm_eps)
        check_int("top_k", top_k, minimum=1)
        super().__init__(
            hidden_size=hidden_size,
            max_num_tokens=max_num_tokens,
            device=device,
            group=group,
            transport=transport,
            top_k=top_k,
            publish_trigger=TRIGGER_AFTER_STORES,
            publish_threads=publish_threads,
            spin_timeout_ms=spin_timeout_ms,
            check_routes=check_routes,
        )
        geometry = default_geometry(hidden_size, hc_mult, self.tp)
        for key, value in (("cluster_size", cluster_size), ("threads", threads), ("rank_lanes", rank_lanes)):
            if value is not None:
                geometry[key] = check_int(key, value, minimum=1)
        self.config = MHCConfig(hidden=hidden_size, hc=hc_mult, tp=self.tp, **geometry)
        self._build_publishes()
        self._collective_kernel = self._compile(LamportMHCKernel(self.config))
        self._setup()

    @classmethod
    def from_config(
        cls,
        preset: DSV41Preset,
        *,
        max_num_tokens: int,
        device: torch.device | str | int,
        group: Any = None,
        **options: Any,
    ) -> AllReduceMHC:
        """An op with a preset's geometry; the group's size must be the preset's tp."""
        warn_if_untuned(preset)
        op = cls(
            hidden_size=preset.hidden,
            hc_mult=preset.hc,
            max_num_tokens=max_num_tokens,
            top_k=preset.top_k,
            device=device,
            group=group,
            cluster_size=preset.cluster_size,
            threads=preset.threads,
            rank_lanes=preset.rank_lanes,
            publish_threads=preset.publish_threads,
            **{"norm_eps": preset.norm_eps, **options},
        )
        if op.tp != preset.tp:
            raise ValueError(f"group: preset {preset.name!r} is for tp = {preset.tp}, the group has tp = {op.tp}")
        return op

    @classmethod
    def from_preset(
        cls, name: str, *, max_num_tokens: int, device: torch.device | str | int, group: Any = None, **options: Any
    ) -> AllReduceMHC:
        """An op built from a generated preset (``mhc_dsv41.presets.names()`` lists them)."""
        from .presets import get

        return cls.from_config(get(name).PRESET, max_num_tokens=max_num_tokens, device=device, group=group, **options)

    # ----------------------------------------------------------- collective
    def _bind_collectives(self) -> None:
        self._collective = self._bind(self._collective_kernel, self._collective_fixed())

    def _warmup_collects(self) -> list[Callable[[bool], Any]]:
        hc, hidden, device = self.hc_mult, self.hidden_size, self.device
        residual = torch.zeros(1, hc, hidden, dtype=torch.bfloat16, device=device)
        mixes = torch.zeros(1, hc, dtype=torch.float32, device=device)
        comb = torch.zeros(1, hc, hc, dtype=torch.float32, device=device)
        weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
        collect = self._prepare_collect(1, residual, mixes, comb, mixes, weight, 1e-6, None)
        return [collect]

    def _prepare_collect(self, m: int, *args: Any) -> Callable[[bool], Outputs]:
        """Validate every collective input for M tokens (``_check_collect``'s arguments); return the launch."""
        self._check_collect(m, *args)
        return self._collect_launch(m, *args)

    def _check_collect(
        self,
        m: int,
        residual: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        pre: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float,
        out: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Every check of the collective's inputs (and of ``out``) for M tokens."""
        hc, hidden, device = self.hc_mult, self.hidden_size, self.device
        check_tensor("residual", residual, shape=(m, hc, hidden), dtype=torch.bfloat16, device=device)
        check_tensor("post", post, shape=[(m, hc), (m, hc, 1)], dtype=torch.float32, device=device, align=4)
        check_tensor("comb", comb, shape=(m, hc, hc), dtype=torch.float32, device=device, align=4)
        check_tensor("pre", pre, shape=(m, hc), dtype=torch.float32, device=device, align=4)
        check_tensor("norm_weight", norm_weight, shape=(hidden,), dtype=torch.bfloat16, device=device)
        check_positive_float("norm_eps", norm_eps)
        if out is None:
            return
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out: expected a (residual_out, layer_input) pair of tensors")
        check_tensor("out[0] (residual_out)", out[0], shape=(m, hc, hidden), dtype=torch.bfloat16, device=device)
        check_tensor("out[1] (layer_input)", out[1], shape=(m, hidden), dtype=torch.bfloat16, device=device)

    def _collect_launch(
        self,
        m: int,
        residual: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        pre: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float,
        out: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        x: torch.Tensor | None = None,
    ) -> Callable[[bool], Outputs]:
        """The launch of checked collective inputs (with ``x``, checked too: the tp = 1 direct read)."""
        if out is None:
            # Like the checked inputs of the same shape and dtype (empty_like: half the host time of
            # torch.empty with a shape, dtype and device to parse).
            residual_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
            layer_input = torch.empty((m, self.hidden_size), dtype=torch.bfloat16, device=self.device)
        else:
            residual_out, layer_input = out
        collective, eps = self._collective.launch, float(norm_eps)

        def collect(after_publish: bool) -> Outputs:
            collective(
                residual=residual,
                post=post,
                comb=comb,
                pre=pre,
                gamma=norm_weight,
                residual_out=residual_out,
                layer_input=layer_input,
                eps=eps,
                # Reading x directly waits first: the kernel before is x's producer, not a publish.
                prefetch=int(after_publish and x is None),
                x=x if x is not None else residual,  # read only when direct
                direct=int(x is not None),
                m=m,
            )
            return residual_out, layer_input

        return collect

    # ------------------------------------------------------------ public API
    def _plan_call(
        self,
        x: torch.Tensor | MoEOutput,
        residual: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        pre: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float | None = None,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Plan:
        collect_args = (residual, post, comb, pre, norm_weight, self.norm_eps if norm_eps is None else norm_eps, out)
        self._checked(("call", x, *collect_args), lambda: self._check_collect(self._check_publish(x), *collect_args))
        return self._plan_checked(x, *collect_args)

    def _plan_finalize(
        self,
        gemm2_permuted: torch.Tensor,
        expert_weights: torch.Tensor,
        expanded_idx_to_permuted_idx: torch.Tensor,
        shared_output: torch.Tensor,
        *collect_args: Any,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Plan:
        moe = MoEOutput(gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output)
        if len(collect_args) not in (5, 6):
            raise TypeError(
                "finalize: expected residual, post, comb, pre, norm_weight (and optionally norm_eps) after the MoE "
                f"tensors, got {len(collect_args)} more arguments"
            )
        residual, post, comb, pre, norm_weight = collect_args[:5]
        norm_eps = collect_args[5] if len(collect_args) == 6 and collect_args[5] is not None else self.norm_eps
        args = (residual, post, comb, pre, norm_weight, norm_eps, out)
        values = (gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output, *args)
        self._checked(("finalize", *values), lambda: self._check_collect(self._check_publish(moe), *args))
        return self._plan_checked(moe, *args)

    def supports(self, tokens: int) -> bool:
        """Whether a call with ``tokens`` tokens fits this op (``1 <= tokens <= max_num_tokens``)."""
        return 1 <= tokens <= self.capacity

    def __call__(
        self,
        x: torch.Tensor | MoEOutput,
        residual: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        pre: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float | None = None,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (post-mixed residual streams ``[M, hc, hidden]``, normalized layer input ``[M, hidden]``).

        Args:
            x: [M, hidden] BF16 TP-partial sublayer output, or a ``MoEOutput`` whose routed top-k
                reduction is still open (as ``AllReduceMhcBoundary`` takes it; ``finalize`` is the
                same call with the MoE tensors as arguments).
            residual: [M, hc, hidden] BF16 residual streams.
            post: [M, hc] or [M, hc, 1] FP32 post-mix.
            comb: [M, hc, hc] FP32 residual mix, indexed [source, target].
            pre: [M, hc] FP32 carried pre-mix for the collapse.
            norm_weight: [hidden] BF16 RMSNorm weight.
            norm_eps: RMSNorm epsilon (finite, > 0); None: the op's ``norm_eps``.
            out: optional preallocated (residual_out, layer_input).
        """
        return cast(Outputs, self._call(self._plan_call, x, residual, post, comb, pre, norm_weight, norm_eps, out=out))

    def finalize(
        self,
        gemm2_permuted: torch.Tensor,
        expert_weights: torch.Tensor,
        expanded_idx_to_permuted_idx: torch.Tensor,
        shared_output: torch.Tensor,
        residual: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        pre: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float | None = None,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__`` for a MoE output left unfinalized (see ``mhc_core.MoEOutput``).

        ``expert_weights`` is ``[M, top_k]`` FP32, already scaled;
        ``expanded_idx_to_permuted_idx`` ``[M, top_k]`` int32, -1 for experts this
        rank does not hold; ``shared_output`` ``[M, hidden]`` BF16.
        """
        return cast(
            Outputs,
            self._call(
                self._plan_finalize,
                gemm2_permuted,
                expert_weights,
                expanded_idx_to_permuted_idx,
                shared_output,
                residual,
                post,
                comb,
                pre,
                norm_weight,
                norm_eps,
                out=out,
            ),
        )

    def collect(
        self,
        residual: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        pre: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float | None = None,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        after_publish: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Phase two, for the pending ``publish``. ``after_publish=True`` promises that the
        kernel right before on this stream is that publish (the collective then loads its
        inputs before the PDL wait)."""
        eps = self.norm_eps if norm_eps is None else norm_eps
        return cast(
            Outputs,
            self._collect_pending(
                lambda m: self._prepare_collect(m, residual, post, comb, pre, norm_weight, eps, out),
                after_publish,
            ),
        )

    def __repr__(self) -> str:
        c = self.config
        return (
            f"AllReduceMHC(hc={c.hc}, cluster_size={c.cluster_size}, threads={c.threads}, "
            f"rank_lanes={c.rank_lanes}, trips={c.trips}, {self._describe()})"
        )
