"""DSV4.1's MoE boundary: ``finalize`` folds the top-k reduction and the shared expert into the publish."""

import torch

from mhc_dsv41 import AllReduceMHC

op = AllReduceMHC.from_preset("h200-tp1-h5120", max_num_tokens=64, device="cuda")
m, hc, hidden, top_k = 8, 4, 5120, op.top_k
rows = m * top_k
gemm2 = torch.randn(rows, hidden, device="cuda").bfloat16()  # unweighted GEMM2 rows, permuted order
weights = torch.rand(m, top_k, device="cuda") / top_k  # FP32 routing weights, already scaled
index = torch.randperm(rows, device="cuda").int().view(m, top_k)  # -1: an expert this rank lacks
index[:, -1] = -1
shared = torch.randn(m, hidden, device="cuda").bfloat16()
residual = torch.randn(m, hc, hidden, device="cuda").bfloat16()
post, pre = torch.rand(m, hc, device="cuda"), torch.rand(m, hc, device="cuda")
comb = torch.softmax(torch.randn(m, hc, hc, device="cuda"), -1)
norm_weight = torch.ones(hidden, device="cuda").bfloat16()
residual_out, layer_input = op.finalize(gemm2, weights, index, shared, residual, post, comb, pre, norm_weight, 1e-6)
print(residual_out.shape, layer_input.shape)
