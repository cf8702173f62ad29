"""The benchmarks' shared harness, for the repository's ``benchmarks`` CLI and the suites model packages
declare (``Model.benchmark_suites``, ``Model.benchmark_case``): records and the timing context
(``records``), CUDA-graph timing (``timing``), byte floors (``floors``), the unfused baselines
(``baselines``), the host suite's steps (``host``) and what the generic suites need of a model
(``case``). It lives in mhc-core, not in ``benchmarks/``, because the model packages' suites ship in
their wheels and ``benchmarks/`` does not. It names no model.
"""

#: The decode sizes of the suites that measure small-M effects (the --m values up to 64).
SMALL_M = 64
