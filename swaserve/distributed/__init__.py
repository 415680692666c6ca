"""Past one process: tensor parallelism on torch.distributed (group.py, workers.py; the
slices of the checkpoint a rank holds are checkpoint/shard.py)."""
