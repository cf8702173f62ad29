"""CUDA graphs: one graph per batch size on one op, captured in any order, replayed with eager calls between."""

import torch

from mhc_glm5 import AllReduceMhcBoundary

op = AllReduceMhcBoundary.from_preset("h200-tp1-h4096", max_num_tokens=64, device="cuda")
hc, hidden = 4, 4096


def inputs(m: int) -> list[torch.Tensor]:
    return [
        torch.randn(m, hidden, device="cuda").bfloat16(),
        torch.randn(m, hc, hidden, device="cuda").bfloat16(),
        torch.rand(m, hc, 1, device="cuda") * 2,
        torch.softmax(torch.randn(m, hc, hc, device="cuda"), -1),
        (torch.randn(24, hc * hidden, device="cuda") * 0.02).bfloat16(),
        torch.rand(3, device="cuda") + 0.5,
        torch.randn(24, device="cuda"),
        torch.ones(hidden, device="cuda").bfloat16(),
    ]


graphs = {}
for m in (1, 8, 32):  # capture right after construction: no warm-up needed
    static = inputs(m)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = op(*static)
        op.join()  # inside a capture, join before it ends
    graphs[m] = (graph, static, outputs)

for m in (8, 1, 32, 8):
    graph, static, outputs = graphs[m]
    for tensor, fresh in zip(static, inputs(m), strict=True):
        tensor.copy_(fresh)  # new data into the graph's inputs
    graph.replay()
    op(*inputs(5))  # an eager call of another size between replays
    op.join()
torch.cuda.synchronize()
print({m: tuple(graphs[m][2][3].shape) for m in graphs})
