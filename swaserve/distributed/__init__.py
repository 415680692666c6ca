"""Past one process: tensor parallelism on torch.distributed (group.py, shard.py, workers.py)."""
