"""Tensor parallelism's base on torch.distributed: which part of each weight a rank holds (shard.py), joining the
ranks and their collectives (group.py), and the shared-memory sum of ranks on one machine (shm.py). The model and
the runner see it only as a plan and a `reduce`; running the ranks is executor/'s job, above the runner.
"""
