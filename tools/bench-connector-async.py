#!/usr/bin/python3
"""Step time of the other requests while cold caches load: load_mode "sync" against "async", on
vLLM's real v1 scheduler (the real-scheduler suite's RealEngine, tests/connector/vllm_real).

N short requests decode, one token a step; every --every steps a request for a large kvf file
arrives (K of them). Before each arrives the file is dropped from the OS page cache
(posix_fadvise DONTNEED), and the retention pool is off, so every load reads the file from storage
and decodes it (a cold load). In sync mode the load runs inside the engine step (start_load_kv);
in async mode a loader thread reads it while the request waits in WAITING_FOR_REMOTE_KVS. The
model is simulated: each step that computes anything sleeps --forward-ms (a stand-in for the
forward pass; no kernels run). Measured: the wall time of every step in which the short requests
ran, from the first large request's arrival until the last one finished, in both modes in the same
run. The last line is `async vs sync step time of the other requests: R`, R the ratio of the p90
step times (lower is better: 1 = async gains nothing).

Run with Debian's python after building (cmake target kvfold_pyext), vLLM found as the
real-scheduler test finds it (the build's KVFOLD_VLLM_SOURCE, else an installed vllm):
  /usr/bin/python3 tools/bench-connector-async.py [--vllm-source DIR] [--build build]
      [--tokens 2048 --layers 36 --kv-heads 8 --head-dim 128] [--others 8] [--loads 6] [--every 4]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL = os.path.join(REPO, "tests", "connector", "vllm_real")
OTHER_TOKENS = 600  # tokens each short request decodes at most


def cmake_vllm_source(build):
    """KVFOLD_VLLM_SOURCE from the build's CMake cache ('' when unset)."""
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("KVFOLD_VLLM_SOURCE:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return ""


def import_real(source, build):
    """The real-scheduler suite's set-up (its conftest), vLLM from source as run.py finds it."""
    sys.path.insert(0, REAL)
    import run
    path = run.vllm_path(source, os.path.join(build, "tests", "vllm_real"))
    if path is None:
        raise SystemExit(run.HOW_TO.format(python=sys.executable))
    os.environ["KVFOLD_VLLM_PATH"] = os.pathsep.join(path)
    os.environ.setdefault("KVFOLD_EXT_DIR", os.path.join(build, "python", "kvfold"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import conftest  # noqa: F401  (vLLM importable, kvfold loaded, harness.Engine = RealEngine)
    import engine
    return engine


def drop_from_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_mode(engine, a, mode, model, root, prompt):
    """Step times (seconds) of the steps the short requests ran in, and the median time from a
    large request's arrival to its end."""
    from harness import Request
    eng = engine.RealEngine(model, {"cache_root": root, "load_mode": mode, "pool_bytes": 0}, num_blocks=a.blocks,
                            check_untouched=False, mark_computed=False, token_budget=8192,
                            max_model_len=max(a.tokens + 64, 16 + OTHER_TOKENS))
    others = [f"o{i}" for i in range(a.others)]
    for i, rid in enumerate(others):
        eng.add_request(Request(rid, [(7 * i + j) % 997 + 1 for j in range(16)], max_tokens=OTHER_TOKENS))
    eng.step()  # the short requests' prefill: they decode from here on
    big, times, step, added, done = [], [], 0, {}, {}
    while len(big) < a.loads or any(r not in eng.finished for r in big):
        if len(big) < a.loads and step % a.every == 0:
            drop_from_page_cache(prompt.header_path)
            rid = f"big{len(big)}"
            big.append(rid)
            added[rid] = time.perf_counter()
            eng.add_request(Request(rid, prompt.prompt_token_ids, prompt.kv_transfer_params, prompt.cache_salt,
                                    max_tokens=1))
        t = time.perf_counter()
        info = eng.step()
        if info["scheduled"]:
            time.sleep(a.forward_ms / 1000)  # the simulated forward pass
        dt = time.perf_counter() - t
        if any(r in info["scheduled"] for r in others):
            times.append(dt)
        for r in big:
            if r in eng.finished and r not in done:
                done[r] = time.perf_counter() - added[r]
        step += 1
        if step > 100_000:
            raise SystemExit(f"{mode}: the loads did not finish")
    bad = [r for r in big if eng.finished[r].status != "FINISHED_LENGTH"]
    if bad:
        raise SystemExit(f"{mode}: requests {bad} failed")
    for rid in others:
        if rid not in eng.finished:
            eng.abort(rid)
    eng.shutdown()
    return times, statistics.median(done.values())


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-source", default=None, help="as the real-scheduler test's KVFOLD_VLLM_SOURCE "
                    "(default: the build's, else an installed vllm)")
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--tokens", type=int, default=2048, help="C of the large cache")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--others", type=int, default=8, help="short requests decoding meanwhile")
    ap.add_argument("--loads", type=int, default=6, help="large requests, each a cold load")
    ap.add_argument("--every", type=int, default=4, help="steps between their arrivals")
    ap.add_argument("--forward-ms", type=float, default=10.0, help="the simulated forward pass of a step")
    a = ap.parse_args()
    source = a.vllm_source if a.vllm_source is not None else cmake_vllm_source(a.build)
    engine = import_real(source, a.build)
    import logging
    for name in ("kvfold.connector", "vllm"):  # the fingerprint warning of each engine, vLLM's notices
        logging.getLogger(name).setLevel(logging.ERROR)
    import harness
    import kvfold
    from util import write_cache

    # blocks for every large request at once (async loads wait side by side) and the short ones'
    # whole decode: no request ever waits for blocks, in either mode
    a.blocks = a.loads * (a.tokens // 16 + 1) + a.others * ((16 + OTHER_TOKENS) // 16 + 1) + 16
    model = harness.ModelConfig("bench-model", a.layers, a.kv_heads, a.head_dim, 1000)
    with tempfile.TemporaryDirectory(prefix="kvfold-bench-async-") as tmp:
        root = os.path.join(tmp, "caches")
        path = os.path.join(root, "big.kvf")
        write_cache(path, a.layers, a.kv_heads, a.head_dim, a.tokens, 1)
        prompt = kvfold.prompt(path, [1], id_range=1000, cache_root=root)
        prompt.header_path = path
        size = os.path.getsize(path)
        drop_from_page_cache(path)
        t = time.perf_counter()
        kvfold._kvfold.load(path, "bfloat16")
        cold = time.perf_counter() - t
        print(f"large cache: {size / 1e6:.0f} MB ({a.layers} layers x {a.tokens} tokens x {a.kv_heads} kv heads x "
              f"{a.head_dim}); one cold load (page cache dropped) {cold * 1e3:.0f} ms")
        print(f"{a.others} short requests decoding; {a.loads} large requests, one every {a.every} steps; simulated "
              f"forward pass {a.forward_ms:g} ms a step; retention pool off")
        res = {}
        for mode in ("sync", "async"):
            times, latency = run_mode(engine, a, mode, model, root, prompt)
            res[mode] = pct(times, 0.9)
            print(f"{mode:5s}: {len(times)} steps of the others: median {statistics.median(times) * 1e3:7.1f} ms  "
                  f"p90 {res[mode] * 1e3:7.1f} ms  max {max(times) * 1e3:7.1f} ms  mean "
                  f"{statistics.mean(times) * 1e3:7.1f} ms; a large request's latency (median) "
                  f"{latency * 1e3:.0f} ms")
    print("R: async p90 / sync p90 of the other requests' step time (lower is better)")
    print(f"async vs sync step time of the other requests: {res['async'] / res['sync']:.2f}")


if __name__ == "__main__":
    main()
