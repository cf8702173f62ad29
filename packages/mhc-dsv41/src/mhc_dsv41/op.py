"""``AllReduceMHC``: DSV4.1's TP all-reduce fused with mHC post-mix, carried-pre collapse and RMSNorm.

Two kernels per call on the current stream, PDL-chained: a publish (plain, or the
MoE finalize folded in) that lets the collective launch after its stores, and the
collective (``mhc_dsv41.kernel``). At tp = 1 a plain call is one launch: the collective
reads ``x`` itself (nothing to all-reduce; bitwise the mailbox path's outputs); ``finalize``
and the two-phase form keep the publish. Construction is collective over ``group``.

The layer input's format is an option (issue #33, ``mhc_core.host.calls.layer_input``):
``layer_input_format="bf16"`` (the default) returns ``(residual_out, layer_input)``; an FP8 format
(``"fp32-g128"``, ``"ue8m0-g128-packed"``, ``"mx-g32"``: ``mhc_core.fp8``) returns ``(residual_out,
q, scales)``, and with ``layer_input_bf16=True`` ``(residual_out, q, scales, layer_input)``, from
``__call__``, ``finalize`` and ``collect`` alike, and takes ``out=`` in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch

from mhc_core.device.configs import TRIGGER_AFTER_STORES
from mhc_core.host.binaries.compiler import KernelSpec
from mhc_core.host.calls.layer_input import LayerInput, preset_changes
from mhc_core.host.calls.moe import MoEOutput
from mhc_core.host.calls.programs import Fixed, Launch, Pointer, Scalar, Source, pointers
from mhc_core.host.calls.rules import IN_PLACE_LAYER_INPUT, M, Rule, ScalarRule, TensorRule, tensor
from mhc_core.host.calls.validation import INT32_MAX, check_int, check_positive_float
from mhc_core.host.op import MAX_NUM_TOKENS, LamportOp
from mhc_core.host.ranks.startup import collective
from mhc_core.presets import MAX_TOP_K, warn_if_untuned
from mhc_core.protocols import ONE_SHOT, TWO_SHOT

from . import library  # noqa: F401  (registers the mhc::dsv41_* custom ops)
from .config import (
    COLLECTIVE_KERNEL,
    PERSISTENT_MIN_TOKENS,
    CollectiveTarget,
    DSV41Preset,
    MHCConfig,
    collective_routing,
    custom_preset,
    gather_config,
    preset_with,
    resident_clusters,
)

#: The preset fields ``from_config`` takes as options (the rest are the preset's own).
PRESET_OPTIONS = ("norm_eps", "layer_input_format", "layer_input_bf16")

#: ``(residual_out, layer_input)``; with an FP8 layer input ``(residual_out, q, scales)`` or
#: ``(residual_out, q, scales, layer_input)`` (module docstring).
Outputs = tuple[torch.Tensor, ...]


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
        persistent_min_tokens: calls with at least this many tokens take the persistent
            collective (``mhc_dsv41.kernel``), fewer the one-token one; None:
            ``mhc_dsv41.config.PERSISTENT_MIN_TOKENS``.
        clusters: the most clusters the persistent collective launches (each loops over tokens).
            None: as many as the device holds at once (``mhc_dsv41.config.resident_clusters``).
        staged_tokens: tokens whose inputs the persistent collective has in flight at once
            (2..4; None: the config's default, what presets use).
        spin_timeout_ms: device-side bound on every poll, in ms (default 600 000, NCCL's default
            collective timeout; 0 turns it off; also ``MHC_SPIN_TIMEOUT_MS``).
        mailbox_allocation: how a process group's mailboxes are allocated: "auto" (default; also
            ``MHC_MAILBOX_ALLOCATION``), "symmetric" or "ipc" (``mhc_core.host.ranks.allocation``).
        check_routes: verify MoE route indices on the device (debug mode).
        norm_eps: the RMSNorm epsilon of every call that passes none (as ``AllReduceMhcBoundary``
            takes it; a preset's ``norm_eps`` with ``from_preset``). A call may still pass its own.
        layer_input_format: "bf16" (default), or an FP8 E4M3 format with per-group scales in the
            layout its GEMM reads: "fp32-g128", "ue8m0-g128-packed", "mx-g32" (``mhc_core.fp8``;
            hidden_size a multiple of its group). A call then returns ``(residual_out, q, scales)``.
        layer_input_bf16: with an FP8 format, the BF16 layer input too: ``(residual_out, q, scales,
            layer_input)``, all from one launch.
    """

    weight_dtypes = (torch.float32,)
    #: The layer input's format (``layer_input_format``, ``layer_input_bf16``); BF16 unless built with one.
    layer_input = LayerInput()
    _quantizes = False

    @collective
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
        persistent_min_tokens: int | None = None,
        clusters: int | None = None,
        staged_tokens: int | None = None,
        publish_threads: int = 128,
        spin_timeout_ms: float | None = None,
        check_routes: bool = False,
        mailbox_allocation: str | None = None,
        norm_eps: float = 1e-6,
        layer_input_format: str = "bf16",
        layer_input_bf16: bool = False,
        protocol: str | None = None,
        two_shot_min_tokens: int | None = None,
    ) -> None:
        check_int("hc_mult", hc_mult, minimum=1, maximum=16)
        norm_eps = check_positive_float("norm_eps", norm_eps)
        check_int("top_k", top_k, minimum=1, maximum=MAX_TOP_K)
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
            mailbox_allocation=mailbox_allocation,
            protocol=protocol,
            two_shot_min_tokens=two_shot_min_tokens,
        )
        geometry: dict[str, int] = {}
        for key, value in (("cluster_size", cluster_size), ("threads", threads), ("rank_lanes", rank_lanes)):
            if value is not None:
                geometry[key] = check_int(key, value, minimum=1)
        # The preset these arguments describe, then the one path every op takes (``from_config``'s too).
        preset = custom_preset(
            tp=self.tp, hidden=hidden_size, hc=hc_mult, top_k=top_k, norm_eps=norm_eps,
            publish_threads=publish_threads, layer_input_format=layer_input_format,
            layer_input_bf16=layer_input_bf16, **geometry,
        )  # fmt: skip
        self._build(preset, persistent_min_tokens=persistent_min_tokens, clusters=clusters, staged_tokens=staged_tokens)

    def _build(
        self, preset: DSV41Preset, *, persistent_min_tokens: int | None, clusters: int | None, staged_tokens: int | None
    ) -> None:
        """Build the op of ``preset`` (``LamportOp.__init__`` done): kernels, mailbox, warm-up."""
        if clusters is not None:
            check_int("clusters", clusters, minimum=1, maximum=INT32_MAX)  # an Int32 kernel parameter
        if persistent_min_tokens is not None:  # above MAX_NUM_TOKENS no call reaches it
            check_int("persistent_min_tokens", persistent_min_tokens, minimum=1, maximum=MAX_NUM_TOKENS)
        self.persistent_min_tokens = PERSISTENT_MIN_TOKENS if persistent_min_tokens is None else persistent_min_tokens
        #: Which collective serves M tokens: the call's launch gets its thresholds and its targets' kernels.
        self.routing = collective_routing(self.persistent_min_tokens)
        fields = preset.collective_config()
        if staged_tokens is not None:
            fields["staged_tokens"] = check_int("staged_tokens", staged_tokens, minimum=2, maximum=4)
        self.hc_mult = preset.hc
        self.norm_eps = preset.norm_eps
        self.layer_input = LayerInput(preset.layer_input_format, preset.layer_input_bf16)  # the preset checked it
        self._quantizes = self.layer_input.quantizes
        self.preset = preset
        self.config = MHCConfig(**fields)
        persistent = dataclasses.replace(self.config, persistent=True)
        self._build_publishes()  # every argument checked: from here on the device is touched
        if clusters is None:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            clusters = resident_clusters(persistent, sms)
        self.clusters = clusters
        configs = {CollectiveTarget(False): self.config, CollectiveTarget(True): persistent}
        self._collective_kernels = {
            target: self._compile(KernelSpec(COLLECTIVE_KERNEL, configs[target])) for target in self.routing.targets
        }
        #: The collectives that end a two-shot: compiled for tp = 1, polling the gather mailbox.
        self._gather_kernels = {}
        self.gather_clusters = clusters
        if self.protocols.two_shot_from is not None:
            gather = gather_config(self.config)
            gathers = {
                CollectiveTarget(False): gather,
                CollectiveTarget(True): dataclasses.replace(gather, persistent=True),
            }
            if self.routing.targets[-1].persistent:
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count
                self.gather_clusters = min(clusters, resident_clusters(gathers[CollectiveTarget(True)], sms))
            self._gather_kernels = {
                target: self._compile(KernelSpec(COLLECTIVE_KERNEL, gathers[target])) for target in self.routing.targets
            }
        self._setup()

    def _model_fingerprint(self) -> dict[str, Any]:
        geometry = dataclasses.asdict(self.config)
        return {"geometry": geometry, "persistent_min_tokens": self.persistent_min_tokens, "norm_eps": self.norm_eps}

    @classmethod
    @collective
    def from_config(
        cls,
        preset: DSV41Preset,
        *,
        max_num_tokens: int,
        device: torch.device | str | int,
        group: Any = None,
        persistent_min_tokens: int | None = None,
        clusters: int | None = None,
        staged_tokens: int | None = None,
        **options: Any,
    ) -> AllReduceMHC:
        """An op of a preset (a plain constructor builds a ``"custom"`` one and takes the same path).
        ``options``: the core's (``transport``, ``spin_timeout_ms``, ``check_routes``,
        ``mailbox_allocation``), ``persistent_min_tokens``, ``clusters``, ``staged_tokens``, and the
        preset fields an op may override: ``norm_eps`` and the layer input (``layer_input_format``
        given replaces both of the preset's fields). The group's size must be the preset's tp."""
        warn_if_untuned(preset)
        if "norm_eps" in options:
            options["norm_eps"] = check_positive_float("norm_eps", options["norm_eps"])  # named as the argument
        changes = preset_changes(preset, options, PRESET_OPTIONS)
        changed = preset_with(preset, **changes) if changes else preset  # checked before the device is touched
        op = cls.__new__(cls)
        op._init_from_preset(
            preset, publish_trigger=TRIGGER_AFTER_STORES, max_num_tokens=max_num_tokens, device=device, group=group,
            **options,
        )  # fmt: skip
        op._build(
            changed, persistent_min_tokens=persistent_min_tokens,
            clusters=clusters, staged_tokens=staged_tokens,
        )  # fmt: skip
        return op

    @classmethod
    @collective
    def from_preset(
        cls, name: str, *, max_num_tokens: int, device: torch.device | str | int, group: Any = None, **options: Any
    ) -> AllReduceMHC:
        """An op built from a generated preset (``mhc_dsv41.presets.names()`` lists them)."""
        from .presets import get

        return cls.from_config(get(name).PRESET, max_num_tokens=max_num_tokens, device=device, group=group, **options)

    # ----------------------------------------------------------- the call
    def _collect_rules(self) -> tuple[Rule, ...]:
        hc, hidden = self.hc_mult, self.hidden_size
        return (
            tensor("residual", (M, hc, hidden), dtype=torch.bfloat16),
            tensor("post", (M, hc), (M, hc, 1), dtype=torch.float32, align=4),
            tensor("comb", (M, hc, hc), dtype=torch.float32, align=4),
            tensor("pre", (M, hc), dtype=torch.float32, align=4),
            tensor("norm_weight", (hidden,), dtype=torch.bfloat16),
            ScalarRule("norm_eps"),
        )

    def _output_rules(self) -> tuple[TensorRule, ...]:
        return (
            # In place (vLLM's habit, out=(residual, x)): a thread reads a token's columns of every
            # residual stream (and of x) before it writes them, and no other cluster reads them.
            tensor(
                "out[0] (residual_out)",
                (M, self.hc_mult, self.hidden_size),
                dtype=torch.bfloat16,
                aliases=("residual",),
            ),
            *self.layer_input.output_rules(1, self.hidden_size, aliases=IN_PLACE_LAYER_INPUT),
        )

    def _collect_launches(self, *, direct: bool, prefetch: Source, protocol: str = ONE_SHOT) -> list[Launch]:
        two_shot = protocol == TWO_SHOT
        sources: dict[str, Source] = dict(
            self._collective_fixed(protocol),
            **pointers("residual", "post", "comb", "pre"),
            gamma=Pointer("norm_weight"),
            residual_out=Pointer("out[0] (residual_out)"),
            **self.layer_input.sources(1),  # layer_input, and FP8's layer_input_q and layer_input_scales
            eps=Scalar("norm_eps"),
            prefetch=prefetch,
            # Read only when direct (tp = 1): the collective then reads x instead of the mailbox.
            x=Pointer("x" if direct else "residual"),
            direct=Fixed(int(direct)),
            clusters=Fixed(self.gather_clusters if two_shot else self.clusters),
        )
        by_target = self._gather_kernels if two_shot else self._collective_kernels
        kernels = [by_target[target] for target in self.routing.targets]
        functions = [kernel.function for kernel in kernels]
        return [Launch(functions, kernels[0].signature, sources, min_tokens=self.routing.thresholds)]

    def _allocate(self, like: Any, values: tuple[Any, ...], m: int) -> tuple[torch.Tensor, ...]:
        if not self._quantizes:
            return torch.empty_like(values[0]), self._hidden_like(like, m)  # values[0]: the residual streams
        residual = values[0]
        tokens = like.shape[0] if like is not None else m  # a call's M is its publish input's
        return torch.empty_like(residual), *self.layer_input.allocate(like, residual, tokens, self.hidden_size)

    def _warmup_collects(self) -> list[tuple[tuple[Any, ...], int]]:
        hc, hidden, device = self.hc_mult, self.hidden_size, self.device
        residual = torch.zeros(1, hc, hidden, dtype=torch.bfloat16, device=device)
        mixes = torch.zeros(1, hc, dtype=torch.float32, device=device)
        comb = torch.zeros(1, hc, hc, dtype=torch.float32, device=device)
        weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
        values = (residual, mixes, comb, mixes, weight, 1e-6)
        return [(values, route) for route in range(len(self.routing))]  # each collective

    def _plan_values(self, method: str, *args: Any, **kwargs: Any) -> tuple[object, tuple[Any, ...], Any]:
        out = kwargs.pop("out", None)
        if method == "finalize":
            if len(args) not in (9, 10) or kwargs:
                raise TypeError(
                    "finalize: expected the four MoE tensors, then residual, post, comb, pre, norm_weight "
                    f"(and optionally norm_eps), got {len(args)} positional arguments"
                )
            x: object = MoEOutput(*args[:4])
            args = args[4:]
        else:
            x, args = args[0], args[1:]
        residual, post, comb, pre, norm_weight, *rest = args
        norm_eps = kwargs.pop("norm_eps", rest[0] if rest else None)
        return x, (residual, post, comb, pre, norm_weight, self.norm_eps if norm_eps is None else norm_eps), out

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
        out: Outputs | None = None,
    ) -> Outputs:
        """Return (post-mixed residual streams ``[M, hc, hidden]``, normalized layer input ``[M, hidden]``);
        with an FP8 ``layer_input_format`` ``(residual_out, q, scales)``, or ``(residual_out, q, scales,
        layer_input)`` with ``layer_input_bf16`` (the module docstring).

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
            out: optional preallocated outputs, as the call returns them: (residual_out, layer_input),
                or (residual_out, q, scales[, layer_input]) with an FP8 format (``q``
                ``float8_e4m3fn [M, hidden]``, ``scales`` as ``mhc_core.fp8.Fp8Format.empty_scales(M,
                hidden)`` makes them: its shape, strides and whole allocation).
        """
        eps = self.norm_eps if norm_eps is None else norm_eps
        outputs: Outputs = self._call(x, (residual, post, comb, pre, norm_weight, eps), out)
        return outputs  # annotated, not cast(): no function call on the hot path

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
        out: Outputs | None = None,
    ) -> Outputs:
        """``__call__`` for a MoE output left unfinalized (see ``mhc_core.MoEOutput``).

        ``expert_weights`` is ``[M, top_k]`` FP32, already scaled;
        ``expanded_idx_to_permuted_idx`` ``[M, top_k]`` int32, -1 for experts this
        rank does not hold; ``shared_output`` ``[M, hidden]`` BF16.
        """
        eps = self.norm_eps if norm_eps is None else norm_eps
        fields = (shared_output, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx)  # MOE_FIELDS order
        outputs: Outputs = self._call_moe(fields, (residual, post, comb, pre, norm_weight, eps), out)
        return outputs

    def collect(
        self,
        residual: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        pre: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float | None = None,
        *,
        out: Outputs | None = None,
        after_publish: bool = False,
    ) -> Outputs:
        """Phase two, for the pending ``publish``. ``after_publish=True`` promises that the
        kernel right before on this stream is that publish (the collective then loads its
        inputs before the PDL wait)."""
        eps = self.norm_eps if norm_eps is None else norm_eps
        return cast(Outputs, self._collect_pending((residual, post, comb, pre, norm_weight, eps), out, after_publish))

    def _layer_input_repr(self) -> str:
        if not self._quantizes:
            return ""
        return f"layer_input_format={self.layer_input.format!r}, layer_input_bf16={self.layer_input.keep_bf16}, "

    def __repr__(self) -> str:
        c = self.config
        return (
            f"AllReduceMHC(hc={c.hc}, cluster_size={c.cluster_size}, threads={c.threads}, "
            f"rank_lanes={c.rank_lanes}, trips={c.trips}, {self._layer_input_repr()}{self._describe()})"
        )
