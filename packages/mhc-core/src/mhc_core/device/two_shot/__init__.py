"""The two-shot protocol's own kernels: a reduce-scatter (the scatter publish,
``mhc_core.device.publish`` with ``PublishConfig.scatter``), then ``reduce``: each rank sums its
slice of every rank's row and gathers it to every rank, whose boundary (compiled for tp = 1) reads
the whole reduced row. The protocol, stage by stage: ``reduce``'s docstring.
"""
