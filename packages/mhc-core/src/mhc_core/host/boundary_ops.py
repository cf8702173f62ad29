"""A model's fused-boundary custom ops, generated from one declaration (issue #50).

A fused op has three call forms: a plain ``[M, hidden]`` input ``x``, an unfinalized MoE output
(``MOE_INPUTS``) and the collect after a ``publish``. Each form is two custom ops: the BF16 one,
returning ``(residual_out, layer_input)``, and the FP8 one (``<name>_fp8``), which also takes the
op's ``layer_input_format`` and ``layer_input_bf16`` and returns ``(residual_out, q, scales,
layer_input)`` (``mhc_core.host.calls.layer_input.LayerInput.op_outputs``). ``boundary_ops`` defines the
six from the model's parameter names (the collective's, after the input: the first is the residual
streams ``[M, hc, hidden]``): each schema (state mutated, then the handle, the inputs, the
parameters), the implementation (the op's own call under its lock, ``mhc_core.host.library.run``)
and the fake one, whose outputs follow from the arguments alone: ``residual_out`` like the residual
streams, the layer input like the publish input (``x``, the MoE shared output) or, for a collect,
new ``[M, hidden]`` from the residual streams' device (``LayerInput.allocate``). ``BoundaryOps.boundary``
and ``BoundaryOps.collect`` are the typed wrappers' bodies: the op's own call in eager mode
(``mhc_core.host.library.eager``), else the custom op its format and input pick.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import library
from .calls.layer_input import LayerInput
from .calls.moe import MoEOutput

#: The MoE input's parameters, as ``mhc::all_reduce_moe`` and ``mhc::publish_moe`` name them.
MOE_INPUTS = ("gemm2_permuted", "expert_weights", "index", "shared_output")
#: What an FP8 op takes after the parameters.
FP8_OPTIONS = (("layer_input_format", str), ("layer_input_bf16", bool))
#: A stand-in op with no ``layer_input`` (only ``state`` and ``handle``: the tracing tests'): BF16.
_BF16 = LayerInput()

#: The op's outputs -> what its custom op returns (a hook: ``BoundaryOps.returned``).
Returned = Callable[[int, tuple[Tensor, ...]], tuple[Tensor, ...]]


@dataclass(frozen=True)
class CallForm:
    """One call form's two custom ops (``bf16``, ``fp8``) and the inputs before the parameters."""

    inputs: tuple[str, ...]
    bf16: library.CustomOp
    fp8: library.CustomOp


def _schema(function: Callable[..., Any], params: Sequence[tuple[str, type]], returns: int) -> None:
    """Give ``function`` (``*args``) the signature a custom op's schema is inferred from."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    function.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, kind, annotation=annotation) for name, annotation in params],
        return_annotation=tuple[(Tensor,) * returns],  # type: ignore[misc]
    )


class BoundaryOps:
    """A model's six custom ops (module docstring), registered when made.

    ``name``: the model's prefix (``mhc::<name>_boundary``, ...); ``params``: the parameters after
    the input, all tensors but ``floats``; ``moe``: the MoE form's op name (``<name>_<moe>``);
    ``returned(handle, outputs)``: the op's outputs as the custom op returns them, called under the
    op's lock (GLM's keeps the side-stream outputs for its join); None: as the op returns them.
    """

    def __init__(
        self,
        name: str,
        params: Sequence[str],
        *,
        floats: Sequence[str] = (),
        moe: str,
        returned: Returned | None = None,
    ) -> None:
        self.params = tuple(params)
        self.returned = returned
        self._typed = [(param, float if param in floats else Tensor) for param in self.params]
        self.plain = self._form(f"{name}_boundary", ("x",), like=0)
        self.moe = self._form(f"{name}_{moe}", MOE_INPUTS, like=MOE_INPUTS.index("shared_output"))
        self.collect_form = self._form(f"{name}_collect", (), like=None)

    # ---------------------------------------------------------------- registration
    def _form(self, name: str, inputs: tuple[str, ...], like: int | None) -> CallForm:
        count = len(inputs)

        def call(op: Any, args: tuple[Any, ...]) -> tuple[Tensor, ...]:
            params = args[count : count + len(self.params)]
            if not count:
                return tuple(op.collect(*params))
            return tuple(op(args[0] if count == 1 else MoEOutput(*args[:count]), *params))

        def returned(handle: int, outputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            return outputs if self.returned is None else self.returned(handle, outputs)

        def bf16(state: Tensor, handle: int, *args: Any) -> tuple[Tensor, ...]:
            return library.run(handle, state, lambda op: returned(handle, call(op, args)))

        def fp8(state: Tensor, handle: int, *args: Any) -> tuple[Tensor, ...]:
            wanted = LayerInput(args[-2], args[-1])

            def checked(op: Any) -> tuple[Tensor, ...]:
                # The fake implementation assumed the call's format: the op must write it.
                if op.layer_input != wanted:
                    raise ValueError(
                        f"layer_input_format: the op behind handle {handle} writes {op.layer_input.format!r} "
                        f"(layer_input_bf16={op.layer_input.keep_bf16}), the call asks for {wanted.format!r} "
                        f"(layer_input_bf16={wanted.keep_bf16})"
                    )
                return wanted.op_outputs(returned(handle, call(op, args)))

            return library.run(handle, state, checked)

        def outputs(layer_input: LayerInput, args: tuple[Any, ...]) -> tuple[Tensor, ...]:
            residual = args[count]
            m, hidden = residual.shape[0], residual.shape[2]
            publish_input = None if like is None else args[like]
            return (torch.empty_like(residual), *layer_input.allocate(publish_input, residual, m, hidden))

        def bf16_fake(state: Tensor, handle: int, *args: Any) -> tuple[Tensor, ...]:
            return outputs(_BF16, args)

        def fp8_fake(state: Tensor, handle: int, *args: Any) -> tuple[Tensor, ...]:
            layer_input = LayerInput(args[-2], args[-1])
            return layer_input.op_outputs(outputs(layer_input, args))

        head = [("state", Tensor), ("handle", int), *((input, Tensor) for input in inputs), *self._typed]
        _schema(bf16, head, 2)
        _schema(fp8, [*head, *FP8_OPTIONS], 4)
        ops = CallForm(inputs, library.custom_op(name)(bf16), library.custom_op(f"{name}_fp8")(fp8))
        ops.bf16.register_fake(bf16_fake)
        ops.fp8.register_fake(fp8_fake)
        return ops

    @property
    def ops(self) -> dict[str, library.CustomOp]:
        """Every custom op made, by name."""
        forms = (self.plain, self.moe, self.collect_form)
        return {op.name: op for form in forms for op in (form.bf16, form.fp8)}

    # ---------------------------------------------------------------- the wrappers
    def boundary(self, op: Any, x: Tensor | MoEOutput, *params: Any) -> tuple[Tensor, ...]:
        """``op(x, *params)`` through the custom ops (``x``: a tensor or a ``MoEOutput``): what the
        op's call returns (through ``returned``)."""
        if library.eager(op, params[0]):  # the op's own call (``mhc_core.host.library.eager``)
            if self.returned is None:
                return op(x, *params)  # type: ignore[no-any-return]
            # The call and its hand-over under the op's lock, as the custom op. `with`: an interrupt as
            # acquire() returns would otherwise leave the lock held (``mhc_core.host.calls.eager._call``).
            with op._lock:
                return self.returned(op.handle, op(x, *params))
        layer_input = getattr(op, "layer_input", _BF16)
        if isinstance(x, MoEOutput):
            form = self.moe
            inputs: tuple[Any, ...] = (
                x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx, x.shared_output,
            )  # fmt: skip
        else:
            form, inputs = self.plain, (x,)
        if layer_input.quantizes:
            fp8 = form.fp8(op.state, op.handle, *inputs, *params, layer_input.format, layer_input.keep_bf16)
            return layer_input.call_outputs(fp8)
        return form.bf16(op.state, op.handle, *inputs, *params)

    def collect(self, op: Any, *params: Any) -> tuple[Tensor, ...]:
        """``op.collect(*params)`` through the custom ops (after ``mhc_core.host.library.publish_input``),
        returning as ``boundary`` does."""
        if library.eager(op, params[0]):
            if self.returned is None:
                return op.collect(*params)  # type: ignore[no-any-return]
            with op._lock:
                return self.returned(op.handle, op.collect(*params))
        layer_input = getattr(op, "layer_input", _BF16)
        form = self.collect_form
        if layer_input.quantizes:
            fp8 = form.fp8(op.state, op.handle, *params, layer_input.format, layer_input.keep_bf16)
            return layer_input.call_outputs(fp8)
        return form.bf16(op.state, op.handle, *params)
