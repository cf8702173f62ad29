"""A demo decoder on the fused ops (issue #19): two mHC stacks with random weights and embedded configs.

Modules, one job each: ``config`` (the embedded defaults), ``model`` (the stacks, pluggable
boundaries), ``boundaries`` (unfused, fused, emulated), ``reference`` (FP64 boundaries),
``tolerance`` (the bounds and how they reach the logits), ``check`` (the checked decode),
``graphs`` (CUDA-graph capture), ``isolated`` (the per-boundary saving), ``report`` (table, JSON,
plot), ``run`` (the CLI: ``python3 -m demo``, ``nox -s demo``).

Importing ``demo`` imports nothing heavy; ``demo.model`` needs torch and ``mhc_core`` (for
``MoEOutput``), the fused path the model packages' ``library`` modules, the run a GPU.
"""
