"""The retention pool: decoded caches kept in host memory between requests (DESIGN.md "Reuse").

An entry is one kvf file decoded into the KV cache's dtype, [2, n_layers, C, kv_heads, head_dim],
ready to copy into blocks. The pool holds at most `limit_bytes`; when a new entry does not fit,
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
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple


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


Key = Tuple[str, int, int, int, str]


class RetentionPool:
    def __init__(self, limit_bytes: int, half_life: int = 1000):
        self.limit_bytes = int(limit_bytes)
        self.half_life = max(1, int(half_life))
        self._entries: Dict[Key, Entry] = {}
        self._tick = 0
        self.bytes = 0
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "not_retained": 0}

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(path: str, dtype: str) -> Key:
        st = os.stat(path)
        return (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, dtype)

    def _decayed_hits(self, e: Entry) -> float:
        return e.hits * 0.5 ** ((self._tick - e.last_tick) / self.half_life)

    def value(self, e: Entry) -> float:
        h = self._decayed_hits(e)
        return (h + 1.0) / (h + 2.0) * e.reload_s / max(1, e.pages)

    def get(self, path: str, dtype: str, load: Callable[[], Tuple[Dict[str, Any], Any]]) -> Tuple[Entry, bool]:
        """The decoded cache of path (load() -> (header, buffer) on a miss); (entry, hit)."""
        self._tick += 1
        k = self.key(path, dtype)
        e = self._entries.get(k)
        if e is not None:
            e.hits = self._decayed_hits(e) + 1.0
            e.last_tick = self._tick
            self.stats["hits"] += 1
            return e, True
        self.stats["misses"] += 1
        t = time.perf_counter()
        header, data = load()
        reload_s = time.perf_counter() - t
        nbytes = len(data) if not hasattr(data, "nbytes") else int(data.nbytes)
        pages = (int(header["n_tokens"]) + 15) // 16
        e = Entry(header, data, dtype, nbytes, pages, reload_s, 0.0, self._tick)
        if nbytes > self.limit_bytes:
            self.stats["not_retained"] += 1
            return e, False
        self._make_room(nbytes)
        self._entries[k] = e
        self.bytes += nbytes
        return e, False

    def _make_room(self, nbytes: int) -> None:
        while self._entries and self.bytes + nbytes > self.limit_bytes:
            victim = min(self._entries, key=lambda k: self.value(self._entries[k]))
            self.bytes -= self._entries.pop(victim).nbytes
            self.stats["evictions"] += 1

    def evict(self, path: Optional[str] = None) -> None:
        """Drop every entry (or those of one file)."""
        for k in list(self._entries):
            if path is None or k[0] == os.path.realpath(path):
                self.bytes -= self._entries.pop(k).nbytes

    def entries(self) -> Dict[str, float]:
        """realpath -> current value (for tests and diagnostics)."""
        return {k[0]: self.value(e) for k, e in self._entries.items()}
