"""How much memory this process may still take, and the KV pool's default size from it.

Three limits can bind, and a pool sized from only one of them failed under the others:

- MemAvailable (/proc/meminfo): what the machine can give without swapping.
- The address-space limits (`ulimit -v`, `prlimit --as`: RLIMIT_AS; and RLIMIT_DATA, which
  counts private writable mappings): every mapping counts at its full size when it is made,
  touched or not, so the pool's mapping must fit whole. torch alone maps ~0.6 GB.
- The cgroup's limit (a container's `memory.max`, v2, or `memory.limit_in_bytes`, v1), less
  what the cgroup already uses: the kernel's OOM killer acts on it, not on MemAvailable.

The rule (stated in docs/serving.md): the pool is room for `max_num_seqs` sequences at the
full context (a sliding-window group counting its window only), but at most a quarter of
min(MemAvailable, the cgroup's headroom), and at most half of the address-space headroom
after RESERVE (thread stacks, kernels, activations, the grammar engine). A pool is resident
only as far as sequences have written it (anonymous mappings on the CPU), but the prefix
cache keeps freed blocks' contents, so under varied load
the whole pool becomes resident: RSS levels off at weights + pool + the runtime.
"""
from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidRequestError

RESERVE = 1 << 30  # address space kept for what the engine maps after the pool
MEMORY_SHARE = 4  # the pool takes at most 1/MEMORY_SHARE of the memory at hand
ADDRESS_SHARE = 2  # ... and at most 1/ADDRESS_SHARE of the address space left after RESERVE
_UNKNOWN = 8 << 30  # MemAvailable when /proc/meminfo cannot be read


def _status_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes ("VmSize", "VmData"); 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def available_memory() -> int:
    """MemAvailable from /proc/meminfo; 8 GiB if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return _UNKNOWN


def address_space_headroom() -> int | None:
    """Bytes this process may still map under RLIMIT_AS and RLIMIT_DATA; None if neither is set."""
    room = []
    for limit, used in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            room.append(max(0, soft - _status_bytes(used)))
    return min(room) if room else None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_headroom(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes the process's cgroup (and each cgroup above it) may still take before its memory
    limit; None if no limit is set."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    room = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy; every level's memory.max binds
            d = root / path.lstrip("/")
            while True:
                limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
                if limit is not None:
                    room.append(max(0, limit - (used or 0)))
                if d == root or root not in d.parents:
                    break
                d = d.parent
        elif "memory" in controllers.split(","):  # v1
            d = root / "memory" / path.lstrip("/")
            limit, used = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            if limit is not None and limit < (1 << 60):  # v1 writes "no limit" as a huge number
                room.append(max(0, limit - (used or 0)))
    return min(room) if room else None


@dataclass(frozen=True)
class MemoryBudget:
    available: int  # MemAvailable
    cgroup: int | None  # the cgroup's headroom
    address_space: int | None  # RLIMIT_AS / RLIMIT_DATA headroom

    @classmethod
    def now(cls) -> MemoryBudget:
        return cls(available_memory(), cgroup_headroom(), address_space_headroom())

    def pool_limit(self, share: float = 1.0) -> int:
        """The most a default KV pool may take; `share` of it for one of several replicas."""
        memory = min(self.available, self.cgroup if self.cgroup is not None else self.available)
        limit = int(memory * share) // MEMORY_SHARE
        if self.address_space is not None:
            limit = min(limit, int(max(0, self.address_space - RESERVE) * share) // ADDRESS_SHARE)
        return limit

    def binding(self) -> str:
        """Which limit binds, in words, for the messages that name it."""
        if self.address_space is not None and (self.address_space - RESERVE) // ADDRESS_SHARE < \
                min(self.available, self.cgroup or self.available) // MEMORY_SHARE:
            return f"the address-space limit (ulimit -v: {self.address_space >> 20} MiB left)"
        if self.cgroup is not None and self.cgroup < self.available:
            return f"the cgroup's memory limit ({self.cgroup >> 20} MiB left)"
        return f"the available memory ({self.available >> 20} MiB)"



@dataclass(frozen=True)
class GroupCost:
    """A KV group's layers as the pool's size rule counts them (attention/kv_cache.kv_groups)."""

    bytes_per_token: int  # K and V of one token in the group's layers
    window: int | None = None  # a windowed group holds at most window - 1 + a step's chunk tokens a sequence


def group_blocks(group: GroupCost, context: int, block_size: int, chunk: int) -> int:
    """The blocks one sequence holds at most in this group at `context` tokens: all of them,
    or (windowed) the ones overlapping the window behind a step's first query and the step's
    `chunk` tokens, one more for a window that does not start on a block."""
    blocks = -(-context // block_size)
    if group.window is None:
        return blocks
    return min(blocks, -(-(group.window - 1 + chunk) // block_size) + 1)


def sequence_bytes(groups: list[GroupCost], context: int, block_size: int, chunk: int) -> int:
    """One sequence at `context` tokens, in whole blocks of every group."""
    return sum(group_blocks(g, context, block_size, chunk) * block_size * g.bytes_per_token for g in groups)


def default_kv_pool_bytes(groups: list[GroupCost], context: int, max_num_seqs: int, limit: int,
                          block_size: int = 1, chunk: int = 0) -> int:
    """Room for max_num_seqs sequences at the full context (in whole blocks), at most `limit`
    (MemoryBudget.pool_limit)."""
    return min(sequence_bytes(groups, context, block_size, chunk) * max_num_seqs, limit)


def _split(groups: list[GroupCost], pool_bytes: int, context: int, block_size: int, chunk: int,
           max_num_seqs: int) -> list[int]:
    """Each group's blocks from the pool's bytes. A windowed group gets as many blocks as one
    pool for every layer would have had (so no mix of long and short sequences fits fewer than
    before), but at least one sequence's window and at most max_num_seqs windows (more is never
    used); the full groups take the rest in proportion to a token's bytes in each (no full
    group: the windowed groups do)."""
    block_bytes = [g.bytes_per_token * block_size for g in groups]
    one_pool = pool_bytes // sum(block_bytes)
    blocks = [group_blocks(g, context, block_size, chunk) for g in groups]  # one sequence in each: the floor
    rest = pool_bytes - sum(n * b for n, b in zip(blocks, block_bytes))
    for i, g in enumerate(groups):
        if g.window is not None:
            extra = max(0, min((max_num_seqs - 1) * blocks[i], one_pool - blocks[i], rest // block_bytes[i]))
            blocks[i] += extra
            rest -= extra * block_bytes[i]
    takers = [i for i, g in enumerate(groups) if g.window is None] or list(range(len(groups)))
    weight = sum(block_bytes[i] for i in takers)
    for i in takers:
        blocks[i] += rest // weight
    return [n + (g.window is not None) for n, g in zip(blocks, groups)]  # a windowed group's null block


@dataclass(frozen=True)
class KVPoolPlan:
    num_blocks: list[int]  # each group's pool, a windowed group's null block included
    max_model_len: int
    note: str | None  # one line for the log when the context was clamped


def plan_kv_pool(groups: list[GroupCost], block_size: int, declared_context: int, max_model_len: int | None,
                 pool_bytes: int | None, max_num_seqs: int, budget: MemoryBudget, share: float = 1.0,
                 chunk: int = 0) -> KVPoolPlan:
    """The pools' blocks and the context window. A windowed group counts at its window (`chunk`
    being the most tokens a step gives a sequence); _split shares the bytes among the groups.
    A window asked for (`max_model_len`) that the pool cannot hold for one sequence is refused;
    the model's declared one is clamped to what the pool holds, with a note saying so.
    Raises InvalidRequestError (one line, naming the limit)."""
    context = min(max_model_len or declared_context, declared_context)
    chosen = pool_bytes is not None
    if not chosen:
        pool_bytes = default_kv_pool_bytes(groups, context, max_num_seqs, budget.pool_limit(share), block_size, chunk)
    where = "--kv-cache-memory" if chosen else budget.binding()
    one_block = sequence_bytes(groups, block_size, block_size, chunk)
    if pool_bytes < one_block:
        raise InvalidRequestError(f"no room for a KV cache: {pool_bytes >> 20} MiB (set by {where}) is less than one "
                                  f"block of {block_size} tokens ({one_block >> 10} KiB)", "kv_cache_memory")
    capacity = context
    if sequence_bytes(groups, context, block_size, chunk) > pool_bytes:  # the longest context in whole blocks that fits
        lo, hi = 1, -(-context // block_size)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if sequence_bytes(groups, mid * block_size, block_size, chunk) <= pool_bytes else (lo, mid - 1)
        capacity = lo * block_size
    num_blocks = _split(groups, pool_bytes, min(capacity, context), block_size, chunk, max_num_seqs)
    if context <= capacity:
        return KVPoolPlan(num_blocks, context, None)
    if max_model_len is not None and max_model_len <= declared_context:
        raise InvalidRequestError(f"max_model_len={max_model_len} does not fit: the KV pool holds {capacity} tokens "
                                  f"({pool_bytes >> 20} MiB, set by {where}); lower --max-model-len or raise "
                                  f"--kv-cache-memory", "max_model_len")
    note = (f"context window clamped to {capacity} tokens: the model declares {declared_context}, and the KV pool "
            f"({pool_bytes >> 20} MiB, set by {where}) holds {capacity}; --max-model-len or --kv-cache-memory to choose")
    return KVPoolPlan(num_blocks, capacity, note)
