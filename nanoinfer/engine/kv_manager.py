"""The paged KV cache's bookkeeping: pools of blocks, block tables, prefix hashing, forks.

Each KV group (attention/kv_cache.py: the full-attention layers, and each sliding window's
layers) has a pool of `num_blocks` blocks of `block_size` token slots per layer, kept by a
BlockManager; KVCacheManager (at the end) is the scheduler's one door to all of them. A
sequence owns a block table per group (lists of block ids); token i lives in block
table[i // block_size] at slot i % block_size of each. Blocks are reference counted so that

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
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .sequence import KVPlacement


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


NULL_BLOCK = 0  # a windowed group's stand-in for blocks that slid out of its window (kv_cache.py)


class BlockManager:
    """One KV group's pool of blocks (ref counts, names, free lists); KVCacheManager below is
    the scheduler's door to all the groups."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tier: BlockTier | None = None, null_block: bool = False):
        """null_block: block 0 is the group's null block, never handed out; and (a windowed
        group) never-used blocks go before freed ones, as in vLLM: its sequences give blocks
        back while they run, and taking those straight back would evict every prompt's window
        before a second request could hit it. Its pool is window-sized, so its resident memory
        stays small even once all of it has been used."""
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = null_block
        self.free: OrderedDict[int, None] = OrderedDict()  # freed blocks, least recently freed first
        # never handed out (popped from the end: the lowest id first)
        self.unused = list(range(num_blocks - 1, 0 if null_block else -1, -1))
        self.cached: dict[bytes, int] = {}  # hash -> block id, for blocks whose contents are still valid
        self.enable_prefix_caching = enable_prefix_caching
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies the runner must do
        self.tier = tier if enable_prefix_caching else None

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.unused)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - self.null_block - self.num_free

    @property
    def num_blocks(self) -> int:
        """Blocks that can be handed out (the null block not counted)."""
        return len(self.blocks) - self.null_block

    def is_shared(self, bid: int) -> bool:
        return self.blocks[bid].ref_count > 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation ---------------------------------------------------------------
    def _take(self) -> int:
        if self.free and not (self.null_block and self.unused):
            bid = self.free.popitem(last=False)[0]
        else:
            bid = self.unused.pop()
        b = self.blocks[bid]
        if b.hash is not None and self.cached.get(b.hash) == bid:
            del self.cached[b.hash]  # evicted: its contents are about to be overwritten
        b.hash, b.ref_count = None, 1
        return bid

    def _ref(self, bid: int) -> None:
        if self.null_block and bid == NULL_BLOCK:
            return
        b = self.blocks[bid]
        if b.ref_count == 0:
            del self.free[bid]
        b.ref_count += 1

    def _unref(self, bid: int) -> None:
        if self.null_block and bid == NULL_BLOCK:
            return
        b = self.blocks[bid]
        b.ref_count -= 1
        if b.ref_count == 0:
            self.free[bid] = None  # most recently freed: evicted last

    def allocate_slots(self, table: list[int], num_computed: int, num_tokens: int) -> list[int] | None:
        """Room in `table` for num_tokens more tokens after the first num_computed, copying the
        block written into first if it is shared. Returns the blocks newly placed in the table,
        or None, with nothing changed, when the pool has too few free blocks."""
        if self.blocks_to_place(table, num_computed, num_tokens) > self.num_free:
            return None
        idx = num_computed // self.block_size
        new = []
        if idx < len(table) and self.is_shared(table[idx]):
            self.prepare_write(table, num_computed)
            new.append(table[idx])
        first = len(table)
        self.ensure_slots(table, num_computed + num_tokens)
        return new + table[first:]

    def blocks_to_place(self, table: list[int], num_computed: int, num_tokens: int) -> int:
        """Free blocks allocate_slots takes: the new ones, and a copy of a shared block written into."""
        idx = num_computed // self.block_size
        cow = idx < len(table) and self.is_shared(table[idx])
        return max(0, self.blocks_needed(num_computed + num_tokens) - len(table)) + cow

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

    def name(self, bid: int, h: bytes) -> None:
        """A block just filled, named by its prefix hash for later hits (and offered to the tier)."""
        b = self.blocks[bid]
        if b.hash is None:
            b.hash = h
            self.cached.setdefault(h, bid)
            if self.tier is not None:
                self.tier.offer(h, bid)

    def lookup(self, h: bytes) -> int | None:
        """The block named h in this pool (not the tier): its id, or None."""
        return self.cached.get(h)

    def has(self, h: bytes) -> bool:
        return h in self.cached or (self.tier is not None and self.tier.has(h))

    def take_named(self, h: bytes) -> int | None:
        """A reference to the block named h: the cached one, or a free one read from the tier
        (then named and cached as if computed here); None if neither can give it."""
        bid = self.cached.get(h)
        if bid is not None:
            self._ref(bid)
            return bid
        if self.tier is None or not self.num_free or not self.tier.has(h):
            return None
        bid = self._take()
        if not self.tier.load(h, bid):
            self._unref(bid)
            return None
        self.blocks[bid].hash = h
        self.cached[h] = bid
        return bid

    def fork(self, table: list[int]) -> list[int]:
        """A new block table sharing every block of `table`."""
        for bid in table:
            self._ref(bid)
        return list(table)

    def free_table(self, table: list[int]) -> None:
        for bid in reversed(table):  # the tail is freed first, so it is evicted before the shared prefix
            self._unref(bid)
        table.clear()

    def slide(self, table: list[int], first_block: int) -> None:
        """A windowed group: the blocks before logical block `first_block` (no longer in the
        window) given back, the null block in their place."""
        for i in range(min(first_block, len(table))):
            if table[i] != NULL_BLOCK:
                self._unref(table[i])
                table[i] = NULL_BLOCK


@dataclass(frozen=True)
class GroupSpec:
    """A KV group as the manager sees it (attention/kv_cache.py's KVGroup): its window and pool."""

    window: int | None  # None: every key is kept
    num_blocks: int


class KVCacheManager:
    """The scheduler's only door to blocks (vLLM v1's KVCacheManager): one BlockManager per KV
    group, one block table per group in each sequence's KVPlacement, all indexed alike by
    logical block (token i in block i // block_size of every table).

    A windowed group gives back the blocks its window has slid past (`allocate_slots`: before
    a step, the blocks wholly before the step's first query's window), so it holds about
    window + chunk tokens a sequence however long the sequence grows.

    Prefix caching names a full block by its token-chain hash in every group that holds it. A
    prompt's cached prefix is the longest run of m full blocks such that the full groups hold
    blocks 0..m-1 and each windowed group holds the blocks its window needs at position
    m * block_size (those overlapping its last `window` - 1 positions): the local layers'
    keys are restored from the window's blocks, cached while their sequence ran or read from
    the second tier; blocks before the window stay the null block."""

    def __init__(self, groups: list[GroupSpec], block_size: int, enable_prefix_caching: bool = True,
                 tiers: list[BlockTier | None] | None = None):
        self.specs = groups
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        tiers = tiers or [None] * len(groups)
        self.groups = [BlockManager(g.num_blocks, block_size, enable_prefix_caching, tier, null_block=g.window is not None)
                       for g, tier in zip(groups, tiers)]
        self.stats = CacheStats()

    # --- figures ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)

    @property
    def num_free(self) -> int:
        return sum(g.num_free for g in self.groups)

    @property
    def num_used(self) -> int:
        return sum(g.num_used for g in self.groups)

    # --- the doors ----------------------------------------------------------------------
    def _window_start(self, window: int, position: int) -> int:
        """The first logical block a query at `position` reads in a group with this window."""
        return max(0, position - window + 1) // self.block_size

    def _longest_hit(self, hashes: list[bytes]) -> int:
        """The most leading blocks of `hashes` (all held by the full groups) that every windowed
        group can give too (the class docstring)."""
        m = len(hashes)  # the full groups hold all of them (allocate_prompt)
        while m > 0 and not all(
                all(group.has(hashes[i]) for i in range(self._window_start(spec.window, m * self.block_size), m))
                for spec, group in zip(self.specs, self.groups) if spec.window is not None):
            m -= 1
        return m

    def allocate_prompt(self, kv: KVPlacement, tokens: list[int], lookup: bool = True) -> int:
        """Fill a sequence's empty block tables with the cached prefix of `tokens` (full blocks
        only, and never the whole prompt: the last token must run to give logits). Returns the
        number of tokens whose KV is already there. lookup=False: none (a request that wants
        every prompt position's logits computes them all, as vLLM does)."""
        assert not any(kv.block_tables)
        kv.block_tables = [[] for _ in self.groups]
        bs, m = self.block_size, 0
        if lookup and self.enable_prefix_caching:
            full = [g for spec, g in zip(self.specs, self.groups) if spec.window is None]
            hashes, parent = [], None
            for i in range((len(tokens) - 1) // bs):  # the chain as far as every full group holds it
                parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
                if not all(g.has(parent) for g in full):
                    break
                hashes.append(parent)
            from_tier: set[int] = set()  # logical blocks read back from the second tier (in any group)
            while True:  # a block can fail to come (a tier's gone or corrupt, no free block): then a shorter prefix
                m = self._longest_hit(hashes)
                failed = self._take_prefix(kv, hashes, m, from_tier)
                if failed is None:
                    break
                hashes = hashes[:failed]
            self.stats.tier_hits += sum(i < m for i in from_tier) * bs
        self.stats.prefix_queries += len(tokens)
        self.stats.prefix_hits += m * bs
        return m * bs

    def _take_prefix(self, kv: KVPlacement, hashes: list[bytes], m: int, from_tier: set[int]) -> int | None:
        """References to the m-block prefix in every group's table: None, or the logical block
        that could not be had (then nothing is kept; blocks read from the tier stay cached, and
        their indices in `from_tier`)."""
        for spec, group, table in zip(self.specs, self.groups, kv.block_tables):
            first = 0 if spec.window is None else self._window_start(spec.window, m * self.block_size)
            table.extend([NULL_BLOCK] * first)
            for i in range(first, m):
                in_memory = group.lookup(hashes[i]) is not None
                bid = group.take_named(hashes[i])
                if bid is None:
                    self.free(kv)
                    kv.block_tables = [[] for _ in self.groups]
                    return i
                if not in_memory:
                    from_tier.add(i)
                table.append(bid)
        return None

    def allocate_slots(self, kv: KVPlacement, num_tokens: int) -> bool:
        """Room in every group for num_tokens more tokens after kv.num_computed (copying a
        shared block about to be written), windowed groups first giving back the blocks they
        no longer read. False, with no block taken, when a pool has too few free blocks."""
        if not kv.block_tables:
            kv.block_tables = [[] for _ in self.groups]
        start = kv.num_computed
        for spec, group, table in zip(self.specs, self.groups, kv.block_tables):
            if spec.window is not None:
                group.slide(table, self._window_start(spec.window, start))
        if not all(group.blocks_to_place(table, start, num_tokens) <= group.num_free
                   for group, table in zip(self.groups, kv.block_tables)):
            return False
        for group, table in zip(self.groups, kv.block_tables):
            placed = group.allocate_slots(table, start, num_tokens)
            if placed is None:  # cannot happen: every group's room was checked above
                raise RuntimeError("KV manager: a group's free blocks changed while placing a step")
        return True

    def free(self, kv: KVPlacement) -> None:
        for group, table in zip(self.groups, kv.block_tables):
            group.free_table(table)

    def fork(self, parent: KVPlacement, child: KVPlacement) -> None:
        """The child shares every block of the parent (copy-on-write when either writes one)."""
        child.block_tables = [group.fork(table) for group, table in zip(self.groups, parent.block_tables)]
        child.block_hashes = list(parent.block_hashes)
        child.num_computed = parent.num_computed

    def seal(self, kv: KVPlacement, tokens: list[int]) -> None:
        """Name each block that has become full (all its tokens computed) by its prefix hash,
        in every group that still holds it, so later requests can reuse it."""
        bs, hashes = self.block_size, kv.block_hashes
        if not self.enable_prefix_caching or kv.num_computed // bs <= len(hashes):
            return
        while len(hashes) < kv.num_computed // bs:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
            for group, table in zip(self.groups, kv.block_tables):
                if not (group.null_block and table[i] == NULL_BLOCK):
                    group.name(table[i], hashes[i])

    def take_pending_copies(self) -> list[list[tuple[int, int]]]:
        """Each group's copy-on-write copies decided since the last call (the runner does them first)."""
        return [group.take_pending_copies() for group in self.groups]
