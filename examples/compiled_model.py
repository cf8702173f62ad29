"""A torch.compile'd model calling the fused boundaries as custom ops (``torch.ops.mhc``), no graph break."""

import torch

from mhc_glm5 import AllReduceMhcBoundary, library

op = AllReduceMhcBoundary.from_preset("h200-tp1-h4096", max_num_tokens=64, device="cuda")
m, hc, hidden = 8, 4, 4096
residual = torch.randn(m, hc, hidden, device="cuda").bfloat16()
post = torch.rand(m, hc, 1, device="cuda") * 2
comb = torch.softmax(torch.randn(m, hc, hc, device="cuda"), -1)
fn = (torch.randn(24, hc * hidden, device="cuda") * 0.02).bfloat16()
scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda")
norm_weight = torch.ones(hidden, device="cuda").bfloat16()
mlp = torch.nn.Linear(hidden, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_(False)


@torch.compile(fullgraph=True)
def two_layers(x, residual, post, comb):
    for _ in range(2):
        residual, hidden_states = library.boundary(op, x, residual, post, comb, fn, scale, base, norm_weight)
        x = mlp(hidden_states)  # the next sublayer overlaps the side-stream mixes
        post, comb = library.join(op, residual)  # post / comb come from the join op only
    return residual, post, comb, x


with torch.inference_mode():  # the custom ops are for inference: they have no autograd formula
    out = two_layers(torch.randn(m, hidden, device="cuda").bfloat16(), residual, post, comb)
print([tuple(t.shape) for t in out])
