"""Tensor parallelism on torch.distributed: the process group and its collectives
(parallel.py), one rank's share of a model (sharding.py), and the ranks beside the engine's
(executor.py)."""
