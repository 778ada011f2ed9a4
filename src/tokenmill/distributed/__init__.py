"""Tensor parallelism on torch.distributed: one model's weights split over several ranks (processes, one per
device), rank 0 scheduling and sampling, the others computing their shards of every step it describes.

shard.py (which part of each weight a rank holds), group.py (joining the ranks, the collectives), step_message.py
(rank 0's step descriptions), worker.py (the loop of the other ranks), runner.py (rank 0's side), launcher.py
(starting the workers when torchrun did not).
"""
