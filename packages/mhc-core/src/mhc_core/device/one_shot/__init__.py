"""The one-shot protocol's own kernels: every rank publishes its whole row into every rank's
mailbox (``mhc_core.device.publish``), then each polls its tp fragments and sums them
(``collective``: the plain all-reduce; a model's boundary kernel does the same, then its epilogue).
"""
