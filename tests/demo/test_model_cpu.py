"""The demo decoder on the CPU (issue #19): the model code, the routing fed to every path, the bounds.

* The embedded defaults build on the meta device at tp 1 and tp 2 (shapes only, both paths: the
  fused one through the custom ops' fake kernels) and trace into one graph, the mhc ops in order.
* At a tiny size (hidden 64, vocab 128, 2 layers) the unfused path decodes on CPU tensors; the TP
  shards' partial sums add up to the tp 1 sublayer; the MoE's permuted routes match a loop.
* The routing is computed once per step and the very same object reaches every path.
* The bounds of ``demo.tolerance``: a kernel-like FP32 boundary is within them, wrong ones are
  not, the emulated kernel conforms, the logit tolerance is its formula, and a whole checked
  decode with the emulated kernel as the fused path passes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from demo import reference, tolerance
from demo.boundaries import EmulatedBoundary, FusedBoundary, UnfusedBoundary, finalize
from demo.check import Paths, conformance, decode_check
from demo.config import DEFAULTS, MIX, default, tiny
from demo.model import build, permute
from mhc_core import MoEOutput

MODELS = ("dsv41", "glm5")
M = 5
BF16 = torch.bfloat16


def tiny_model(name: str, seed: int = 1):
    return build(tiny(name), seed=seed)


def tokens_for(model, m: int = M, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.config.vocab, (m,), generator=torch.Generator().manual_seed(seed))


def fused_runner(model, boundary):
    def fused(tokens, routing):
        trace = []
        return model(tokens, routing, boundary, trace), trace

    return fused


# ----------------------------------------------------------------------- config
def test_defaults_match_the_presets() -> None:
    from mhc_dsv41 import presets as dsv_presets
    from mhc_glm5 import presets as glm_presets

    dsv, glm = default("dsv41"), default("glm5")
    assert (dsv.hidden, dsv.hc, dsv.boundaries_per_step) == (5120, 4, 8)
    assert (glm.hidden, glm.hc, glm.boundaries_per_step) == (4096, 4, 8)
    for tp in (1, 2):
        assert dsv.preset(tp) in dsv_presets.names() and glm.preset(tp) in glm_presets.names()
    dsv_preset, glm_preset = dsv_presets.get(dsv.preset(1)).PRESET, glm_presets.get(glm.preset(1)).PRESET
    assert (dsv_preset.top_k, dsv_preset.norm_eps) == (dsv.moe.top_k, dsv.norm_eps)
    mixes = glm.mixes
    assert (glm_preset.rms_eps, glm_preset.hc_eps, glm_preset.post_mult, glm_preset.sinkhorn_repeat) == (
        mixes.rms_eps, mixes.hc_eps, mixes.post_mult, mixes.sinkhorn_repeat,
    )  # fmt: skip
    assert (glm_preset.top_k, glm_preset.norm_eps) == (glm.moe.top_k, glm.norm_eps)


def test_config_rejects_what_does_not_shard() -> None:
    with pytest.raises(ValueError, match="heads = 40 does not split over tp = 16"):
        default("dsv41").check_tp(16)
    with pytest.raises(ValueError, match="hc"):
        default("glm5").replace(hc=8)
    with pytest.raises(ValueError, match="top_k"):
        tiny("dsv41").moe.__class__(experts=2, top_k=3, intermediate=8, shared_intermediate=8)


# ------------------------------------------------------------------------- meta
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_meta_build_shapes_and_forward(name: str, tp: int) -> None:
    config = DEFAULTS[name]
    model = build(config, tp=tp, device="meta")
    a, moe, hidden = config.attention, config.moe, config.hidden
    attention, experts = model.sublayers[0], model.sublayers[1]
    assert attention.qkv.shape == ((a.heads + 2 * a.kv_heads) * a.head_dim // tp, hidden)
    assert attention.out.shape == (hidden, a.heads * a.head_dim // tp)
    assert experts.w13.shape == (moe.experts, hidden, 2 * moe.intermediate // tp)
    assert experts.w2.shape == (moe.experts, moe.intermediate // tp, hidden)
    assert experts.shared13.shape == (2 * moe.shared_intermediate // tp, hidden)
    assert model.embed.shape == model.head.shape == (config.vocab, hidden)
    assert len(model.sublayers) == config.sublayers
    assert len(model.mixes) == config.sublayers + (name == "glm5")
    assert model.mixes[0].fn.shape == (MIX, 4 * hidden)
    assert all(p.device.type == "meta" for p in model.parameters())

    tokens = torch.zeros(8, dtype=torch.int64, device="meta")
    routing = model.route(tokens)
    assert len(routing) == config.layers and routing[0].index.shape == (8, moe.top_k)
    with torch.no_grad():
        logits = model(tokens, routing, UnfusedBoundary(config))
        op = SimpleNamespace(state=torch.zeros(4, dtype=torch.int32, device="meta"), handle=1)
        trace = []
        fused = model(tokens, routing, FusedBoundary(op), trace)
    assert logits.shape == fused.shape == (8, config.vocab)
    assert len(trace) == config.boundaries_per_step
    assert trace[-1]["residual_out"].shape == (8, 4, hidden) and trace[1]["gemm2"].shape == (8 * moe.top_k, hidden)


@pytest.mark.parametrize("name", MODELS)
def test_fused_path_traces_into_one_graph_with_joins_after_the_next_sublayer(name: str) -> None:
    """Dynamo sees the fused step whole: the mhc ops in boundary order (DSV: plain, finalize; GLM:
    each boundary's join only after the next sublayer's GEMMs, or the LM head's for the last)."""
    import mhc_dsv41.library  # noqa: F401  (registers the ops; no GPU, no DSL)
    import mhc_glm5.library  # noqa: F401

    model = build(tiny(name), device="meta")
    op = SimpleNamespace(state=torch.zeros(4, dtype=torch.int32, device="meta"), handle=1)
    boundary = FusedBoundary(op)

    def step(tokens):
        return fused_runner(model, boundary)(tokens, model.route(tokens))

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(step, fullgraph=True, backend=backend)(torch.zeros(M, dtype=torch.int64, device="meta"))
    assert len(graphs) == 1
    nodes = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    ops = [n.removeprefix("mhc.").split(".")[0] for n in nodes if n.startswith("mhc.")]
    layers = model.config.layers
    if name == "dsv41":
        assert ops == ["dsv41_boundary", "dsv41_finalize"] * layers
        return
    assert ops == ["glm5_boundary", "glm5_join", "glm5_boundary_moe", "glm5_join"] * layers
    positions = [i for i, n in enumerate(nodes) if n.startswith("mhc.")]
    for boundary_at, join_at in zip(positions[0::2], positions[1::2], strict=True):
        between = nodes[boundary_at + 1 : join_at]
        assert any("linear" in n or "_grouped_mm" in n for n in between), f"no GEMM before a join: {between}"


# ------------------------------------------------------------------ CPU decode
@pytest.mark.parametrize("name", MODELS)
def test_unfused_decode_on_cpu(name: str) -> None:
    model = tiny_model(name)
    boundary = UnfusedBoundary(model.config)
    tokens = tokens_for(model)
    with torch.no_grad():
        for _ in range(3):
            routing = model.route(tokens)
            logits = model(tokens, routing, boundary)
            assert logits.shape == (M, model.config.vocab) and logits.dtype == BF16
            assert torch.isfinite(logits.float()).all()
            assert logits.float().std() > 0.1  # not collapsed
            again = model(tokens, routing, boundary)
            assert torch.equal(logits, again), "the unfused path is not deterministic"
            tokens = logits.float().argmax(-1)


@pytest.mark.parametrize("name", MODELS)
def test_unfused_path_compiles_to_one_graph_equal_to_eager(name: str) -> None:
    model = tiny_model(name)
    boundary = UnfusedBoundary(model.config)

    def step(tokens):
        return model(tokens, model.route(tokens), boundary)

    tokens = tokens_for(model)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(step, fullgraph=True, backend="eager")(tokens)
        assert torch.equal(compiled, step(tokens))


@pytest.mark.parametrize("name", MODELS)
def test_opaque_unfused_path_equals_unfused_and_traces_to_one_graph(name: str) -> None:
    """``--diagnose``'s path: the unfused boundaries behind mhc_demo:: custom ops (each compiled alone)
    give the unfused path's logits, and the model around them still traces with no graph break."""
    from demo.opaque import OpaqueUnfusedBoundary

    model = tiny_model(name)
    unfused = UnfusedBoundary(model.config)
    opaque = OpaqueUnfusedBoundary(model.config, None, lambda function: torch.compile(function, backend="eager"))

    def step(tokens, boundary):
        return model(tokens, model.route(tokens), boundary)

    tokens = tokens_for(model)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = step(tokens, unfused)
        assert torch.equal(step(tokens, opaque), expected)
        compiled = torch.compile(lambda tokens: step(tokens, opaque), fullgraph=True, backend="eager")
        assert torch.equal(compiled(tokens), expected)


def test_tp_shards_add_up_to_the_tp1_sublayers() -> None:
    """Each rank's sublayer output is a partial sum: the ranks' outputs add up to tp 1's."""
    config = tiny("dsv41")
    whole = build(config, seed=3)
    ranks = [build(config, tp=2, rank=rank, seed=3) for rank in range(2)]
    tokens = tokens_for(whole)
    with torch.no_grad():
        routing = whole.route(tokens)
        for rank in ranks:
            assert all(torch.equal(a.experts, b.experts) for a, b in zip(rank.route(tokens), routing, strict=True))
        layer_input = whole.start(tokens)[1]
        for s in range(2):
            expected = whole.sublayer(s, layer_input, routing)
            parts = [rank.sublayer(s, layer_input, routing) for rank in ranks]
            if s == 1:
                expected, parts = finalize(expected), [finalize(p) for p in parts]
            total = sum(p.float() for p in parts)
            scale = expected.float().abs().max()
            assert (total - expected.float()).abs().max() <= 0.03 * scale, f"sublayer {s}"


def test_moe_routes_match_a_loop_over_tokens() -> None:
    model = tiny_model("dsv41")
    moe_layer, config = model.sublayers[1], model.config
    tokens = tokens_for(model, m=7)
    with torch.no_grad():
        route = model.route(tokens)[0]
        layer_input = model.start(tokens)[1]
        got = finalize(moe_layer(layer_input, route)).float()
        expected = []
        for m in range(7):
            h = layer_input[m].float()
            gate, up = (moe_layer.shared13.float() @ h).chunk(2)
            total = moe_layer.shared2.float() @ (F.silu(gate) * up)
            for k in range(config.moe.top_k):
                e = int(route.experts[m, k])
                gate, up = (h @ moe_layer.w13[e].float()).chunk(2)
                total = total + route.weights[m, k] * ((F.silu(gate) * up) @ moe_layer.w2[e].float())
            expected.append(total)
    expected = torch.stack(expected)
    assert (got - expected).abs().max() <= 0.03 * expected.abs().max()


def test_permute_sorts_routes_by_expert() -> None:
    experts = torch.tensor([[2, 0], [1, 2], [0, 3]])
    route = permute(experts, torch.rand(3, 2), num_experts=4)
    flat = experts.reshape(-1)
    assert torch.equal(route.offsets, torch.tensor([2, 3, 5, 6], dtype=torch.int32))
    for m in range(3):
        for k in range(2):
            row = int(route.index[m, k])
            assert int(route.rows[row]) == m
    sorted_experts = flat[torch.argsort(route.index.reshape(-1))]
    assert torch.equal(sorted_experts, torch.sort(flat).values)


# --------------------------------------------------------------- route once
@pytest.mark.parametrize("name", MODELS)
def test_routing_is_computed_once_per_step_and_fed_to_every_path(name: str) -> None:
    model = tiny_model(name)
    unfused_boundary = UnfusedBoundary(model.config)
    routes, seen = [], []

    def route(tokens):
        routes.append(model.route(tokens))
        return routes[-1]

    def unfused(tokens, routing):
        seen.append(("unfused", len(routes), routing))
        return model(tokens, routing, unfused_boundary)

    fused_boundary = EmulatedBoundary(model.config, seed=7, device="cpu")

    def fused(tokens, routing):
        seen.append(("fused", len(routes), routing))
        return fused_runner(model, fused_boundary)(tokens, routing)

    def eager(tokens, routing, boundary):
        seen.append(("eager", len(routes), routing))
        return model(tokens, routing, boundary)

    emulated = [EmulatedBoundary(model.config, seed=s, device="cpu") for s in range(tolerance.DRAWS)]
    paths = Paths(route, unfused, fused, eager, unfused_boundary, emulated)
    with torch.no_grad():
        decode_check(model, paths, tokens_for(model), steps=3)
    assert len(routes) == 3, "the router ran more than once per step"
    assert len(seen) == 3 * (3 + tolerance.DRAWS)
    for path, step, routing in seen:
        assert routing is routes[step - 1], f"{path} got another routing than step {step}'s"


def test_the_routing_decides_the_moe_output() -> None:
    """Fed routing is what the MoE uses: other experts, other logits; same tokens, same routing."""
    model = tiny_model("dsv41")
    boundary = UnfusedBoundary(model.config)
    tokens = tokens_for(model)
    with torch.no_grad():
        routing = model.route(tokens)
        again = model.route(tokens)
        assert all(
            torch.equal(a.experts, b.experts) and torch.equal(a.weights, b.weights)
            for a, b in zip(routing, again, strict=True)
        )
        n = model.config.moe.experts
        shifted = tuple(permute((r.experts + 1) % n, r.weights, n) for r in routing)
        assert not torch.equal(model(tokens, routing, boundary), model(tokens, shifted, boundary))


# ------------------------------------------------------------------ bounds
def boundary_inputs(m: int, hidden: int, seed: int) -> dict:
    """Inputs in the ranges mHC produces (post in (0, 2), comb ~ doubly stochastic, pre in (0, 1))."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(m, hidden, generator=g).to(BF16),
        residual=torch.randn(m, 4, hidden, generator=g).to(BF16),
        post=torch.rand(m, 4, generator=g) * 2,
        comb=torch.softmax(torch.randn(m, 4, 4, generator=g), -1),
        pre=torch.rand(m, 4, generator=g),
        weight=(torch.rand(hidden, generator=g) + 0.5).to(BF16),
        fn=(torch.randn(MIX, 4 * hidden, generator=g) * (4 * hidden) ** -0.5).to(BF16),
        scale=torch.rand(3, generator=g) + 0.5,
        base=torch.randn(MIX, generator=g) * 0.5,
    )


def kernel_like_post_mix(x, residual, post, comb):
    """FP32, sources in order, one rounding per stream (the kernels' order: mhc_core.reference.post_mix)."""
    xf, r, post, comb = x.float(), residual.float(), post.reshape(x.shape[0], 4).float(), comb.float()
    streams = []
    for j in range(4):
        value = xf * post[:, j : j + 1]
        for i in range(4):
            value = value + r[:, i] * comb[:, i, j : j + 1]
        streams.append(value)
    return torch.stack(streams, 1).to(BF16)


def kernel_like_norm(collapse, weight, eps):
    c = collapse.float()
    return (c * torch.rsqrt((c * c).sum(-1, keepdim=True) / c.shape[-1] + eps) * weight.float()).to(BF16)


def kernel_like_glm_mixes(streams, fn, scale, base, mixes, *, post_mult=None):
    flat = streams.float().flatten(1)
    rstd = torch.rsqrt((flat * flat).sum(-1, keepdim=True) / flat.shape[1] + mixes.rms_eps)
    raw = (flat @ fn.float().t()) * rstd
    pre = torch.sigmoid(raw[:, :4] * scale[0] + base[:4]) + mixes.hc_eps
    t = [streams[:, j].float() * pre[:, j : j + 1] for j in range(4)]
    collapse = ((t[0] + t[1]) + (t[2] + t[3])).to(BF16)
    post = torch.sigmoid(raw[:, 4:8] * scale[1] + base[4:8]) * (post_mult or mixes.post_mult)
    comb = torch.softmax((raw[:, 8:] * scale[2] + base[8:]).view(-1, 4, 4), -1) + mixes.hc_eps
    for iteration in range(mixes.sinkhorn_repeat):
        if iteration:
            comb = comb / (comb.sum(-1, keepdim=True) + mixes.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + mixes.hc_eps)
    return collapse, post.unsqueeze(-1), comb


def dsv41_ratios(streams, layer_input, inputs, eps=1e-6):
    x, residual, post, comb, pre, w = (inputs[k] for k in ("x", "residual", "post", "comb", "pre", "weight"))
    expected = reference.post_mix(x, residual, post, comb)
    zero = torch.zeros(())
    bound = tolerance.post_mix_bound(x, residual, post, comb, expected, zero)
    collapse, y = reference.dsv41_collapse(streams, pre, w, eps)
    input_bound = tolerance.dsv41_input_bound(streams, pre, w, eps, collapse, y)
    return (
        tolerance.ratio(streams, expected, bound),
        tolerance.ratio(layer_input, y, input_bound),
        bound / tolerance.bf16_ulp(expected),
    )


def glm5_ratios(streams, outputs, inputs, config):
    ref = reference.glm5_mixes(
        streams, inputs["fn"], inputs["scale"], inputs["base"], inputs["weight"], config.mixes, config.norm_eps
    )
    bounds = tolerance.glm5_bounds(
        streams,
        inputs["scale"],
        inputs["weight"],
        config.norm_eps,
        config.mixes.post_mult,
        config.mixes.sinkhorn_repeat,
        ref,
    )
    return {name: tolerance.ratio(outputs[name], ref[name], bounds[name]) for name in bounds}


@pytest.mark.parametrize("seed", range(3))
def test_a_kernel_like_dsv41_boundary_is_within_its_bounds_and_they_are_tight(seed: int) -> None:
    inputs = boundary_inputs(M, 64, seed)
    streams = kernel_like_post_mix(inputs["x"], inputs["residual"], inputs["post"], inputs["comb"])
    collapse = sum(streams[:, j].float() * inputs["pre"][:, j : j + 1] for j in range(4)).to(BF16)
    layer_input = kernel_like_norm(collapse, inputs["weight"], 1e-6)
    residual_ratio, input_ratio, in_ulps = dsv41_ratios(streams, layer_input, inputs)
    assert residual_ratio <= 1 and input_ratio <= 1
    assert in_ulps.median() <= 1.5, "the post-mix bound is not a rounding-level bound"
    # Wrong math is caught: the residual mix transposed, the norm weight dropped.
    wrong = kernel_like_post_mix(inputs["x"], inputs["residual"], inputs["post"], inputs["comb"].transpose(1, 2))
    assert dsv41_ratios(wrong, layer_input, inputs)[0] > 10
    assert dsv41_ratios(streams, kernel_like_norm(collapse, torch.ones_like(inputs["weight"]), 1e-6), inputs)[1] > 10


@pytest.mark.parametrize("seed", range(3))
def test_a_kernel_like_glm5_boundary_is_within_its_bounds(seed: int) -> None:
    config = tiny("glm5")
    inputs = boundary_inputs(M, 64, seed)
    streams = kernel_like_post_mix(inputs["x"], inputs["residual"], inputs["post"], inputs["comb"])
    collapse, post, comb = kernel_like_glm_mixes(streams, inputs["fn"], inputs["scale"], inputs["base"], config.mixes)
    outputs = {
        "layer_input": kernel_like_norm(collapse, inputs["weight"], config.norm_eps),
        "post_out": post,
        "comb_out": comb,
    }
    ratios = glm5_ratios(streams, outputs, inputs, config)
    assert max(ratios.values()) <= 1, ratios
    _, wrong_post, _ = kernel_like_glm_mixes(
        streams, inputs["fn"], inputs["scale"], inputs["base"], config.mixes, post_mult=1.0
    )
    assert glm5_ratios(streams, {**outputs, "post_out": wrong_post}, inputs, config)["post_out"] > 10


def test_the_reduced_input_bounds_the_torch_finalize() -> None:
    g = torch.Generator().manual_seed(5)
    rows, hidden, top_k = M * 3, 64, 3
    index = torch.randperm(rows, generator=g).view(M, top_k).to(torch.int32)
    index[0, 1] = -1  # a route this rank does not hold
    moe = MoEOutput(torch.randn(rows, hidden, generator=g).to(BF16), torch.rand(M, top_k, generator=g), index,
                    torch.randn(M, hidden, generator=g).to(BF16))  # fmt: skip
    red = reference.reduced(moe)
    assert torch.equal(red.value, reference.finalize(moe).to(BF16))
    assert ((finalize(moe).float() - red.value.float()).abs() <= red.error).all()
    x = torch.randn(M, hidden, generator=g).to(BF16)
    plain = reference.reduced(x)
    assert plain.value is x and float(plain.error) == 0.0


@pytest.mark.parametrize("name", MODELS)
def test_the_emulated_kernel_conforms_and_moves(name: str) -> None:
    model = tiny_model(name)
    tokens = tokens_for(model)
    with torch.no_grad():
        routing = model.route(tokens)
        _, trace = fused_runner(model, EmulatedBoundary(model.config, seed=3, device="cpu"))(tokens, routing)
        ratios = [r for entry in conformance(model, trace, routing) for r in entry.values()]
    assert max(ratios) <= 1
    assert min(ratios) > 0.5, "the emulated kernel should sit near its bounds"


class Biased(EmulatedBoundary):
    """The emulated kernel with every residual stream scaled by 1 + 2^-5: a few ulps everywhere."""

    def _streams(self, x, residual, post, comb):
        return (super()._streams(x, residual, post, comb).float() * (1 + 2.0**-5)).to(BF16)


class Transposed(EmulatedBoundary):
    """The emulated kernel reading the residual mix as [target, source]."""

    def _streams(self, x, residual, post, comb):
        return super()._streams(x, residual, post, comb.transpose(1, 2))


@pytest.mark.parametrize("wrong", [Biased, Transposed])
@pytest.mark.parametrize("name", MODELS)
def test_conformance_catches_a_kernel_outside_its_bounds(name: str, wrong: type) -> None:
    model = tiny_model(name)
    tokens = tokens_for(model)
    with torch.no_grad():
        routing = model.route(tokens)
        _, trace = fused_runner(model, wrong(model.config, seed=3, device="cpu"))(tokens, routing)
        ratios = conformance(model, trace, routing)
    # Boundary 0's streams are all the embedding: any doubly stochastic mix, transposed or not, keeps them.
    assert all(entry["residual_out"] > 5 for entry in ratios[1:]), ratios


def test_the_logit_tolerance_is_its_formula() -> None:
    g = torch.Generator().manual_seed(0)
    eager = torch.randn(3, 50, generator=g).to(BF16)
    compiled = (eager.float() + 0.01).to(BF16)
    draws = [(eager.float() + 0.1 * torch.randn(3, 50, generator=g)).to(BF16) for _ in range(2)]
    tol = tolerance.logit_tolerance(eager, compiled, draws)
    spread = torch.stack([(d.float() - eager.float()).abs().amax(-1) for d in draws]).amax(0)
    expected = tolerance.MARGIN * spread + (compiled.float() - eager.float()).abs().amax(-1)
    expected = expected + tolerance.bf16_ulp(compiled).amax(-1)
    assert torch.allclose(tol, expected)
    same = tolerance.logit_tolerance(eager, eager, [eager])
    assert torch.equal(same, tolerance.bf16_ulp(eager).amax(-1)), "identical paths leave one ulp"
    fused = compiled.float() + 0.5 * tol.unsqueeze(-1)
    assert torch.allclose(tolerance.logit_ratio(fused, compiled, tol), torch.full((3,), 0.5))
    fused[1, 3] = float("nan")
    assert tolerance.logit_ratio(fused, compiled, tol)[1] == float("inf")


@pytest.mark.parametrize("name", MODELS)
def test_a_checked_decode_with_the_emulated_kernel_as_the_fused_path_passes(name: str) -> None:
    """The whole check on the CPU: the emulated kernel (a conforming one) stands in for the fused op."""
    model = tiny_model(name)
    unfused_boundary = UnfusedBoundary(model.config)
    emulated = [EmulatedBoundary(model.config, seed=s, device="cpu") for s in range(tolerance.DRAWS)]
    fused = fused_runner(model, EmulatedBoundary(model.config, seed=99, device="cpu"))
    paths = Paths(
        route=model.route,
        unfused=lambda tokens, routing: model(tokens, routing, unfused_boundary),
        fused=fused,
        eager=model,
        unfused_boundary=unfused_boundary,
        emulated=emulated,
    )
    with torch.no_grad():
        results = decode_check(model, paths, tokens_for(model), steps=4)
    assert len(results) == 4
    for result in results:
        assert result.passed, result
        assert result.compile_deviation == 0.0  # eager "compiled" path here
        assert result.max_logit_difference > 0 and result.emulated_spread > 0


# ------------------------------------------------------------------ report
def test_report_rows_table_and_json(tmp_path) -> None:
    from demo import report

    iso = {"attention unfused": 12.0, "attention fused": 4.0, "moe unfused": 16.0, "moe fused": 6.0}
    step = {"logit_ratio": 0.3, "conformance": 0.5, "passed": True}
    row = report.Row("dsv41", 1, 8, 4, unfused_us=500.0, fused_us=428.0, isolated_us=iso, steps=[step] * 2)
    assert row.boundaries == 8 and row.per_boundary_saving_us == 9.0
    assert row.efficiency == pytest.approx(72.0 / 72.0) and row.check_passed
    assert row.tokens_per_s(row.fused_us) == pytest.approx(8e6 / 428.0)
    text = report.table([row])
    assert "| 8 | 500.0 | 428.0 |" in text and "pass (2 steps" in text
    failed = report.Row("glm5", 1, 1, 4, 300.0, 290.0, iso, steps=[{**step, "passed": False}])
    assert not failed.check_passed and "FAIL" in report.table([failed])
    report.write_json([row, failed], tmp_path / "demo.json", {"tp": 1})
    assert '"efficiency": 1.0' in (tmp_path / "demo.json").read_text()
    diagnosed = report.Row("dsv41", 1, 8, 4, 500.0, 428.0, iso, steps=[step], opaque_us=536.0)
    assert diagnosed.efficiency_opaque == pytest.approx(108.0 / 72.0)
    assert "| 8 | 500.0 | 536.0 | 428.0 | 36.0 | 1.00 | 1.50 |" in report.table([diagnosed])
