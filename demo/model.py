"""The demo decoder: two mHC stacks as ``torch.nn.Module``s whose boundary is pluggable.

A decode step of ``M`` tokens, for either stack:

1. ``route(tokens)``: the routing decisions of every MoE layer, computed once per step and fed to
   every path (``Routing``). The router scores each layer's experts from the step's token
   embeddings, not from that layer's hidden state: then both paths see the same decisions by
   construction, and the logit comparison measures the boundaries, not a flipped top-k choice.
2. ``forward(tokens, routing, boundary)``: the embedding is copied into hc = 4 residual streams;
   each sublayer reads ``layer_input`` (``[M, hidden]``) and returns its TP-partial output, which the
   boundary all-reduces and mixes into the streams, returning the next ``layer_input``. The last
   boundary's ``layer_input`` goes to the LM head (replicated on every rank).

Sublayers, sharded as an engine shards them (each rank's output is a partial sum):

* ``Attention``: a stand-in with the real projections, qkv column-parallel (heads split over
  ranks) and the output projection row-parallel; in between each query head is gated by its own
  token's key (no KV cache), so the step has attention's GEMMs without a cache to manage.
* ``MoE``: routed SwiGLU experts (intermediate dimension split over ranks) as two grouped GEMMs
  over the routes sorted by expert (``torch._grouped_mm``), plus a shared expert. It returns the
  output unfinalized, a ``mhc_core.MoEOutput``: the fused path's boundary finalizes it in its
  publish, the unfused one in torch before the all-reduce (``demo.boundaries``).

The mixes (``hc_mixes``) are the mHC form of both models: from the flattened streams, a 24-row
GEMV scaled by their RMS gives the pre-mix (sigmoid), post-mix (``post_mult`` sigmoid) and residual
mix (Sinkhorn of a softmax). Where they are computed is what tells the stacks apart:

* ``DSV41Stack``: in torch, before each sublayer, from its input streams: that sublayer's post
  and residual mix, and the pre-mix of the collapse after its boundary (carried one sublayer on:
  the op takes the pre-mix as an input).
* ``GLM5Stack``: in the boundary, from the streams it has just mixed, for the next sublayer
  (parameters ``mixes[s + 1]``); the fused op finishes post and residual mix on a side stream,
  joined right before the next boundary, so they overlap that sublayer's GEMMs.

The first sublayer's input is the RMS-normalized embedding (all streams are equal, so any pre-mix
collapses to it); GLM's first post / residual mix come from ``hc_mixes`` on those streams.

``trace``: a list the forward appends one record per boundary to (what ``demo.check`` verifies):
the boundary's sublayer output (``x``, or ``gemm2`` / ``shared`` of a MoE), its inputs
``residual``, ``post``, ``comb`` (DSV: ``pre``) and outputs ``residual_out``, ``layer_input``
(GLM: ``post_out``, ``comb_out`` once joined).
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhc_core import MoEOutput

from .config import HC, MIX, MixesConfig, StackConfig

BF16 = torch.bfloat16


# --------------------------------------------------------------------- weights
class Init:
    """Seeded weights, identical on every rank: each tensor is drawn whole, then sharded.

    A tensor's generator is seeded from ``seed`` and its name, so a rank's shard does not depend
    on the tp degree's order of draws, and tp 1 and tp 2 build the same model.
    """

    def __init__(self, seed: int, *, tp: int = 1, rank: int = 0) -> None:
        self.seed, self.tp, self.rank = seed, tp, rank

    def _generator(self, name: str, device: torch.device) -> torch.Generator:
        generator = torch.Generator(device)
        generator.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
        return generator

    def normal(self, name: str, target: Tensor, *, std: float, dim: int | None = None, sections=None) -> None:
        """``target`` <- this rank's shard of a ``N(0, std^2)`` tensor; ``dim`` is the sharded dimension,
        ``sections`` its concatenated parts (q, k, v or gate, up), each split over the ranks."""
        full = list(target.shape)
        if dim is not None:
            full[dim] *= self.tp
        values = torch.randn(full, generator=self._generator(name, target.device), device=target.device) * std
        target.copy_(self._shard(values, dim, sections).to(target.dtype))

    def uniform(self, name: str, target: Tensor, *, low: float, high: float) -> None:
        """``target`` <- ``U(low, high)`` (replicated)."""
        values = torch.rand(target.shape, generator=self._generator(name, target.device), device=target.device)
        target.copy_((low + (high - low) * values).to(target.dtype))

    def _shard(self, values: Tensor, dim: int | None, sections) -> Tensor:
        if dim is None or self.tp == 1:
            return values
        parts = values.split(list(sections), dim) if sections else (values,)
        return torch.cat([part.chunk(self.tp, dim)[self.rank] for part in parts], dim)


def _weight(*shape: int, device, dtype=BF16) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


# --------------------------------------------------------------------- routing
class Route(NamedTuple):
    """One MoE layer's routes for a step, in the MoE's permuted (expert-sorted) row order.

    ``weights`` ``[M, top_k]`` FP32 (scaled), ``index`` ``[M, top_k]`` int32 (the permuted row of
    each route: ``MoEOutput.expanded_idx_to_permuted_idx``), ``rows`` ``[M * top_k]`` int64 (the token
    of each permuted row), ``offsets`` ``[experts]`` int32 (each expert's end row), ``experts``
    ``[M, top_k]`` int64 (the decisions themselves).
    """

    weights: Tensor
    index: Tensor
    rows: Tensor
    offsets: Tensor
    experts: Tensor


#: Every MoE layer's ``Route``, first layer first.
Routing = tuple[Route, ...]


def permute(experts: Tensor, weights: Tensor, num_experts: int) -> Route:
    """Sort the ``[M, top_k]`` routes by expert (stable: a token's routes keep their order); no host sync."""
    m, top_k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # permuted row r holds route order[r]
    index = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    return Route(
        weights=weights.float().clone(),  # its own buffer: the op checks 16-byte alignment
        index=index.view(m, top_k).to(torch.int32),
        rows=order // top_k,
        offsets=counts.cumsum(0).to(torch.int32),
        experts=experts,
    )


class Router(nn.Module):
    """Per MoE layer, top-k of ``sigmoid(gate @ e)`` over the experts, ``e`` the step's embeddings;
    the chosen scores normalized to sum to ``routed_scale`` (DeepSeek's form)."""

    def __init__(self, config: StackConfig, device) -> None:
        super().__init__()
        self.moe = config.moe
        self.gates = _weight(config.layers, config.moe.experts, config.hidden, device=device)

    def initialize(self, init: Init, hidden: int) -> None:
        init.normal("router.gates", self.gates, std=hidden**-0.5)

    def forward(self, embeddings: Tensor) -> Routing:
        scores = torch.sigmoid(torch.einsum("mh,leh->lme", embeddings.float(), self.gates.float()))
        chosen, experts = scores.topk(self.moe.top_k, dim=-1)
        weights = chosen / chosen.sum(-1, keepdim=True) * self.moe.routed_scale
        return tuple(permute(experts[layer], weights[layer], self.moe.experts) for layer in range(scores.shape[0]))


# ------------------------------------------------------------------- sublayers
class Attention(nn.Module):
    """qkv (column-parallel) -> each query head gated by its own token's key -> output (row-parallel)."""

    def __init__(self, config: StackConfig, tp: int, device) -> None:
        super().__init__()
        a = config.attention
        self.heads, self.kv_heads, self.head_dim = a.heads // tp, a.kv_heads // tp, a.head_dim
        self.qkv = _weight((self.heads + 2 * self.kv_heads) * a.head_dim, config.hidden, device=device)
        self.out = _weight(config.hidden, self.heads * a.head_dim, device=device)

    def initialize(self, init: Init, name: str) -> None:
        d, tp = self.head_dim, init.tp
        hidden = self.qkv.shape[1]
        sections = (self.heads * d * tp, self.kv_heads * d * tp, self.kv_heads * d * tp)
        init.normal(f"{name}.qkv", self.qkv, std=hidden**-0.5, dim=0, sections=sections)
        init.normal(f"{name}.out", self.out, std=(self.heads * d * tp) ** -0.5, dim=1)

    def forward(self, layer_input: Tensor) -> Tensor:
        m, d, group = layer_input.shape[0], self.head_dim, self.heads // self.kv_heads
        q, k, v = F.linear(layer_input, self.qkv).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = q.reshape(m, self.kv_heads, group, d).float()
        k = k.reshape(m, self.kv_heads, 1, d).float()
        v = v.reshape(m, self.kv_heads, 1, d).float()
        gate = torch.sigmoid((q * k).sum(-1, keepdim=True) * d**-0.5)
        heads = (gate * v).to(BF16).reshape(m, self.heads * d)
        return F.linear(heads, self.out)  # [M, hidden], TP-partial


def swiglu(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(BF16)


class MoE(nn.Module):
    """Routed SwiGLU experts as grouped GEMMs over the permuted routes, plus a shared expert; the
    output stays unfinalized (``MoEOutput``: unweighted expert rows, weights, index, shared output)."""

    def __init__(self, config: StackConfig, tp: int, device) -> None:
        super().__init__()
        moe, hidden = config.moe, config.hidden
        inner, shared = moe.intermediate // tp, moe.shared_intermediate // tp
        self.w13 = _weight(moe.experts, hidden, 2 * inner, device=device)  # grouped GEMM layout [E, K, N]
        self.w2 = _weight(moe.experts, inner, hidden, device=device)
        self.shared13 = _weight(2 * shared, hidden, device=device)  # F.linear layout [N, K]
        self.shared2 = _weight(hidden, shared, device=device)

    def initialize(self, init: Init, name: str) -> None:
        hidden, tp = self.w2.shape[2], init.tp
        inner, shared = self.w2.shape[1] * tp, self.shared2.shape[1] * tp
        init.normal(f"{name}.w13", self.w13, std=hidden**-0.5, dim=2, sections=(inner, inner))
        init.normal(f"{name}.w2", self.w2, std=inner**-0.5, dim=1)
        init.normal(f"{name}.shared13", self.shared13, std=hidden**-0.5, dim=0, sections=(shared, shared))
        init.normal(f"{name}.shared2", self.shared2, std=shared**-0.5, dim=1)

    def forward(self, layer_input: Tensor, route: Route) -> MoEOutput:
        permuted = layer_input[route.rows]  # [M * top_k, hidden], expert-sorted
        inner = swiglu(torch._grouped_mm(permuted, self.w13, offs=route.offsets))
        gemm2 = torch._grouped_mm(inner, self.w2, offs=route.offsets)  # [M * top_k, hidden], TP-partial
        shared = F.linear(swiglu(F.linear(layer_input, self.shared13)), self.shared2)
        return MoEOutput(gemm2, route.weights, route.index, shared)


# ------------------------------------------------------------------------ mixes
class Mixes(nn.Module):
    """One sublayer's mHC parameters: ``fn`` ``[24, hc * hidden]`` BF16, ``scale`` ``[3]``, ``base`` ``[24]`` FP32."""

    def __init__(self, hidden: int, device) -> None:
        super().__init__()
        self.fn = _weight(MIX, HC * hidden, device=device)
        self.scale = _weight(3, device=device, dtype=torch.float32)
        self.base = _weight(MIX, device=device, dtype=torch.float32)

    def initialize(self, init: Init, name: str) -> None:
        init.normal(f"{name}.fn", self.fn, std=self.fn.shape[1] ** -0.5)
        init.uniform(f"{name}.scale", self.scale, low=0.5, high=1.5)
        init.normal(f"{name}.base", self.base, std=0.5)


def hc_mixes(streams: Tensor, mixes: Mixes, config: MixesConfig) -> tuple[Tensor, Tensor, Tensor]:
    """``(pre [M, 4], post [M, 4], comb [M, 4, 4])`` FP32 from ``[M, 4, hidden]`` BF16 streams, in torch.

    The same math as ``mhc_glm5.bench.baseline.boundary_with``'s mixes (and the GLM kernels'): raw
    mixes ``(fn @ s) * rsqrt(mean(s^2) + rms_eps)``, then sigmoid / sigmoid / Sinkhorn.
    """
    eps = config.hc_eps
    flat = streams.flatten(1)
    raw = torch.matmul(flat, mixes.fn.t()).float() * torch.rsqrt(
        flat.float().pow(2).mean(-1, keepdim=True) + config.rms_eps
    )
    scale, base = mixes.scale, mixes.base
    pre = torch.sigmoid(raw[:, :HC] * scale[0] + base[:HC]) + eps
    post = torch.sigmoid(raw[:, HC : 2 * HC] * scale[1] + base[HC : 2 * HC]) * config.post_mult
    comb = torch.softmax((raw[:, 2 * HC :] * scale[2] + base[2 * HC :]).view(-1, HC, HC), dim=-1) + eps
    for iteration in range(config.sinkhorn_repeat):
        if iteration:
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def _record(x, residual: Tensor, post: Tensor, comb: Tensor, outputs: tuple[Tensor, Tensor], **extra) -> dict:
    moe = isinstance(x, MoEOutput)
    record = {"gemm2": x.gemm2_permuted, "shared": x.shared_output} if moe else {"x": x}
    record.update(residual=residual, post=post, comb=comb, residual_out=outputs[0], layer_input=outputs[1], **extra)
    return record


# ----------------------------------------------------------------------- stacks
class Stack(nn.Module):
    """What both stacks share: embedding, router, sublayers, per-sublayer norms and mixes, LM head.

    ``norms[s]`` is sublayer ``s``'s input RMSNorm weight (``norms[2 * layers]`` the final norm);
    ``mixes`` holds one parameter set per sublayer (GLM: one more, the head's).
    """

    def __init__(self, config: StackConfig, *, tp: int = 1, rank: int = 0, device="cpu", extra_mixes: int = 0):
        super().__init__()
        config.check_tp(tp)
        self.config, self.tp, self.rank = config, tp, rank
        hidden, sublayers = config.hidden, config.sublayers
        self.embed = _weight(config.vocab, hidden, device=device)
        self.head = _weight(config.vocab, hidden, device=device)
        self.norms = _weight(sublayers + 1, hidden, device=device)
        self.router = Router(config, device)
        self.sublayers = nn.ModuleList((Attention if s % 2 == 0 else MoE)(config, tp, device) for s in range(sublayers))
        self.mixes = nn.ModuleList(Mixes(hidden, device) for _ in range(sublayers + extra_mixes))

    @torch.no_grad()
    def initialize(self, seed: int = 0) -> Stack:
        """Random weights (seeded; the same model at every tp). A meta-device model stays as it is."""
        if self.embed.device.type == "meta":
            return self
        init = Init(seed, tp=self.tp, rank=self.rank)
        hidden = self.config.hidden
        init.normal("embed", self.embed, std=1.0)
        init.normal("head", self.head, std=hidden**-0.5)
        init.uniform("norms", self.norms, low=0.5, high=1.5)
        self.router.initialize(init, hidden)
        for s, sublayer in enumerate(self.sublayers):
            sublayer.initialize(init, f"sublayers.{s}")
        for s, mixes in enumerate(self.mixes):
            mixes.initialize(init, f"mixes.{s}")
        return self

    def route(self, tokens: Tensor) -> Routing:
        """Every MoE layer's routes for this step (call once, feed every path)."""
        return self.router(F.embedding(tokens, self.embed))

    def start(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """``(streams [M, 4, hidden], layer_input [M, hidden])`` of the first sublayer."""
        embeddings = F.embedding(tokens, self.embed)
        streams = embeddings.unsqueeze(1).expand(-1, HC, -1).contiguous()
        return streams, F.rms_norm(embeddings, (self.config.hidden,), self.norms[0], self.config.norm_eps)

    def sublayer(self, s: int, layer_input: Tensor, routing: Routing):
        """Sublayer ``s``'s TP-partial output: a tensor (attention) or a ``MoEOutput``."""
        module = self.sublayers[s]
        return module(layer_input) if s % 2 == 0 else module(layer_input, routing[s // 2])

    def logits(self, layer_input: Tensor) -> Tensor:
        return F.linear(layer_input, self.head)


class DSV41Stack(Stack):
    """DeepSeek-V4.1-style: mixes in torch before each sublayer; the boundary collapses with the carried pre."""

    def __init__(self, config: StackConfig, **options) -> None:
        super().__init__(config, **options)

    def boundary_weights(self, s: int) -> dict[str, Tensor]:
        """What boundary ``s`` takes beside its trace record: the next sublayer's norm weight."""
        return {"norm_weight": self.norms[s + 1]}

    def forward(self, tokens: Tensor, routing: Routing, boundary, trace: list | None = None) -> Tensor:
        eps = self.config.norm_eps
        streams, layer_input = self.start(tokens)
        for s in range(self.config.sublayers):
            pre, post, comb = hc_mixes(streams, self.mixes[s], self.config.mixes)
            x = self.sublayer(s, layer_input, routing)
            residual = streams
            streams, layer_input = boundary.dsv41(x, residual, post, comb, pre, self.norms[s + 1], eps)
            if trace is not None:
                trace.append(_record(x, residual, post, comb, (streams, layer_input), pre=pre))
        return self.logits(layer_input)


class GLM5Stack(Stack):
    """GLM-5.3-style: the boundary computes the next sublayer's mixes; post / comb are joined late."""

    def __init__(self, config: StackConfig, **options) -> None:
        super().__init__(config, extra_mixes=1, **options)

    def boundary_weights(self, s: int) -> dict[str, Tensor]:
        """What boundary ``s`` takes beside its trace record: the next sublayer's mixes and norm."""
        mixes = self.mixes[s + 1]
        return {"fn": mixes.fn, "scale": mixes.scale, "base": mixes.base, "norm_weight": self.norms[s + 1]}

    def forward(self, tokens: Tensor, routing: Routing, boundary, trace: list | None = None) -> Tensor:
        streams, layer_input = self.start(tokens)
        _, post, comb = hc_mixes(streams, self.mixes[0], self.config.mixes)
        post = post.unsqueeze(-1)
        pending = None
        for s in range(self.config.sublayers):
            x = self.sublayer(s, layer_input, routing)
            if pending is not None:  # after the sublayer: the side-stream mixes overlapped its GEMMs
                post, comb = boundary.glm5_join(pending)
                if trace is not None:
                    trace[-1].update(post_out=post, comb_out=comb)
            mixes, residual = self.mixes[s + 1], streams
            streams, layer_input, pending = boundary.glm5(
                x, residual, post, comb, mixes.fn, mixes.scale, mixes.base, self.norms[s + 1]
            )
            if trace is not None:
                trace.append(_record(x, residual, post, comb, (streams, layer_input)))
        logits = self.logits(layer_input)
        post, comb = boundary.glm5_join(pending)  # the last join, before the step (or its capture) ends
        if trace is not None:
            trace[-1].update(post_out=post, comb_out=comb)
        return logits


STACKS = {"dsv41": DSV41Stack, "glm5": GLM5Stack}


def build(config: StackConfig, *, tp: int = 1, rank: int = 0, device="cpu", seed: int | None = 0) -> Stack:
    """The stack of ``config.model`` on ``device`` (``"meta"``: shapes only), seeded weights unless ``seed`` is None."""
    model = STACKS[config.model](config, tp=tp, rank=rank, device=device)
    return model if seed is None else model.initialize(seed)
