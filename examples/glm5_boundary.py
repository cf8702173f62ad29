"""GLM-5.3's boundary: plain and MoE input, and join() before post_out / comb_out are read."""

import torch

from mhc_glm5 import AllReduceMhcBoundary, MoEOutput

op = AllReduceMhcBoundary.from_preset("h200-tp1-h4096", max_num_tokens=64, device="cuda")
m, hc, hidden, top_k = 8, 4, 4096, op.top_k
residual = torch.randn(m, hc, hidden, device="cuda").bfloat16()
post = torch.rand(m, hc, 1, device="cuda") * 2
comb = torch.softmax(torch.randn(m, hc, hc, device="cuda"), -1)
fn = (torch.randn(24, hc * hidden, device="cuda") * 0.02).bfloat16()
scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda")
norm_weight = torch.ones(hidden, device="cuda").bfloat16()

x = torch.randn(m, hidden, device="cuda").bfloat16()
residual, post, comb, layer_input = op(x, residual, post, comb, fn, scale, base, norm_weight)
op.join()  # post / comb are finished on a side stream: complete once joined

# The next boundary with the MoE's output left unfinalized: the top-k reduction runs in the publish.
rows = m * top_k
moe = MoEOutput(
    gemm2_permuted=torch.randn(rows, hidden, device="cuda").bfloat16(),
    expert_weights=torch.rand(m, top_k, device="cuda") / top_k,
    expanded_idx_to_permuted_idx=torch.randperm(rows, device="cuda").int().view(m, top_k),
    shared_output=torch.randn(m, hidden, device="cuda").bfloat16(),
)
residual, post, comb, layer_input = op(moe, residual, post, comb, fn, scale, base, norm_weight)
op.join()
print(post.shape, comb.shape, bool(torch.isfinite(layer_input.float()).all()))
