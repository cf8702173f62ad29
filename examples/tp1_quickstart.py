"""DSV4.1's fused boundary at tp 1 in a few lines: build once, call per layer."""

import torch

from mhc_dsv41 import AllReduceMHC

op = AllReduceMHC.from_preset("h200-tp1-h5120", max_num_tokens=64, device="cuda")
m, hc, hidden = 4, 4, 5120
x = torch.randn(m, hidden, device="cuda").bfloat16()  # the sublayer's (TP-partial) output
residual = torch.randn(m, hc, hidden, device="cuda").bfloat16()  # the hc residual streams
post, pre = torch.rand(m, hc, device="cuda"), torch.rand(m, hc, device="cuda")
comb = torch.softmax(torch.randn(m, hc, hc, device="cuda"), -1)
norm_weight = torch.ones(hidden, device="cuda").bfloat16()
residual_out, layer_input = op(x, residual, post, comb, pre, norm_weight, 1e-6)
print(residual_out.shape, layer_input.shape)  # [4, 4, 5120] and [4, 5120], BF16
