"""tp 2 under torchrun, on a TP subgroup (not WORLD):

    torchrun --standalone --nproc-per-node 2 examples/tp2_torchrun.py

Every rank builds the op collectively and makes the same calls with the same M.
"""

import os

import torch
import torch.distributed as dist

from mhc_dsv41 import AllReduceMHC

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # NVLink multicast stays opt-in
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
tp_group = dist.new_group(list(range(dist.get_world_size())))  # an engine's TP group
op = AllReduceMHC.from_preset("h200-tp2-h5120", max_num_tokens=64, device="cuda", group=tp_group)

m, hc, hidden = 4, 4, 5120
generator = torch.Generator("cuda").manual_seed(0)  # the same streams and mixes on every rank
residual = torch.randn(m, hc, hidden, device="cuda", generator=generator).bfloat16()
post = torch.rand(m, hc, device="cuda", generator=generator)
pre = torch.rand(m, hc, device="cuda", generator=generator)
comb = torch.softmax(torch.randn(m, hc, hc, device="cuda", generator=generator), -1)
norm_weight = torch.ones(hidden, device="cuda").bfloat16()
x = torch.randn(m, hidden, device="cuda").bfloat16()  # this rank's partial sum
residual_out, layer_input = op(x, residual, post, comb, pre, norm_weight, 1e-6)
gathered = [torch.empty_like(layer_input) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, layer_input, group=tp_group)
assert all(torch.equal(g.view(torch.int16), gathered[0].view(torch.int16)) for g in gathered), "ranks differ"
print(f"rank {rank}: layer_input {tuple(layer_input.shape)}, bitwise equal on every rank")
op.close()
dist.destroy_process_group()
