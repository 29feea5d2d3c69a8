"""Running a model split over N processes: rank 0 is the engine's own process (scheduler,
sampling, detokenising, the server); ranks 1..N-1 are workers that hold their share of the
weights and of the KV pool and run each forward in step with rank 0.

Per step, rank 0 broadcasts what its ModelRunner built (token ids, positions, the metadata
its attention backend prepared: slots, block tables, context lengths) and the step's block
copies; every rank runs the forward with the same backend class (WorkerSetup names it), so
reads that metadata as rank 0 does, and the forward's collectives (an all-reduce after
attention and after the MLP, an all-gather of the logits) keep them in lock step. Nothing
else crosses a process boundary.

Workers start as local processes (spawned here, with the group on a local TCP port), or are
started by `torchrun` on one or several machines (`torchrun ... -m nanoinfer serve ...`:
every rank but 0 becomes a worker in `nanoinfer.cli.main`); then the group is torchrun's
(env://) and the model path must name the same file on every machine.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch

from .. import threads
from ..attention import AttentionBackend, PagedKVCache, layer_params
from ..attention.kv_cache import KVGroup
from ..models.batch import ForwardBatch
from ..models.builder import load_model
from . import parallel
from .sharding import rank_config, shard_model

log = logging.getLogger(__name__)


@dataclass
class WorkerSetup:
    """What a worker needs to build its share: rank 0 broadcasts it once the group is up."""
    model: str
    dtype: torch.dtype | None
    overrides: dict | None
    kv_groups: list[KVGroup]  # rank 0's (kv_cache.kv_groups)
    num_blocks: list[int]  # each group's pool
    block_size: int
    kv_dtype: torch.dtype
    context: int  # the engine's max_model_len (LongRoPE picks its factors from it)
    attention_backend: type[AttentionBackend]  # rank 0's (pickled by name: a worker imports its module)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


class TensorParallelExecutor:
    def __init__(self, world: int, device: str = "cpu"):
        self.world = world
        self.procs: list[subprocess.Popen] = []
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != world:
                raise RuntimeError(f"torchrun started {os.environ['WORLD_SIZE']} processes for tensor_parallel_size={world}")
            parallel.init(0, world, "env://", device)
            return
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        # each rank an equal share of this process's threads (--threads, else the physical cores)
        per_rank = threads.share(torch.get_num_threads(), world) if device == "cpu" else 0
        if per_rank:
            threads.use(per_rank)
            log.info("tensor parallel: %d ranks x %d CPU thread%s", world, per_rank, "s" * (per_rank > 1))
        # fresh interpreters (not forks of this one, with its threads; and not multiprocessing's
        # spawn, which re-imports the caller's main module)
        self.procs = [subprocess.Popen([sys.executable, "-m", "nanoinfer.distributed.worker", str(rank), str(world),
                                        init_method, device, str(per_rank)]) for rank in range(1, world)]
        parallel.init(0, world, init_method, device)

    def setup(self, setup: WorkerSetup) -> None:
        parallel.broadcast(setup)

    def step(self, block_copies: list[list[tuple[int, int]]], forward: ForwardBatch) -> None:
        """Hand the workers this step (then run the same forward here)."""
        parallel.broadcast(("step", block_copies, _fields(forward)))

    def close(self) -> None:
        if parallel.initialized():
            parallel.broadcast(("stop",))
            parallel.shutdown()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def _fields(forward: ForwardBatch) -> tuple:
    return forward.input_ids, forward.positions, forward.attn_metadata, forward.logits_indices, forward.prev_ids


def worker_main(rank: int, world: int, init_method: str, device: str = "cpu", cpu_threads: int = 0) -> None:
    """A worker rank: join the group, build its share from rank 0's setup, then run every step
    rank 0 broadcasts until told to stop."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the engine's process
    if device == "cpu":
        threads.use(cpu_threads or threads.share(None, world))
    parallel.init(rank, world, init_method, device)
    serve_steps(rank, world, device)


def serve_steps(rank: int, world: int, device: str) -> None:
    setup: WorkerSetup = parallel.broadcast()
    loaded = load_model(setup.model, dtype=setup.dtype, device=device, overrides=setup.overrides,
                        transform=lambda model, config: shard_model(model, config, rank, world))
    model = loaded.model
    if hasattr(model, "set_context"):
        model.set_context(setup.context)
    cfg = rank_config(loaded.config, world)
    cache = PagedKVCache.allocate(setup.kv_groups, setup.num_blocks, setup.block_size, cfg.num_kv_heads, cfg.head_dim,
                                  setup.kv_dtype, device)
    backend = setup.attention_backend(layer_params(cfg), cache)
    while True:
        msg: Any = parallel.broadcast()
        if msg[0] == "stop":
            break
        _, copies, (ids, positions, meta, logits_indices, prev_ids) = msg
        cache.copy_blocks(copies)
        with torch.inference_mode():
            model(ForwardBatch(ids, positions, backend, meta, logits_indices, prev_ids))
    parallel.shutdown()


def worker_from_torchrun() -> int:
    """A rank other than 0 under torchrun: serve rank 0's steps."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    parallel.init(rank, world, "env://", device)
    serve_steps(rank, world, device)
    return 0

