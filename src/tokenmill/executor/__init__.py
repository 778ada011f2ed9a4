"""Running one model over several tensor-parallel ranks, above the runner: rank 0's side (runner.py: it describes
each step to the others and runs its own shard), the other ranks' loop (worker.py), their start-up (startup.py,
launcher.py when torchrun did not start them, heartbeat.py: a rank that stops answering during start-up) and the
step descriptions rank 0 sends (step_message.py). The base it stands on is distributed/.
"""
