"""Cold loads: a kvf file into the KV blocks, and into a buffer the retention pool keeps.

one_pass_load (host tensors): one open, then layer by layer: the layer's chunks are read into a
scratch of one layer and checked (sums, values, digests), and the layer is copied into the blocks
and into the buffer while it is still in cache, all in C without the GIL. When a core is idle
(spare_core: the load average leaves one) a helper thread reads the next layer meanwhile; on a
busy machine the handoff at every layer waits for the scheduler and costs more than it hides
(docs/connector.md), so the load stays on one thread.

pipelined_load (any tensors): the file's layers are read in a few ranges by one helper thread (the
HDF5 library is used from that thread only), and each range is copied into the KV blocks by the
caller's thread while the next range is read.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _kvfold


def spare_core() -> bool:
    """A core idle beside this thread: the last minute's load average, which counts the loading
    thread itself, leaves most of one (0.75) for the helper."""
    try:
        return os.getloadavg()[0] + 0.75 <= (os.cpu_count() or 1)
    except OSError:  # no load average on this system
        return False


def layer_ranges(n_layers: int, parts: int) -> List[Tuple[int, int]]:
    """[l0, l1) ranges covering 0..n_layers-1 in `parts` nearly equal pieces (fewer if short)."""
    parts = max(1, min(parts, n_layers))
    cuts = [n_layers * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def pipelined_load(path: str, dtype: str, buf: Any, n_layers: int,
                   on_layers: Callable[[Dict[str, Any], int, int], None], *, model_fingerprint: Optional[str] = None,
                   kv_heads: int = -1, head_dim: int = -1, parts: int = 4,
                   heads: Tuple[int, int] = (0, -1), head_major: bool = False) -> Tuple[Dict[str, Any], Any]:
    """Decode path into buf ([2, n_layers, C, kv_heads, head_dim] in dtype, or
    [2, n_layers, kv_heads, C, head_dim] with head_major: the file's chunks land in place), calling
    on_layers(header, l0, l1) as soon as layers [l0, l1) are in buf; (header, buf) at the end.
    Only KV heads [h0, h1) = heads are read (a tensor-parallel rank's; h1 = -1: every head); the
    other heads' places in buf are left as they were. A failure in any range raises it, and the
    ranges after it are not read."""
    ranges = layer_ranges(n_layers, parts)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfold-load") as ex:
        futs = [ex.submit(_kvfold.load, path, dtype, model_fingerprint, n_layers, kv_heads, head_dim, buf, r,
                            tuple(heads), head_major)
                for r in ranges]
        try:
            header = None
            for (l0, l1), fut in zip(ranges, futs):
                header, _ = fut.result()
                on_layers(header, l0, l1)
        finally:
            for fut in futs:
                fut.cancel()
    return header, buf


def one_pass_load(path: str, dtype: str, buf: Any, destinations: List[Any], layout: str, block_ids: List[int],
                  block_size: int, t0: int, t1: int, *, model_fingerprint: Optional[str] = None, n_layers: int = -1,
                  kv_heads: int = -1, head_dim: int = -1, heads: Tuple[int, int] = (0, -1),
                  payload_digest: Optional[str] = None, cp: Tuple[int, int, int] = (1, 0, 1),
                  overlap: Optional[bool] = None) -> Dict[str, Any]:
    """Decode path into buf ([2, n_layers, C, kv_heads, head_dim] in dtype, as load() gives; only
    heads `heads` are written) and tokens [t0, t1) into the host tensors described by destinations
    (blocks.host_destination of each, holding those heads), a layer at a time; the header.
    payload_digest: the file must still be the one scheduled. overlap: a helper thread reads the
    next layer while this one is copied (False: the same on one thread; None: when spare_core())."""
    if overlap is None:
        overlap = spare_core()
    return _kvfold.load_blocks(path, dtype, buf, destinations, layout, list(block_ids), block_size, t0, t1,
                               model_fingerprint, n_layers, kv_heads, head_dim, tuple(heads), payload_digest, *cp,
                               overlap)
