"""The demo decoder's configuration: frozen dataclasses and the embedded defaults (nothing is downloaded).

Two stacks, hc = 4 mHC residual streams each, ``layers`` decoder layers of two sublayers (an
attention stand-in, then a MoE), so ``2 * layers`` boundaries per decode step:

* ``dsv41``: DeepSeek-V4.1-style, hidden 5120 (the ``h200-tp*-h5120`` presets). The boundary takes
  a carried pre-mix: each sublayer's mixes are computed in torch from its input streams, and the
  pre-mix among them is carried to the boundary after the sublayer (``demo.model``).
* ``glm5``: GLM-5.3-style, hidden 4096 (``h200-tp*-h4096``). The boundary computes the next
  sublayer's pre-mix itself and finishes the post-mix and Sinkhorn residual mix on a side stream.

The model constants are the presets' (the repository's ``presets.toml``: hc 4, top_k 8, the
epsilons, 20 Sinkhorn rounds); the GEMM shapes (attention projections, per-expert and shared-expert
MLPs, the LM head) are realistic for these hidden sizes, the expert count and vocabulary are small
so that the weights fit one GPU and are generated in seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: mHC residual streams; the mixes' 24 rows are 4 pre, 4 post and 16 residual-mix logits.
HC = 4
MIX = 2 * HC + HC * HC
MODELS = ("dsv41", "glm5")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """The attention stand-in: its projections as GEMMs (qkv in, output back), no KV cache."""

    heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        _require(min(self.heads, self.kv_heads, self.head_dim) >= 1, f"attention: sizes must be >= 1, got {self}")
        _require(self.heads % self.kv_heads == 0, f"attention: heads {self.heads} not a multiple of kv_heads")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Routed experts (top-k of ``experts``, SwiGLU of ``intermediate``) plus one shared expert."""

    experts: int
    top_k: int
    intermediate: int
    shared_intermediate: int
    routed_scale: float = 1.0

    def __post_init__(self) -> None:
        _require(1 <= self.top_k <= self.experts, f"moe: need 1 <= top_k <= experts, got {self}")
        _require(min(self.intermediate, self.shared_intermediate) >= 1, f"moe: sizes must be >= 1, got {self}")


@dataclass(frozen=True, slots=True)
class MixesConfig:
    """The mHC mixes' constants (both models use the GLM seed's form: sigmoid pre / post, Sinkhorn)."""

    rms_eps: float = 1e-6
    hc_eps: float = 1e-6
    post_mult: float = 2.0
    sinkhorn_repeat: int = 20

    def constants(self) -> dict[str, float | int]:
        """The keyword arguments ``mhc_glm5.bench.baseline.boundary_with`` takes (without ``norm_eps``)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class StackConfig:
    model: str
    hidden: int
    layers: int
    vocab: int
    attention: AttentionConfig
    moe: MoEConfig
    mixes: MixesConfig
    norm_eps: float
    hc: int = HC

    def __post_init__(self) -> None:
        _require(self.model in MODELS, f"model: expected one of {MODELS}, got {self.model!r}")
        _require(self.hc == HC, f"hc: the mixes' layout is for hc = {HC}, got {self.hc}")
        _require(self.layers >= 1 and self.vocab >= 1, f"layers and vocab must be >= 1, got {self}")
        _require(self.hidden % 8 == 0, f"hidden: must be a multiple of 8 (16-byte rows), got {self.hidden}")

    @property
    def sublayers(self) -> int:
        return 2 * self.layers

    @property
    def boundaries_per_step(self) -> int:
        """One boundary after every sublayer (the last one feeds the LM head)."""
        return self.sublayers

    def preset(self, tp: int, gpu: str = "h200") -> str:
        """The fused op's preset for this hidden size (``mhc_dsv41.presets`` / ``mhc_glm5.presets``)."""
        return f"{gpu}-tp{tp}-h{self.hidden}"

    def check_tp(self, tp: int) -> None:
        """Every sharded dimension splits evenly over ``tp`` ranks (16-byte rows in each shard)."""
        a, moe = self.attention, self.moe
        for name, size in (
            ("attention.heads", a.heads),
            ("attention.kv_heads", a.kv_heads),
            ("moe.intermediate", moe.intermediate),
            ("moe.shared_intermediate", moe.shared_intermediate),
        ):
            _require(size % tp == 0, f"{name} = {size} does not split over tp = {tp}")
        for name, size in (
            ("moe.intermediate", moe.intermediate),
            ("moe.shared_intermediate", moe.shared_intermediate),
        ):
            _require((size // tp) % 8 == 0, f"{name} / tp = {size // tp}: must be a multiple of 8 (16-byte rows)")

    def replace(self, **changes) -> StackConfig:
        return dataclasses.replace(self, **changes)


#: DeepSeek-V4.1-style: hidden 5120, 40 query heads / 8 KV heads of 128, 16 experts (top 8) of 1024
#: and a shared expert of 1024, norm_eps 1e-6 (the public DeepSeek-V4 config's, as in
#: the repository's presets.toml).
DSV41 = StackConfig(
    model="dsv41",
    hidden=5120,
    layers=4,
    vocab=4096,
    attention=AttentionConfig(heads=40, kv_heads=8, head_dim=128),
    moe=MoEConfig(experts=16, top_k=8, intermediate=1024, shared_intermediate=1024),
    mixes=MixesConfig(),
    norm_eps=1e-6,
)

#: GLM-5.3-style: hidden 4096, 32 query heads / 8 KV heads of 128, 16 experts (top 8) of 1024 and a
#: shared expert of 1024; the mixes' constants and norm_eps 1e-5 are the glm5 presets'.
GLM5 = StackConfig(
    model="glm5",
    hidden=4096,
    layers=4,
    vocab=4096,
    attention=AttentionConfig(heads=32, kv_heads=8, head_dim=128),
    moe=MoEConfig(experts=16, top_k=8, intermediate=1024, shared_intermediate=1024),
    mixes=MixesConfig(rms_eps=1e-6, hc_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20),
    norm_eps=1e-5,
)

DEFAULTS = {"dsv41": DSV41, "glm5": GLM5}


def default(model: str) -> StackConfig:
    """The embedded default of ``model`` (``"dsv41"`` or ``"glm5"``)."""
    try:
        return DEFAULTS[model]
    except KeyError:
        raise ValueError(f"model: expected one of {MODELS}, got {model!r}") from None


def tiny(model: str) -> StackConfig:
    """A CPU-sized stack of the same structure: hidden 64, vocab 128, 2 layers, 4 experts (top 2)."""
    return default(model).replace(
        hidden=64,
        layers=2,
        vocab=128,
        attention=AttentionConfig(heads=4, kv_heads=2, head_dim=16),
        moe=MoEConfig(experts=4, top_k=2, intermediate=32, shared_intermediate=32),
    )
