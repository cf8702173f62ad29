"""``AllReduceMhcBoundary``: GLM-5.3-Flash's TP all-reduce fused with the whole mHC boundary.

Per call: a publish and the boundary on the current stream, PDL-chained (the
publish lets the boundary launch right after its wait, before its stores: the
boundary reads the mailbox only after its own wait), and the mixes kernel on a
side stream. The side stream forks before the boundary, so the mixes kernel runs
alongside it: each of its threads polls its token's row of a hand-off buffer, where
the boundary writes the raw mixes (``mhc_core.device.handoff``: empty slots hold -0, so no
flag and no fence). ``post_out`` / ``comb_out`` are complete only after ``join()``;
the next call joins first. The hand-off rows and the raw mixes live in buffers the
op owns, so they outlive it.

At tp = 1 there is nothing to all-reduce: a call with a plain tensor launches no publish,
and the boundary reads ``x`` itself after its PDL wait (bit-identical outputs). MoE input
(the finalize publish computes x) and the two-phase ``publish`` / ``collect`` form, whose
caller may reuse x's memory in between, still go through the mailbox.

CUDA graphs: capture in any order (right after construction, after an eager call that was
never joined, between replays; torch's side-stream warm-up recipe too), and call ``join()``
before the capture ends, so the side stream rejoins the captured one. The side kernel's
tensors (``post_out``, ``comb_out``, ``scale``, ``base``) stay alive until it is joined, also
when the caller drops them first (``mhc_core.host.calls.streams.SideWork``); the op's own hand-off rows
and raw mixes outlive the op until its side work has finished.

The layer input's format is an option (issue #33, ``mhc_core.host.calls.layer_input``):
``layer_input_format="bf16"`` (the default) returns ``(residual_out, post_out, comb_out,
layer_input)``; an FP8 format (``"fp32-g128"``, ``"ue8m0-g128-packed"``, ``"mx-g32"``: ``mhc_core.fp8``)
returns ``(residual_out, post_out, comb_out, q, scales)``, and with ``layer_input_bf16=True``
``(residual_out, post_out, comb_out, q, scales, layer_input)``, from ``__call__`` (plain and MoE
input) and ``collect`` alike, and takes ``out=`` in the same order. The boundary kernels quantise it
in registers (``mhc_glm5.fp8_store``). The side stream's mixes kernel reads only the raw mixes the
boundary hands off, never the layer input, so an FP8-only op needs no BF16 copy for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from mhc_core.device.configs import TRIGGER_AFTER_WAIT
from mhc_core.host.binaries.compiler import CompiledKernel, KernelSpec
from mhc_core.host.calls.layer_input import LayerInput, preset_changes
from mhc_core.host.calls.moe import MoEOutput
from mhc_core.host.calls.programs import DIM_M, Fixed, Launch, Pointer, Source, pointers
from mhc_core.host.calls.rules import IN_PLACE_LAYER_INPUT, M, Rule, TensorRule, tensor
from mhc_core.host.calls.streams import SideWork
from mhc_core.host.calls.validation import INT32_MAX, check_int
from mhc_core.host.op import MAX_NUM_TOKENS, LamportOp
from mhc_core.host.ranks.startup import collective
from mhc_core.presets import MAX_TOP_K, warn_if_untuned
from mhc_core.protocols import ONE_SHOT, TWO_SHOT

from . import library  # noqa: F401  (registers the mhc::glm5_* custom ops)
from .config import (
    HC,
    MIX,
    BoundaryTarget,
    GLM5Preset,
    custom_preset,
    persistent_clusters,
    preset_with,
)

#: ``(residual_out, post_out, comb_out, layer_input)``; with an FP8 layer input ``(residual_out,
#: post_out, comb_out, q, scales)`` or ``(..., q, scales, layer_input)`` (module docstring).
Outputs = tuple[torch.Tensor, ...]
#: The outputs before the layer input's (``mhc_core.host.calls.layer_input.LayerInput.output_rules`` from
#: ``out[3]`` on).
OUTPUT_NAMES = ("out[0] (residual_out)", "out[1] (post_out)", "out[2] (comb_out)")
OUTPUT_DTYPES = (torch.bfloat16, torch.float32, torch.float32)
#: What each output may be, in place: the boundary reads a token's residual streams and x before it
#: writes them (and no other cluster reads them). post_out and comb_out are written by the mixes
#: kernel on the side stream while the boundary may still read post and comb: never in place. The
#: BF16 layer input may be x (``IN_PLACE_LAYER_INPUT``); q and the scales are memory of their own.
OUTPUT_ALIASES = (("residual",), (), ())
#: Index of the layer input's first output.
LAYER_INPUT_OUTPUT = len(OUTPUT_NAMES)


#: The preset fields ``from_config`` takes as options (the rest are the preset's own).
PRESET_OPTIONS = ("persistent_min_tokens", "layer_input_format", "layer_input_bf16")


def _check_thresholds(preset: GLM5Preset) -> None:
    """Every token-count threshold (the native program compares M with them as int64) is one a call
    can reach: at most ``MAX_NUM_TOKENS``."""
    thresholds = [("cluster_tokens", threshold) for threshold, _ in preset.cluster_tokens]
    for name, value in [*thresholds, ("persistent_min_tokens", preset.persistent_min_tokens)]:
        if value > MAX_NUM_TOKENS:
            raise ValueError(f"{name}: expected a threshold <= {MAX_NUM_TOKENS} (a call's most tokens), got {value}")


class AllReduceMhcBoundary(LamportOp):
    """``tensor_model_parallel_all_reduce`` + ``hc_fused_post_pre`` for up to ``max_num_tokens`` tokens.

    Two kernels on the current stream (one at tp = 1) and one on a side stream; construction is
    collective over ``group`` (None: tp = 1; a process group; a ``LoopbackGroup``
    rank). One instance serves every boundary of the model, called one after
    another.

    Args:
        hidden_size, max_num_tokens, rms_eps, hc_eps, post_mult, sinkhorn_repeat,
            norm_eps, device, top_k, cluster_size: as the reference.
        cluster_tokens: ``[(min_tokens, tokens_per_cluster), ...]`` thresholds
            (M >= threshold -> tokens per cluster; 1 below the first); the
            reference's exact ``{M: tokens}`` mapping is accepted and converted.
        persistent_min_tokens: calls with at least this many tokens take the persistent
            boundary (``mhc_glm5.persistent``: clusters looping over groups of 8 tokens);
            0 or None: never (presets set their measured value).
        clusters: the most clusters the persistent boundary launches. None: as many as the
            device holds at once (``mhc_glm5.config.persistent_clusters``).
        group, transport, spin_timeout_ms, check_routes, mailbox_allocation: as ``mhc_core.LamportOp``
            (``mhc_dsv41.AllReduceMHC`` documents them).
        layer_input_format: "bf16" (default), or an FP8 E4M3 format with per-group scales in the
            layout its GEMM reads: "fp32-g128", "ue8m0-g128-packed", "mx-g32" (``mhc_core.fp8``;
            hidden_size a multiple of its group, and of the group times cluster_size: no group
            straddles a cluster's CTAs). A call then returns ``(residual_out, post_out, comb_out, q,
            scales)``.
        layer_input_bf16: with an FP8 format, the BF16 layer input too: ``(residual_out, post_out,
            comb_out, q, scales, layer_input)``, all from one launch.
    """

    #: The layer input's format (``layer_input_format``, ``layer_input_bf16``); BF16 unless built with one.
    layer_input = LayerInput()
    #: The op's own device buffers (the hand-off rows, the raw mixes, the boundaries' arrival counter):
    #: ``close()`` drops them and keeps them for a captured graph's replays (``mhc_core.host.lifetime``).
    model_device_state = ("_mixes_handoff", "_raw_mixes", "_arrivals")
    #: The mixes kernel's side stream and what it holds until joined (``mhc_core.host.calls.streams.SideWork``).
    _side_work: SideWork

    @collective
    def __init__(
        self,
        *,
        hidden_size: int,
        max_num_tokens: int,
        rms_eps: float,
        hc_eps: float,
        post_mult: float,
        sinkhorn_repeat: int,
        norm_eps: float,
        device: torch.device | str | int,
        top_k: int,
        cluster_size: int = 8,
        cluster_tokens: Sequence[Sequence[int]] | Mapping[int, int] | None = None,
        group: Any = None,
        transport: str | None = None,
        publish_threads: int = 128,
        mixes_threads: int = 128,
        persistent_min_tokens: int | None = None,
        clusters: int | None = None,
        spin_timeout_ms: float | None = None,
        check_routes: bool = False,
        mailbox_allocation: str | None = None,
        layer_input_format: str = "bf16",
        layer_input_bf16: bool = False,
        protocol: str | None = None,
        two_shot_min_tokens: int | None = None,
    ) -> None:
        check_int("top_k", top_k, minimum=1, maximum=MAX_TOP_K)
        super().__init__(
            hidden_size=hidden_size,
            max_num_tokens=max_num_tokens,
            device=device,
            group=group,
            transport=transport,
            top_k=top_k,
            publish_trigger=TRIGGER_AFTER_WAIT,
            publish_threads=publish_threads,
            spin_timeout_ms=spin_timeout_ms,
            check_routes=check_routes,
            mailbox_allocation=mailbox_allocation,
            protocol=protocol,
            two_shot_min_tokens=two_shot_min_tokens,
        )
        # Every hidden / cluster rule the presets obey, checked the same way, before anything is
        # built, named by argument; then the one path every op takes (``from_config``'s too).
        preset = custom_preset(
            tp=self.tp, hidden=hidden_size, top_k=top_k, cluster_size=cluster_size, cluster_tokens=cluster_tokens,
            rms_eps=rms_eps, hc_eps=hc_eps, post_mult=post_mult, sinkhorn_repeat=sinkhorn_repeat, norm_eps=norm_eps,
            publish_threads=publish_threads, mixes_threads=mixes_threads, persistent_min_tokens=persistent_min_tokens,
            layer_input_format=layer_input_format, layer_input_bf16=layer_input_bf16,
        )  # fmt: skip
        self._build(preset, clusters)

    def _build(self, preset: GLM5Preset, clusters: int | None) -> None:
        """Build the op of ``preset`` (``LamportOp.__init__`` done): kernels, buffers, mailbox, warm-up."""
        if clusters is not None:
            check_int("clusters", clusters, minimum=1, maximum=INT32_MAX)  # an Int32 kernel parameter
        self.layer_input = LayerInput(preset.layer_input_format, preset.layer_input_bf16)  # the preset checked it
        _check_thresholds(preset)
        self.preset = preset  # what the startup's config vote compares (``_model_fingerprint``)
        self._build_publishes()
        self.preset = dataclasses.replace(preset, archs=(self.arch,))
        self.cluster_tokens = self.preset.cluster_tokens
        self.persistent_min_tokens = self.preset.persistent_min_tokens
        #: Which boundary serves M tokens (``mhc_glm5.config.boundary_routing``): the call's launch
        #: gets its thresholds and its targets' kernels, in order.
        self.routing = self.preset.routing
        if clusters is None:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            clusters = persistent_clusters(sms, self.preset.cluster_size)
        self.clusters = clusters
        # The kernels the preset lists (what `nox -s build` compiles): each boundary variant's, once.
        specs = self.preset.kernel_specs(self.arch)
        self._boundary_kernels: dict[BoundaryTarget, CompiledKernel] = {
            target: self._compile(KernelSpec(*specs[target.kernel_name])) for target in self.routing.targets
        }
        #: The boundaries that end a two-shot (``mhc_core.device.two_shot``): the same kernels compiled
        #: for tp = 1, polling the gather mailbox's one reduced row.
        self._gather_kernels: dict[BoundaryTarget, CompiledKernel] = {}
        if self.protocols.two_shot_from is not None:
            for target in self.routing.targets:
                path, config = specs[target.kernel_name]
                self._gather_kernels[target] = self._compile(KernelSpec(path, {**config, "tp": 1}))
        self._mixes_kernel = self._compile(KernelSpec(*specs["mixes"]))
        # Per token: the boundary writes the raw mixes, the mixes kernel polls, copies and re-arms them.
        self._mixes_handoff = torch.full((self.capacity, MIX), -0.0, dtype=torch.float32, device=self.device)
        self._raw_mixes = torch.empty(self.capacity, MIX, dtype=torch.float32, device=self.device)
        # The boundaries' clusters count in here; the last one moves the stage on (it polls before
        # its PDL wait: ``mhc_core.device.protocol.advance_stage_after_all``).
        self._arrivals = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._side_work = SideWork(self.device)
        self._side_work.own(self._mixes_handoff, self._raw_mixes)
        self._order.own(self._mixes_handoff, self._raw_mixes, self._arrivals)
        self._setup()

    def _model_fingerprint(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self.preset)
        # What names or describes the preset is not the op's: a plain constructor's "custom" preset and
        # a generated one of the same values vote alike.
        named = ("name", "archs", "tuned", "description")
        return {"preset": {key: value for key, value in fields.items() if key not in named}}

    @classmethod
    @collective
    def from_config(
        cls,
        preset: GLM5Preset,
        *,
        max_num_tokens: int,
        device: torch.device | str | int,
        group: Any = None,
        clusters: int | None = None,
        **options: Any,
    ) -> AllReduceMhcBoundary:
        """An op of a preset (a plain constructor builds a ``"custom"`` one and takes the same path).
        ``options``: the core's (``transport``, ``spin_timeout_ms``, ``check_routes``,
        ``mailbox_allocation``), ``clusters``, and the preset fields an op may override:
        ``persistent_min_tokens`` and the layer input (``layer_input_format`` given replaces both of
        the preset's fields). The group's size must be the preset's tp."""
        warn_if_untuned(preset)
        changes = preset_changes(preset, options, PRESET_OPTIONS)
        if changes.get("persistent_min_tokens", 0) is None:
            changes["persistent_min_tokens"] = 0
        changed = preset_with(preset, **changes) if changes else preset  # checked before the device is touched
        op = cls.__new__(cls)
        op._init_from_preset(
            preset, publish_trigger=TRIGGER_AFTER_WAIT, max_num_tokens=max_num_tokens, device=device, group=group,
            **options,
        )  # fmt: skip
        op._build(changed, clusters)
        return op

    @classmethod
    @collective
    def from_preset(
        cls, name: str, *, max_num_tokens: int, device: torch.device | str | int, group: Any = None, **options: Any
    ) -> AllReduceMhcBoundary:
        """An op built from a generated preset (``mhc_glm5.presets.names()`` lists them)."""
        from .presets import get

        return cls.from_config(get(name).PRESET, max_num_tokens=max_num_tokens, device=device, group=group, **options)

    # ------------------------------------------------------------ side stream
    def supports(self, tokens: int) -> bool:
        """Whether a call with ``tokens`` tokens fits this op (``1 <= tokens <= max_num_tokens``)."""
        return 1 <= tokens <= self.capacity

    def join(self) -> None:
        """Make the current stream wait for the last mixes kernel (post_out / comb_out complete).
        Inside a CUDA-graph capture, call it before the capture ends. Holds the op's lock, like a
        call; it also works on an op that poisoned itself (its side work may still run)."""
        with self._lock:  # `with`: see ``mhc_core.host.calls.eager._call``
            if self._side_work is None:  # closed: close() synchronised the device already
                return
            # Even when this op's side work was joined: from another stream than the call's, it
            # has not been waited for there (``SideWork``).
            stream, capture = self._order.current()
            self._side_work.join(stream, capture)

    @property
    def side_stream(self) -> torch.cuda.Stream:
        """The stream the mixes kernel runs on (``join()`` rejoins it)."""
        return self._side_work.stream

    @property
    def raw_mixes(self) -> torch.Tensor:
        """``[max_num_tokens, 24]`` FP32: rows ``[:M]`` hold the last call's raw mixes (after ``join()``;
        a raw mix of -0 reads +0, which gives the same mixes)."""
        return self._raw_mixes

    def tokens_per_cluster(self, m: int) -> int:
        """Tokens per cluster (per group, for the persistent boundary) of the kernel ``__call__``
        picks for M tokens."""
        return self.routing.select(m).tokens

    def persistent(self, m: int) -> bool:
        """Whether a call with M tokens takes the persistent boundary (``persistent_min_tokens``)."""
        return self.routing.select(m).persistent

    def _side_tensors(self, values: Sequence[object], outputs: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        # post_out, comb_out, scale, base: what the mixes kernel uses.
        return outputs[1], outputs[2], values[-3], values[-2]

    # ----------------------------------------------------------- the call
    def _collect_rules(self) -> tuple[Rule, ...]:
        hidden = self.hidden_size
        return (
            tensor("residual", (M, HC, hidden), dtype=torch.bfloat16),
            tensor("post", (M, HC, 1), (M, HC), dtype=torch.float32, align=4),
            tensor("comb", (M, HC, HC), dtype=torch.float32, align=4),
            tensor("fn", (MIX, HC * hidden), dtype=torch.bfloat16),
            tensor("scale", (3,), dtype=torch.float32, align=4),
            tensor("base", (MIX,), dtype=torch.float32, align=4),
            tensor("norm_weight", (hidden,), dtype=torch.bfloat16),
        )

    def _output_rules(self) -> tuple[TensorRule, ...]:
        shapes = ((M, HC, self.hidden_size), (M, HC, 1), (M, HC, HC))
        return (
            *(
                tensor(name, shape, dtype=dtype, aliases=aliases)
                for name, shape, dtype, aliases in zip(OUTPUT_NAMES, shapes, OUTPUT_DTYPES, OUTPUT_ALIASES, strict=True)
            ),
            *self.layer_input.output_rules(LAYER_INPUT_OUTPUT, self.hidden_size, aliases=IN_PLACE_LAYER_INPUT),
        )

    def boundary_kernel(self, m: int) -> CompiledKernel:
        """The boundary kernel a call of M tokens launches (the native program picks the same)."""
        return self._boundary_kernels[self.routing.select(m)]

    def _collect_launches(self, *, direct: bool, prefetch: Source, protocol: str = ONE_SHOT) -> list[Launch]:
        residual_out, post_out, comb_out = (Pointer(name) for name in OUTPUT_NAMES)
        boundary: dict[str, Source] = dict(
            self._collective_fixed(protocol),
            **pointers("residual", "post", "comb", "fn", "scale", "base"),
            gamma=Pointer("norm_weight"),
            residual_out=residual_out,
            # layer_input, and FP8's layer_input_q and layer_input_scales
            **self.layer_input.sources(LAYER_INPUT_OUTPUT),
            mixes_out=Fixed(self._mixes_handoff),
            arrivals=Fixed(self._arrivals),
            # Read only when direct (tp = 1): the boundary then reads x instead of the mailbox.
            x=Pointer("x" if direct else "residual"),
            prefetch=prefetch,
            direct=Fixed(int(direct)),
            clusters=Fixed(self.clusters),
        )
        by_target = self._gather_kernels if protocol == TWO_SHOT else self._boundary_kernels
        kernels = [by_target[target] for target in self.routing.targets]
        assert self.mailbox is not None
        mixes: dict[str, Source] = dict(
            # The hand-off wait outlasts the boundary's own (``SpinGuard.handoff_limit_ns``); a timeout
            # there poisons the op through its error word like any other.
            spin_limit_ns=Fixed(self.spin.handoff_limit_ns),
            error_flag=Fixed(self.spin.address),
            state=Fixed(self.mailbox.stage_state.data_ptr()),
            mixes=Fixed(self._mixes_handoff),
            raw_out=Fixed(self._raw_mixes),
            **pointers("scale", "base"),
            post_out=post_out,
            comb_out=comb_out,
            m=DIM_M,
        )
        return [
            Launch(
                [kernel.function for kernel in kernels],
                kernels[0].signature,
                boundary,
                min_tokens=self.routing.thresholds,
                # The mixes kernel waits for what precedes the boundary, not for the boundary.
                forks_side=True,
            ),
            # Launched after the boundary, so a boundary that fails to launch leaves no waiter; on
            # the side stream, forked before the boundary: it polls the hand-off rows alongside it.
            Launch([self._mixes_kernel.function], self._mixes_kernel.signature, mixes, side=True),
        ]

    def _allocate(self, like: Any, values: tuple[Any, ...], m: int) -> tuple[torch.Tensor, ...]:
        residual, post, comb = values[:3]
        # post is [M, 4, 1] or [M, 4]: post_out is [M, 4, 1] either way (a contiguous view of the latter).
        post_out = torch.empty_like(post) if post.dim() == 3 else torch.empty_like(post).unsqueeze(2)
        if not self.layer_input.quantizes:
            return torch.empty_like(residual), post_out, torch.empty_like(comb), self._hidden_like(like, m)
        tokens = like.shape[0] if like is not None else m  # a call's M is its publish input's
        layer_input = self.layer_input.allocate(like, residual, tokens, self.hidden_size)
        return torch.empty_like(residual), post_out, torch.empty_like(comb), *layer_input

    def _warmup_collects(self) -> list[tuple[tuple[Any, ...], int]]:
        hidden, device = self.hidden_size, self.device
        residual = torch.zeros(1, HC, hidden, dtype=torch.bfloat16, device=device)
        post = torch.zeros(1, HC, 1, dtype=torch.float32, device=device)
        comb = torch.zeros(1, HC, HC, dtype=torch.float32, device=device)
        fn = torch.zeros(MIX, HC * hidden, dtype=torch.bfloat16, device=device)
        scale = torch.ones(3, dtype=torch.float32, device=device)
        base = torch.zeros(MIX, dtype=torch.float32, device=device)
        weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
        values = (residual, post, comb, fn, scale, base, weight)
        targets = self.routing.targets
        # One launch of each boundary kernel (the first route it serves).
        return [(values, targets.index(target)) for target in self._boundary_kernels]

    def _plan_values(self, method: str, *args: Any, **kwargs: Any) -> tuple[object, tuple[Any, ...], Any]:
        if method != "call":
            raise ValueError(f"method: AllReduceMhcBoundary takes 'call' (MoE input as a MoEOutput), got {method!r}")
        out = kwargs.pop("out", None)
        x, *values = args
        return x, tuple(values), out

    # ------------------------------------------------------------ public API
    def __call__(
        self,
        x: torch.Tensor | MoEOutput,
        residual: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        norm_weight: torch.Tensor,
        *,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Outputs:
        """Return ``(residual_out [M, 4, hidden] BF16, post_out [M, 4, 1] FP32, comb_out [M, 4, 4] FP32,
        layer_input [M, hidden] BF16)`` of ``hc_fused_post_pre`` applied to the TP sum of ``x``; with an
        FP8 ``layer_input_format`` ``(residual_out, post_out, comb_out, q, scales)``, or ``(...,
        q, scales, layer_input)`` with ``layer_input_bf16`` (the module docstring).

        Args:
            x: [M, hidden] BF16 TP-partial sublayer output, or a ``MoEOutput`` whose
                routed top-k reduction is still open (FP32 or BF16 routing weights).
            residual: [M, 4, hidden] BF16 residual streams.
            post: [M, 4, 1] (or [M, 4]) FP32 post-mix.
            comb: [M, 4, 4] FP32 residual mix, indexed [source, target].
            fn: [24, 4 * hidden] BF16 prenorm GEMV weight.
            scale: [3] FP32 mix scales. base: [24] FP32 mix biases.
            norm_weight: [hidden] BF16 RMSNorm weight.
            out: optional preallocated outputs, in the order returned (``q`` ``float8_e4m3fn
                [M, hidden]``, ``scales`` as ``mhc_core.fp8.Fp8Format.empty_scales(M, hidden)`` makes
                them: its shape, strides and whole allocation).

        ``post_out`` and ``comb_out`` are written on a side stream: complete after ``join()``.
        """
        outputs: Outputs = self._call(x, (residual, post, comb, fn, scale, base, norm_weight), out)
        return outputs  # annotated, not cast(): no function call on the hot path

    def collect(
        self,
        residual: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        norm_weight: torch.Tensor,
        *,
        out: Sequence[torch.Tensor] | None = None,
        after_publish: bool = False,
    ) -> Outputs:
        """Phase two, for the pending ``publish``; ``after_publish=True`` promises the kernel
        right before on this stream is that publish."""
        return cast(
            Outputs, self._collect_pending((residual, post, comb, fn, scale, base, norm_weight), out, after_publish)
        )

    def _layer_input_repr(self) -> str:
        if not self.layer_input.quantizes:
            return ""
        return f"layer_input_format={self.layer_input.format!r}, layer_input_bf16={self.layer_input.keep_bf16}, "

    def __repr__(self) -> str:
        return (
            f"AllReduceMhcBoundary(cluster_size={self.preset.cluster_size}, threads={self.preset.threads}, "
            f"cluster_tokens={list(self.cluster_tokens)}, persistent_min_tokens={self.persistent_min_tokens}, "
            f"clusters={self.clusters}, {self._layer_input_repr()}{self._describe()})"
        )
