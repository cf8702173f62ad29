"""A compiled step captured in a CUDA graph over static inputs, replayed with new ones.

torch's recipe, as the fused ops' contract allows it: warm-up calls on a side stream (they also
trigger the compile), then the capture on a fresh graph. Calling a ``Graphed`` copies each given
input into its static twin unless it *is* that twin (the routing: the router graph's own outputs
feed both path graphs, so nothing is copied) and replays; the outputs are the static tensors the
capture returned, overwritten by the next replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class Graphed:
    def __init__(self, function: Callable[..., Any], *static: Any, warmup: int = 2) -> None:
        self.static = static
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                function(*static)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = function(*static)
        torch.cuda.synchronize()

    def __call__(self, *args: Any) -> Any:
        for static, given in zip(tree_leaves(self.static), tree_leaves(args), strict=True):
            if given is not static:
                static.copy_(given)
        self.graph.replay()
        return self.outputs
