"""Distributed plumbing, no training loop: the process group and every exchange between ranks.

    group        set-up and tear-down of the process group, rank/device/backend, threads, sums over ranks
    host_sums    sums over the ranks of one host through shared memory (CPU, gloo)
    host_leases  trainings at once on one host share its cores and GPUs
    preemption   a stop signal becomes a stop at a step every rank agrees on
    batchnorm    BatchNorm over the global batch (CPU SyncBatchNorm, the exact one), convert_sync_batchnorm
    exact        world-size-exact arithmetic (distributed.exact)
"""
