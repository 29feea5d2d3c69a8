"""A prefix cache that survives restarts (`--prefix-cache-dir`): full KV blocks written to disk
and read back on a prefix-cache miss, as a second tier behind the pool's in-memory blocks.

- **What a file is**: one full block, every layer's k and v as the pool stores them, named by
  the block's token-chain hash (kv_manager.block_hash: the hash of its tokens and every block
  before it), in a folder named by a key of everything else the values depend on: the model
  file's identity (its size and the hash of its first and last MiB), the weights' dtype, the KV
  format, the context window (LongRoPE's factors follow it), the tensor-parallel rank and size,
  the pool's block size and FORMAT_VERSION (bumped when the kernels' numbers change). A header
  repeats the key and hash and carries the payload's length and checksum: a file that is
  truncated, corrupt or from another model is ignored with one log line, never used.
- **Writing**: when the KV manager names a full block (seal), the block's bytes are copied at
  once (the block may be handed out again) and written by a background thread, to a temporary
  file renamed into place: a reader never sees half a file, and several processes (replicas)
  may share the folder: two writers of one block write the same bytes, the last rename wins.
- **Size**: at most `max_bytes` of blocks under the key; past it the least recently used files
  (by mtime, touched on each read) are deleted. Each process counts what it sees (a scan at
  start, then its own writes), so replicas sharing a folder may together exceed the cap until
  one of them evicts.
- **Reading**: on a miss in memory the chain continues on disk: each next block found there is
  read into a free block of the pool, which then holds it as if it had been computed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("nanoinfer.engine")

FORMAT_VERSION = 1
MAGIC = b"NIKV"
_HEADER = struct.Struct("<4sI16s16sQ16s")  # magic, version, key, block hash, payload bytes, checksum
SUFFIX = ".kvblock"


def file_identity(path: str | os.PathLike[str]) -> bytes:
    """A model file's identity: its size and a hash of its first and last MiB (a folder: of
    every file in it, by name)."""
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.digest()


def store_key(**parts: object) -> bytes:
    """The folder key: FORMAT_VERSION and every part the cached values depend on."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(parts):
        value = parts[name]
        h.update(f"{name}=".encode() + (value if isinstance(value, bytes) else repr(value).encode()) + b";")
    h.update(f"format={FORMAT_VERSION}".encode())
    return h.digest()


class DiskPrefixCache:
    """read_block(block id) -> the block's bytes; write_block(block id, bytes): the pool's side."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, key: bytes, block_bytes: int,
                 read_block: Callable[[int], bytes], write_block: Callable[[int, bytes], None]):
        self.dir = Path(directory) / key.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key, self.block_bytes, self.max_bytes = key, block_bytes, max_bytes
        self.read_block, self.write_block = read_block, write_block
        self.lock = threading.Lock()
        self.known: dict[bytes, float] = {}  # hash -> mtime, of the files this process believes are there
        for f in self.dir.glob(f"*{SUFFIX}"):
            try:
                self.known[bytes.fromhex(f.name.removesuffix(SUFFIX))] = f.stat().st_mtime
            except (ValueError, OSError):
                continue
        self.pending: set[bytes] = set()
        self.queue: queue.Queue = queue.Queue()
        self.stats = {"written": 0, "read": 0, "rejected": 0, "evicted": 0}
        self.thread = threading.Thread(target=self._writer, name="nanoinfer-prefix-store", daemon=True)
        self.thread.start()

    def path(self, h: bytes) -> Path:
        return self.dir / f"{h.hex()}{SUFFIX}"

    def has(self, h: bytes) -> bool:
        with self.lock:
            return h in self.known

    # --- writing --------------------------------------------------------------------
    def offer(self, h: bytes, block_id: int) -> None:
        """A block the pool has just filled and named: copied now, written in the background."""
        with self.lock:
            if h in self.known or h in self.pending:
                return
            self.pending.add(h)
        self.queue.put((h, self.read_block(block_id)))

    def _writer(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                h, payload = item
                self._write(h, payload)
            except OSError as e:
                logger.warning("prefix cache: could not write a block to %s: %s", self.dir, e)
            finally:
                if item is not None:
                    with self.lock:
                        self.pending.discard(item[0])
                self.queue.task_done()

    def _write(self, h: bytes, payload: bytes) -> None:
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, self.key, h, len(payload),
                              hashlib.blake2b(payload, digest_size=16).digest())
        final = self.path(h)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, final)
        with self.lock:
            self.known[h] = final.stat().st_mtime
            self.stats["written"] += 1
        self._evict()

    def _evict(self) -> None:
        size = _HEADER.size + self.block_bytes
        with self.lock:
            excess = len(self.known) * size - self.max_bytes
            victims = sorted(self.known, key=self.known.get)[:max(0, -(-excess // size))] if excess > 0 else []
            for h in victims:
                del self.known[h]
        for h in victims:
            try:
                self.path(h).unlink()
                self.stats["evicted"] += 1
            except OSError:
                pass

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every block offered so far is on disk."""
        if timeout is None:
            self.queue.join()
            return
        done = threading.Event()
        threading.Thread(target=lambda: (self.queue.join(), done.set()), daemon=True).start()
        done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        self.queue.put(None)

    # --- reading --------------------------------------------------------------------
    def load(self, h: bytes, block_id: int) -> bool:
        """Block `h` read from disk into the pool's block `block_id`; False (the block then
        untouched) when it is gone, or is not a valid block of this key and hash."""
        path = self.path(h)
        try:
            with open(path, "rb") as f:
                data = f.read(_HEADER.size + self.block_bytes + 1)
        except OSError:  # evicted meanwhile (by this process or another sharing the folder)
            with self.lock:
                self.known.pop(h, None)
            return False
        why = self._invalid(data, h)
        if why:
            logger.warning("prefix cache: ignoring %s: %s", path, why)
            with self.lock:
                self.known.pop(h, None)
                self.stats["rejected"] += 1
            return False
        self.write_block(block_id, data[_HEADER.size:])
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        with self.lock:
            self.known[h] = path.stat().st_mtime if path.exists() else 0.0
            self.stats["read"] += 1
        return True

    def _invalid(self, data: bytes, h: bytes) -> str | None:
        if len(data) < _HEADER.size:
            return "truncated header"
        magic, version, key, block_hash, n, checksum = _HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a nanoinfer KV block"
        if version != FORMAT_VERSION:
            return f"format version {version}, not {FORMAT_VERSION}"
        if key != self.key:
            return "written for another model, dtype or configuration"
        if block_hash != h:
            return "its tokens are not the ones its name says"
        if n != self.block_bytes or len(data) != _HEADER.size + n:
            return f"{len(data) - _HEADER.size} bytes of payload where a block is {self.block_bytes}"
        if hashlib.blake2b(data[_HEADER.size:], digest_size=16).digest() != checksum:
            return "checksum mismatch (corrupt)"
        return None
