"""Scenarios on vLLM's real scheduler beyond the stand-in suite's: every attention backend's KV
tensor shape (read from vLLM's source) with and without its kv_layout alias, tensor-parallel
ranks, sync and async loads in one engine, many requests over many files with a small retention
pool, a failing load in the middle of a batch, preemption with prefix caching, and two files
of one document compacted with different recipes."""
import os
import random
import subprocess

import pytest
import torch

import kvfold
from kvfold import _kvfold
from backends import BACKENDS, read_backend
from conftest import DATA, REPO, VLLM_DIR
from engine import RealEngine
from harness import COMPUTED, ModelConfig, Request
from test_connector import D_, FP, L_, MODEL, V_, cache, damage_chunk, expect, loaded, request
from util import write_cache

# kv_layout names of each backend (kvfold.blocks.LAYOUT_ALIASES)
ALIAS = {"flash_attn": "flash_attn", "flashinfer": "flashinfer", "triton_attn": "triton", "cpu_attn": "cpu",
         "flex_attention": "flex_attention"}
CASES = [(b, cl, alias) for b in sorted(BACKENDS) for cl in ("NHD", "HND")
         if cl == "NHD" or read_backend(VLLM_DIR, b, cl)[1] is not None for alias in (False, True)]


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "caches")


@pytest.mark.parametrize("backend,cache_layout,alias", CASES)
def test_backend_shapes_load_byte_exact(root, backend, cache_layout, alias):
    """Each backend's KV cache, shaped by its own get_kv_cache_shape and stride order, detected
    from its shape alone and through the backend's kv_layout alias: the loaded slots hold the
    file's K/V exactly, the question's slots what the model computed."""
    path = cache(root, "l.kvf", 45, 301)
    extra = {"cache_root": root, **({"kv_layout": ALIAS[backend]} if alias else {})}
    eng = RealEngine(MODEL, extra, backend=backend, cache_layout=cache_layout, num_blocks=24)
    assert eng.worker._layout == eng.layout
    r, _ = request("r", path, [1, 2], root)
    eng.add_request(r)
    eng.run()
    assert eng.finished["r"].status == "FINISHED_LENGTH"
    assert torch.equal(loaded(eng, r, 45), expect(path))
    assert bool((loaded(eng, r, 47, t0=45) == COMPUTED).all())


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_ranks_read_their_heads(root, monkeypatch, size):
    """Every rank of 2 and of 4 writes its slice of the KV heads (vLLM's shard rule) and reads
    only those heads' chunks from the file."""
    import vllm.distributed.parallel_state as ps
    C, H = 40, 4
    model = ModelConfig("stub-model", L_, H, D_, V_)
    path = os.path.join(root, FP, "tp.kvf")
    write_cache(path, L_, H, D_, C, 303)
    whole = 2 * L_ * H * (C * D_ * 2 + 4)  # every (layer, head) chunk of keys and values, with sums
    monkeypatch.setattr(ps, "_TP_SIZE", size)
    for rank in range(size):
        monkeypatch.setattr(ps, "_TP_RANK", rank)
        before = _kvfold.kv_bytes_read()
        eng = RealEngine(model, {"cache_root": root}, num_blocks=16, local_kv_heads=H // size)
        r, _ = request("r", path, [1], root)
        eng.add_request(r)
        eng.run()
        assert _kvfold.kv_bytes_read() - before == whole // size
        h0 = rank * H // size
        assert torch.equal(loaded(eng, r, C), expect(path)[:, :, :, h0:h0 + H // size]), rank
        eng.shutdown()


def test_sync_and_async_requests_mixed(root):
    """In async mode: block-aligned claims load on the loader threads, a claim ending mid-block
    loads synchronously, a request without kvfold parameters runs as given; all in one engine."""
    paths = {"a32": cache(root, "a32.kvf", 32, 305), "s37": cache(root, "s37.kvf", 37, 306),
             "a48": cache(root, "a48.kvf", 48, 307), "s21": cache(root, "s21.kvf", 21, 308)}
    eng = RealEngine(MODEL, {"cache_root": root, "load_mode": "async"}, num_blocks=64)
    reqs = {}
    for i, (rid, path) in enumerate(paths.items()):
        reqs[rid], _ = request(rid, path, [1 + i, 2, 3], root, max_tokens=3)
        eng.add_request(reqs[rid])
    eng.add_request(Request("plain", [7] * 20, max_tokens=2))
    eng.run()
    loads = {s.req_id: s.asynchronous for m in eng.metas for s in m.loads}
    assert loads == {"a32": True, "s37": False, "a48": True, "s21": False}
    assert sorted(eng.async_promoted) == ["a32", "a48"]
    for rid, path in paths.items():
        C = int(rid[1:])
        assert eng.finished[rid].status == "FINISHED_LENGTH", rid
        assert torch.equal(loaded(eng, reqs[rid], C), expect(path)), rid
    assert eng.finished["plain"].status == "FINISHED_LENGTH"


def test_hundred_requests_over_twenty_files_small_pool(root):
    """100 requests over 20 files, prefix caching on, a retention pool holding about three
    decoded files: every request's slots hold its file's K/V right after the step that loaded
    them, whether they came from the prefix cache, the pool or the file."""
    rng = random.Random(9)
    files = [cache(root, f"f{i}.kvf", 16 + 3 * i, 400 + i) for i in range(20)]
    want = {p: expect(p) for p in files}
    per_file = 2 * L_ * 40 * 2 * D_ * 2
    eng = RealEngine(MODEL, {"cache_root": root, "pool_bytes": 3 * per_file}, prefix_caching=True,
                     num_blocks=96, token_budget=512, check_untouched=False)
    reqs = {}
    for i in range(100):
        path = rng.choice(files)
        r, _ = request(f"r{i}", path, [rng.randrange(1, V_) for _ in range(rng.randint(1, 6))], root,
                       max_tokens=rng.randint(1, 3))
        reqs[r.request_id] = (r, path)
        eng.add_request(r)
    checked, loads = set(), 0
    for _ in range(400):
        if not (eng.sched.has_unfinished_requests() or eng.delayed):
            break
        info = eng.step()
        loads += len(eng.metas[-1].loads)
        for rid in set(info["scheduled"]) - checked:  # its first step: its C slots are in place
            r, path = reqs[rid]
            assert torch.equal(loaded(eng, r, want[path].shape[2]), want[path]), rid
            checked.add(rid)
    assert len(checked) == 100 and all(eng.finished[rid].status == "FINISHED_LENGTH" for rid in reqs)
    assert loads < 100  # some came whole from vLLM's prefix cache
    stats = eng.worker._pool.stats
    assert stats["evictions"] > 0 and stats["hits"] > 0, stats
    assert eng.worker._pool.bytes <= 3 * per_file


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_load_failing_in_the_middle_of_a_batch(root, mode):
    """Three requests scheduled in one step, the middle one's file corrupt (found only while
    loading): it ends FINISHED_ERROR without a token and none of its blocks stays in the prefix
    cache; its neighbours are served byte-exact."""
    a, bad, c = cache(root, "a.kvf", 32, 311), cache(root, "bad.kvf", 48, 312), cache(root, "c.kvf", 64, 313)
    damage_chunk(bad, "values", (1, 16, 0, 0))
    eng = RealEngine(MODEL, {"cache_root": root, "load_mode": mode}, prefix_caching=True, num_blocks=64)
    ra, _ = request("a", a, [1, 2], root)
    rb, _ = request("bad", bad, [3, 4], root)
    rc, _ = request("c", c, [5, 6], root)
    for r in (ra, rb, rc):
        eng.add_request(r)
    eng.step()
    assert [s.req_id for s in eng.metas[0].loads] == ["a", "bad", "c"]
    eng.run()
    assert eng.finished["bad"].status == "FINISHED_ERROR" and eng.finished["bad"].output_token_ids == []
    assert eng.finished["a"].status == eng.finished["c"].status == "FINISHED_LENGTH"
    assert torch.equal(loaded(eng, ra, 32), expect(a)) and torch.equal(loaded(eng, rc, 64), expect(c))
    again, _ = request("again", bad, [3, 4], root)
    hits = []
    orig = eng.scheduler.get_num_new_matched_tokens
    eng.scheduler.get_num_new_matched_tokens = lambda r, n: (hits.append(n), orig(r, n))[1]
    eng.add_request(again)
    eng.run()
    assert hits and hits[0] == 0  # nothing of the failed load in vLLM's prefix cache
    assert eng.finished["again"].status == "FINISHED_ERROR"


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_preemption_reloads_what_it_needs(root, prefix_caching, mode):
    """A request preempted by the scheduler after its load resumes with new blocks; with prefix
    caching its loaded blocks are a local hit and only the rest is loaded again."""
    path = cache(root, "pre.kvf", 48, 321)
    eng = RealEngine(MODEL, {"cache_root": root, "load_mode": mode}, prefix_caching=prefix_caching,
                     num_blocks=64)
    r, _ = request("r", path, [1, 2, 3], root, max_tokens=5)
    eng.add_request(r)
    for _ in range(2000):
        if r.status == "RUNNING":
            break
        eng.step()
    eng.preempt_next = {"r"}
    eng.step()
    assert r.num_preemptions == 1
    eng.run()
    assert eng.finished["r"].status == "FINISHED_LENGTH"
    spans = [(s.t0, s.t1) for m in eng.metas for s in m.loads]
    # with prefix caching the resumed request hits its own cached blocks, all 48 slots: no reload
    assert spans == ([(0, 48)] if prefix_caching else [(0, 48), (0, 48)]), spans
    assert torch.equal(loaded(eng, r, 48), expect(path))


# ---- two files of one document: the recipe is part of the cache's identity ----------------------

QWEN = os.path.join(DATA, "hf-qwen3-tiny")


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """One document compacted twice by the CLI: the default recipe and --head-choice off."""
    kvf = os.environ.get("KVFOLD_BIN") or os.path.join(REPO, "build", "kvfold")
    tmp = tmp_path_factory.mktemp("recipes")
    doc = tmp / "doc.txt"
    doc.write_text("the ledger lists each shipment, its order and the account it was billed to. " * 3)
    root = tmp / "caches"
    out = {}
    for name, extra in (("default", []), ("no-head-choice", ["--head-choice", "off"])):
        subprocess.run([kvf, "compact", "--model", QWEN, "--budget", "0.5", "--out", str(root), *extra, str(doc)],
                       check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
        made = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kvf")]
        out[name] = next(p for p in made if p not in out.values())
    return str(root), out


def test_two_recipes_of_one_document_never_share_blocks(recipes):
    """Files a and b hold different K/V for the same document; with prefix caching, a request
    for b after one for a must end holding b's K/V (placeholder ids and salt come from the
    cache's content, not only from the document)."""
    root, files = recipes
    a, b = files["default"], files["no-head-choice"]
    ha, hb = _kvfold.read_header(a), _kvfold.read_header(b)
    assert ha["document_digest"] == hb["document_digest"] and ha["n_tokens"] == hb["n_tokens"]
    assert not torch.equal(expect(a), expect(b))
    model = ModelConfig(QWEN, ha["n_layers"], ha["kv_heads"], ha["head_dim"], 3200)
    eng = RealEngine(model, {"cache_root": root}, prefix_caching=True, num_blocks=128, check_untouched=False)
    C = int(ha["n_tokens"])
    for rid, path in (("a", a), ("b", b)):
        p = kvfold.prompt(path, [11, 12, 13], model=QWEN, cache_root=root)
        r = Request(rid, p.prompt_token_ids, p.kv_transfer_params, p.cache_salt)
        eng.add_request(r)
        eng.run()
        assert eng.finished[rid].status == "FINISHED_LENGTH"
        assert torch.equal(loaded(eng, r, C), expect(path)), f"request {rid} holds another file's K/V"
