"""The paged KV cache: a fixed pool of blocks, block tables, prefix hashing, forks.

Memory is `num_blocks` blocks of `block_size` token slots per layer. A sequence owns a
block table (a list of block ids); token i lives in block table[i // block_size] at
slot i % block_size. Blocks are reference counted so that

- n samples of one prompt share the prompt's blocks (fork), and only a partially
  filled last block is copied when a sample first writes to it (copy-on-write);
- a full block is named by a hash of (parent block's hash, its tokens), so a later
  request with the same prefix reuses it instead of recomputing (prefix caching).
  A freed block keeps its hash and contents until it is handed out again; free
  blocks are handed out least recently freed first (LRU eviction).

Blocks that have been used before are handed out before blocks never used. On the CPU the
pool is an anonymous mapping whose pages become resident when first written, so resident
memory follows the most blocks in use at once, not the pool's size. (Handing out unused
blocks first made a server's RSS climb by every new prompt's blocks until the whole pool was
resident: 428 MB to 2 GB over 2,200 mixed requests, issue 25.) The price: a prefix stays
cached while fewer blocks than the pool's unused rest have been handed out since it was freed.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol


class BlockTier(Protocol):
    """A second place full blocks are kept, past the pool (prefix_store.DiskPrefixCache): the KV
    manager names blocks, the tier moves their bytes."""

    def has(self, h: bytes) -> bool: ...
    def offer(self, h: bytes, block_id: int) -> None: ...
    def load(self, h: bytes, block_id: int) -> bool: ...


@dataclass(slots=True)
class Block:
    id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and its tokens are known


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


@dataclass
class CacheStats:
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found
    tier_hits: int = 0  # of which found in the second tier (disk) and read back

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tier: BlockTier | None = None):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict()  # freed blocks, least recently freed first
        self.unused = list(range(num_blocks - 1, -1, -1))  # never handed out (popped from the end: 0, 1, ...)
        self.cached: dict[bytes, int] = {}  # hash -> block id, for blocks whose contents are still valid
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = CacheStats()
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies the runner must do
        self.tier = tier if enable_prefix_caching else None

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.unused)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - self.num_free

    def is_shared(self, bid: int) -> bool:
        return self.blocks[bid].ref_count > 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation ---------------------------------------------------------------
    def _take(self) -> int:
        bid = self.free.popitem(last=False)[0] if self.free else self.unused.pop()
        b = self.blocks[bid]
        if b.hash is not None and self.cached.get(b.hash) == bid:
            del self.cached[b.hash]  # evicted: its contents are about to be overwritten
        b.hash, b.ref_count = None, 1
        return bid

    def _ref(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count == 0:
            del self.free[bid]
        b.ref_count += 1

    def _unref(self, bid: int) -> None:
        b = self.blocks[bid]
        b.ref_count -= 1
        if b.ref_count == 0:
            self.free[bid] = None  # most recently freed: evicted last

    def match_prefix(self, tokens: list[int]) -> list[int]:
        """Cached blocks holding a prefix of `tokens` (full blocks only, and never the whole
        prompt: the last prompt token must be computed to get logits)."""
        if not self.enable_prefix_caching:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((len(tokens) - 1) // bs):
            parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
            bid = self.cached.get(parent)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate_prompt(self, table: list[int], tokens: list[int], lookup: bool = True) -> int:
        """Fill an empty block table with the cached prefix of `tokens`. Returns the
        number of tokens whose KV is already there. lookup=False: none (a request that wants
        every prompt position's logits computes them all, as vLLM does)."""
        assert not table
        hits = self.match_prefix(tokens) if lookup else []
        for bid in hits:
            self._ref(bid)
        table.extend(hits)
        if lookup and self.tier is not None:
            self._read_tier(table, tokens)
        self.stats.prefix_queries += len(tokens)
        self.stats.prefix_hits += len(table) * self.block_size
        return len(table) * self.block_size

    def _read_tier(self, table: list[int], tokens: list[int]) -> None:
        """The cached prefix continued from the second tier: each next full block found there
        read into a free block, which is then named and cached as if computed here."""
        bs = self.block_size
        parent = None
        for i in range(len(table)):
            parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
        for i in range(len(table), (len(tokens) - 1) // bs):
            parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
            if not self.num_free or not self.tier.has(parent):
                return
            bid = self._take()
            if not self.tier.load(parent, bid):
                self._unref(bid)
                return
            self.blocks[bid].hash = parent
            self.cached[parent] = bid
            table.append(bid)
            self.stats.tier_hits += bs

    def allocate_slots(self, table: list[int], num_computed: int, num_tokens: int) -> list[int] | None:
        """The scheduler's door for a step (vLLM v1's name): room in `table` for num_tokens more
        tokens after the first num_computed, copying the block written into first if it is
        shared. Returns the blocks newly placed in the table, or None, with nothing changed,
        when the pool has too few free blocks."""
        idx = num_computed // self.block_size
        cow = idx < len(table) and self.is_shared(table[idx])
        need = max(0, self.blocks_needed(num_computed + num_tokens) - len(table)) + cow
        if need > self.num_free:
            return None
        new = []
        if cow:
            self.prepare_write(table, num_computed)
            new.append(table[idx])
        first = len(table)
        self.ensure_slots(table, num_computed + num_tokens)
        return new + table[first:]

    def ensure_slots(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` to hold num_tokens tokens (the caller checked there is room)."""
        while len(table) * self.block_size < num_tokens:
            table.append(self._take())

    def prepare_write(self, table: list[int], position: int) -> None:
        """Before writing at `position`: copy-on-write if its block is shared."""
        idx = position // self.block_size
        bid = table[idx]
        if self.is_shared(bid):
            new = self._take()
            self.pending_copies.append((bid, new))
            self._unref(bid)
            table[idx] = new

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies decided since the last call; the runner does them before the forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def seal_full_blocks(self, table: list[int], tokens: list[int], num_computed: int, hashes: list[bytes]) -> None:
        """Name each block that has become full (all its tokens computed) by its prefix hash,
        so later requests can reuse it. `hashes` is the sequence's running hash list."""
        if not self.enable_prefix_caching or num_computed // self.block_size <= len(hashes):
            return
        bs = self.block_size
        while len(hashes) < num_computed // bs:
            i = len(hashes)
            h = block_hash(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs])
            hashes.append(h)
            b = self.blocks[table[i]]
            if b.hash is None:
                b.hash = h
                self.cached.setdefault(h, b.id)
                if self.tier is not None:
                    self.tier.offer(h, b.id)

    def fork(self, table: list[int]) -> list[int]:
        """A new block table sharing every block of `table`."""
        for bid in table:
            self._ref(bid)
        return list(table)

    def free_table(self, table: list[int]) -> None:
        for bid in reversed(table):  # the tail is freed first, so it is evicted before the shared prefix
            self._unref(bid)
        table.clear()
