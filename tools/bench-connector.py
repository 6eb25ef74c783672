#!/usr/bin/python3
"""Load throughput of the kvfold connector into CPU KV block tensors, against plain torch copies of
the same bytes measured in the same run.

  cold  a retention-pool miss as the connector does it for host tensors: open the kvf file once,
        and read each layer's chunks (Fletcher32, values and digests checked), copying the layer
        into the blocks and into a reused staging buffer while it is in cache (one pass; a helper
        thread reads the next layer meanwhile when a core is idle, as the connector decides; the
        file is in the OS page cache: it was just written); the same on one thread and with the
        read-ahead, whatever the load; also the connector's path for device
        tensors (--parts layer ranges read by a helper thread, each copied into the blocks while
        the next is read), the same without the overlap, and into a fresh buffer per load (how
        cold loads worked first)
  warm  a retention-pool hit: the copy into the blocks only
  plain read+copy  the baseline of a cold load: the file's bytes read into a reused buffer
                   (readinto), then one copy_ of the K/V bytes into a tensor of the blocks' size
  torch copy_      dst.copy_(src) of one contiguous tensor of the same bytes (memcpy speed)
  torch scatter    the same K/V written into the same blocks with index_put_ (what a pure-torch
                   connector would do)
The last line is `cold vs plain read+copy: R` (higher is better, 1 = as fast as the baseline).

Run with Debian's python after building the extension (cmake target kvfold_pyext):
  /usr/bin/python3 tools/bench-connector.py [--ext-dir build/python/kvfold] [--tokens 2048]
      [--layers 36 --kv-heads 8 --head-dim 128] [--layout flash_attn|flashinfer|cpu] [--repeat 5]
"""
import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_kvfold(ext_dir):
    src = os.path.join(REPO, "connector", "kvfold")
    spec = importlib.util.spec_from_file_location("kvfold", os.path.join(src, "__init__.py"),
                                                  submodule_search_locations=[src, ext_dir])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvfold"] = mod
    spec.loader.exec_module(mod)
    return mod


def median_time(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ext-dir", default=os.path.join(REPO, "build", "python", "kvfold"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layout", default="blocks_first", choices=["kv_first", "blocks_first", "cpu", "packed"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--parts", type=int, default=4, help="layer ranges of the pipelined cold load (load_parts)")
    a = ap.parse_args()

    kvfold = import_kvfold(a.ext_dir)
    import numpy as np
    import torch
    from kvfold import _kvfold
    from kvfold.blocks import copy_to_blocks, host_destination, put_slots
    from kvfold.loader import one_pass_load, pipelined_load, spare_core
    from kvfold.pool import RetentionPool

    L, C, H, D, bs = a.layers, a.tokens, a.kv_heads, a.head_dim, a.block_size
    nbytes = 2 * L * C * H * D * 2
    n_blocks = -(-C // bs)
    total_blocks = 2 * n_blocks + 1
    rng = np.random.default_rng(0)
    ids = [int(x) for x in rng.permutation(np.arange(1, total_blocks))[:n_blocks]]
    tmp = tempfile.mkdtemp(prefix="kvfold-bench-")
    path = os.path.join(tmp, "bench.kvf")
    k = rng.standard_normal((L, C, H, D), dtype=np.float32)
    v = rng.standard_normal((L, C, H, D), dtype=np.float32)
    _kvfold.write(path, {"model_fingerprint": "ab" * 16, "document_digest": "cd" * 16, "n_doc_tokens": 4 * C,
                         "n_tokens": C, "method": "fold", "budget": 0.25, "lambda": 0.01, "dtype": "bfloat16",
                         "n_layers": L, "kv_heads": H, "head_dim": D}, k.tobytes(), v.tobytes())
    del k, v
    shape = {"kv_first": (2, total_blocks, bs, H, D), "blocks_first": (total_blocks, 2, bs, H, D),
             "cpu": (2, total_blocks, H, bs, D), "packed": (total_blocks, H, bs, 2 * D)}[a.layout]
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(L)]
    dests = [host_destination(t, i) for i, t in enumerate(caches)]

    pool = RetentionPool(limit_bytes=4 * nbytes)

    def copy_layers(data, l0, l1):
        copy_to_blocks(data, "bfloat16", L, C, H, D, caches[l0:l1], a.layout, ids, bs, 0, C,
                       destinations=dests[l0:l1], layers=range(l0, l1))

    def load(evict, parts=None, overlap=None):  # what the connector does; parts: the device tensors' path
        if evict:
            pool.evict()
        copied = []

        def cold(buf):
            copied.append(1)
            if parts is None:
                return one_pass_load(path, "bfloat16", buf, dests, a.layout, ids, bs, 0, C, overlap=overlap), buf
            return pipelined_load(path, "bfloat16", buf, L, lambda h, l0, l1: copy_layers(buf, l0, l1), parts=parts)
        e, _ = pool.get(path, "bfloat16", cold, nbytes)
        if not copied:
            copy_layers(e.data, 0, L)
        pool.release(e)

    def load_fresh():  # the cold load before staging buffers: a new buffer per load, faulted in page by page
        pool.evict()
        e, _ = pool.get(path, "bfloat16", lambda: _kvfold.load(path, "bfloat16"))
        copy_to_blocks(e.data, "bfloat16", L, C, H, D, caches, a.layout, ids, bs, 0, C, destinations=dests)
        pool.release(e)

    t_fresh = median_time(load_fresh, a.repeat)
    load(True)  # the first load creates the staging buffer; the timed ones reuse it
    t_cold = median_time(lambda: load(True), a.repeat)
    t_one = median_time(lambda: load(True, overlap=False), a.repeat)
    t_ahead = median_time(lambda: load(True, overlap=True), a.repeat)
    t_pipe = median_time(lambda: load(True, a.parts), a.repeat)
    t_serial = median_time(lambda: load(True, 1), a.repeat)
    load(False)
    t_warm = median_time(lambda: load(False), a.repeat)

    file_bytes = os.path.getsize(path)
    staging = bytearray(file_bytes)  # reused, faulted in by the first read
    kv_src = torch.frombuffer(staging, dtype=torch.uint8, count=nbytes).view(torch.bfloat16)
    kv_dst = torch.zeros(nbytes // 2, dtype=torch.bfloat16)

    def plain():
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(staging)
        assert got == file_bytes
        kv_dst.copy_(kv_src)
    plain()
    t_plain = median_time(plain, a.repeat)

    src = torch.frombuffer(bytearray(nbytes), dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t_copy = median_time(lambda: dst.copy_(src), a.repeat)

    e, _ = pool.get(path, "bfloat16", lambda buf: _kvfold.load(path, "bfloat16", out=buf), nbytes)
    whole = torch.frombuffer(e.data, dtype=torch.bfloat16).view(2, L, C, H, D)
    pos = torch.arange(C)
    slots = torch.as_tensor(ids)[pos // bs] * bs + pos % bs
    kb, off = slots // bs, slots % bs

    def scatter():
        for layer, t in enumerate(caches):
            put_slots(t, a.layout, kb, off, whole[:, layer])
    t_scatter = median_time(scatter, a.repeat)

    gb = nbytes / 1e9
    print(f"kvfold connector load: {L} layers x {C} tokens x {H} kv heads x {D}, bf16, {gb * 1e3:.0f} MB, "
          f"layout {a.layout}, blocks of {bs}, median of {a.repeat}, torch threads {torch.get_num_threads()}")
    print(f"{'path':<34}{'time ms':>10}{'GB/s':>9}{'vs copy_':>10}{'vs scatter':>12}")
    for name, t in (("cold: kvf file -> blocks", t_cold), ("cold, one thread (no read-ahead)", t_one),
                    ("cold, next layer read ahead", t_ahead),
                    (f"cold, {a.parts} ranges read, then copied", t_pipe),
                    ("cold, read all then copy", t_serial),
                    ("cold, fresh buffer per load", t_fresh), ("warm: retention pool -> blocks", t_warm),
                    ("plain read + copy_ (baseline)", t_plain), ("torch copy_ (contiguous)", t_copy),
                    ("torch scatter (index_put_)", t_scatter)):
        print(f"{name:<34}{t * 1e3:>10.1f}{gb / t:>9.2f}{t_copy / t:>9.2f}x{t_scatter / t:>11.2f}x")
    print(f"warm vs copy_: {t_copy / t_warm:.2f}")
    print(f"cold with a fresh buffer per load vs plain read+copy: {t_plain / t_fresh:.2f}")
    print(f"cold reading all layers before copying vs plain read+copy: {t_plain / t_serial:.2f}")
    print(f"cold in {a.parts} pipelined layer ranges (device tensors' path) vs plain read+copy: {t_plain / t_pipe:.2f}")
    print(f"cold on one thread (no read-ahead) vs plain read+copy: {t_plain / t_one:.2f}")
    print(f"cold with the next layer read ahead on a helper thread vs plain read+copy: {t_plain / t_ahead:.2f}")
    print(f"the connector's choice here: {'read-ahead' if spare_core() else 'one thread'} (load average "
          f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} cores)")
    print(f"cold vs plain read+copy: {t_plain / t_cold:.2f}")
    os.remove(path)
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
