"""The retention pool: decoded caches kept in host memory between requests (docs/connector.md).

An entry is one kvf file decoded into the KV cache's dtype, [2, n_layers, C, kv_heads, head_dim]
(only the heads its loader read are filled: a tensor-parallel rank's), ready to copy into blocks. The pool holds at most `limit_bytes`; when a new entry does not fit,
entries are evicted lowest value first, where

    value = probability_of_reuse * reload_seconds / pages

  reload_seconds  the measured time of this entry's cold load (read, verify, decode);
  pages           its size in 16-token blocks (what evicting it frees);
  probability_of_reuse  (h + 1) / (h + 2) with h the entry's hit count, decayed by half every
                  `half_life` pool lookups since its last hit (recent, frequent use counts most;
                  a fresh entry starts at 1/2).

An entry larger than the whole limit is returned but not kept. Keys include the file's inode,
size and mtime, so a replaced file is never served from a stale entry. One pool per process
(per vLLM worker); not thread-safe (vLLM calls the connector from one thread).

Decoded caches live in staging buffers (Staging): anonymous memory, backed by huge pages where
the kernel allows, touched once when created, and reused when an entry is evicted or was not
retained, so a cold load writes into memory that is already mapped instead of faulting in a fresh
buffer page by page.
"""
from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple


class Staging:
    """Reusable, pre-faulted buffers. take(n) returns a memoryview of n bytes (from the smallest
    free buffer that holds them, else a new one); give(view) hands it back. At most `keep` free
    buffers are kept (the largest)."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._free: list = []   # [mmap]
        self._owner: Dict[int, mmap.mmap] = {}  # id(view) -> its mmap
        self.stats = {"new": 0, "reused": 0}

    @staticmethod
    def _new(n: int) -> mmap.mmap:
        m = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # transparent huge pages unavailable
                pass
        page = mmap.PAGESIZE
        view = memoryview(m)
        for off in range(0, len(m), page):  # pre-fault (a huge page at a time where they apply)
            view[off] = 0
        view.release()
        return m

    def take(self, n: int) -> memoryview:
        fits = [m for m in self._free if len(m) >= n]
        if fits:
            m = min(fits, key=len)
            self._free.remove(m)
            self.stats["reused"] += 1
        else:
            m = self._new(n)
            self.stats["new"] += 1
        view = memoryview(m)[:n]
        self._owner[id(view)] = m
        return view

    def give(self, view: Any) -> None:
        m = self._owner.pop(id(view), None)
        if m is None:
            return
        self._free.append(m)
        self._free.sort(key=len)
        del self._free[:-self.keep or len(self._free)]


@dataclass
class Entry:
    header: Dict[str, Any]
    data: Any                 # buffer: [2, n_layers, C, kv_heads, head_dim] in dtype
    dtype: str
    nbytes: int
    pages: int
    reload_s: float
    hits: float = 0.0
    last_tick: int = 0
    retained: bool = True


Key = Tuple[str, int, int, int, str, Tuple[int, int]]


class RetentionPool:
    def __init__(self, limit_bytes: int, half_life: int = 1000, staging: Optional[Staging] = None):
        self.limit_bytes = int(limit_bytes)
        self.staging = staging or Staging()
        self.half_life = max(1, int(half_life))
        self._entries: Dict[Key, Entry] = {}
        self._tick = 0
        self.bytes = 0
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "not_retained": 0}

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(path: str, dtype: str, heads: Tuple[int, int] = (0, -1)) -> Key:
        st = os.stat(path)
        return (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, dtype, tuple(heads))

    def _decayed_hits(self, e: Entry) -> float:
        return e.hits * 0.5 ** ((self._tick - e.last_tick) / self.half_life)

    def value(self, e: Entry) -> float:
        h = self._decayed_hits(e)
        return (h + 1.0) / (h + 2.0) * e.reload_s / max(1, e.pages)

    def get(self, path: str, dtype: str, load: Callable[..., Tuple[Dict[str, Any], Any]],
            nbytes: Optional[int] = None, heads: Tuple[int, int] = (0, -1)) -> Tuple[Entry, bool]:
        """The decoded cache of path; (entry, hit). On a miss, load(buffer) -> (header, data) when
        nbytes is given (buffer: nbytes of staging memory to decode into), else load(). heads: the
        KV heads the load decodes (an entry holding other heads is another entry). Call
        release(entry) when done with an entry's data."""
        self._tick += 1
        k = self.key(path, dtype, heads)
        e = self._entries.get(k)
        if e is not None:
            e.hits = self._decayed_hits(e) + 1.0
            e.last_tick = self._tick
            self.stats["hits"] += 1
            return e, True
        self.stats["misses"] += 1
        t = time.perf_counter()
        buf = self.staging.take(nbytes) if nbytes is not None else None
        try:
            header, data = load(buf) if buf is not None else load()
        except BaseException:
            if buf is not None:
                self.staging.give(buf)
            raise
        reload_s = time.perf_counter() - t
        nbytes = len(data) if not hasattr(data, "nbytes") else int(data.nbytes)
        pages = (int(header["n_tokens"]) + 15) // 16
        e = Entry(header, data, dtype, nbytes, pages, reload_s, 0.0, self._tick)
        if nbytes > self.limit_bytes:
            self.stats["not_retained"] += 1
            e.retained = False
            return e, False
        self._make_room(nbytes)
        self._entries[k] = e
        self.bytes += nbytes
        return e, False

    def release(self, e: Entry) -> None:
        """Done with e's data: a buffer not retained goes back to the staging buffers."""
        if not e.retained:
            self.staging.give(e.data)

    def _make_room(self, nbytes: int) -> None:
        while self._entries and self.bytes + nbytes > self.limit_bytes:
            victim = min(self._entries, key=lambda k: self.value(self._entries[k]))
            self._drop(victim)
            self.stats["evictions"] += 1

    def _drop(self, k: Key) -> None:
        e = self._entries.pop(k)
        self.bytes -= e.nbytes
        self.staging.give(e.data)

    def evict(self, path: Optional[str] = None) -> None:
        """Drop every entry (or those of one file)."""
        for k in list(self._entries):
            if path is None or k[0] == os.path.realpath(path):
                self._drop(k)

    def entries(self) -> Dict[str, float]:
        """realpath -> current value (for tests and diagnostics)."""
        return {k[0]: self.value(e) for k, e in self._entries.items()}
