"""KVFoldConnector driven in vLLM's call order (harness.Engine) over synthetic kvf files."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvfold
import vllm
from harness import COMPUTED, PROFILE_LAYOUTS, Engine, ModelConfig, Request, gather, make_cache, slots_of
from kvfold import _kvfold
from util import FP, OTHER_FP, file_kv, write_cache

L_, H_, D_, V_ = 2, 2, 16, 1000
MODEL = ModelConfig("stub-model", L_, H_, D_, V_)


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "caches")


def cache(root, name, C, seed, **kw):
    path = os.path.join(root, FP, name)
    write_cache(path, kw.pop("n_layers", L_), kw.pop("kv_heads", H_), D_, C, seed, **kw)
    return path


def damage_chunk(path, dataset, index):
    """Flips bytes inside one stored chunk: only the Fletcher32 checksum can find it."""
    import h5py
    with h5py.File(path, "r") as f:
        d = f[dataset].id
        info = d.get_chunk_info_by_coord(index) if isinstance(index, tuple) else d.get_chunk_info(index)
    with open(path, "r+b") as f:
        f.seek(info.byte_offset + 8)
        b = f.read(16)
        f.seek(info.byte_offset + 8)
        f.write(bytes(x ^ 0x5A for x in b))


def request(rid, path, question, root, **kw):
    p = kvfold.prompt(path, question, id_range=V_, cache_root=root)
    return Request(rid, p.prompt_token_ids, p.kv_transfer_params, p.cache_salt, **kw), p


def loaded(engine, req, C, t0=0):
    """K/V of slots [t0, C) of every layer, as float32 [2, L, n, H, D]."""
    slots = slots_of(req.blocks, engine.bs, t0, C)
    return torch.stack([gather(engine.caches[n], engine.layout, slots) for n in engine.layer_names], 1).float()


def expect(path, dtype="bfloat16"):
    return torch.from_numpy(file_kv(path, dtype).copy())


def test_import_is_cheap():
    code = ("import sys; sys.path.insert(0, %r); import conftest; import kvfold; "
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)" % os.path.dirname(__file__))
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_prompt_placeholders(root):
    a, b = cache(root, "a.kvf", 40, 1), cache(root, "b.kvf", 40, 2)
    pa = kvfold.prompt(a, [5, 6, 7], id_range=V_, cache_root=root)
    pb = kvfold.prompt(b, [5, 6, 7], id_range=V_)
    assert pa.n_placeholders == 40 and pa.prompt_token_ids[40:] == [5, 6, 7]
    assert all(0 <= i < V_ for i in pa.prompt_token_ids)
    assert pa.prompt_token_ids[:40] != pb.prompt_token_ids[:40] and pa.cache_salt != pb.cache_salt
    assert kvfold.prompt(a, [9], id_range=V_).prompt_token_ids[:40] == pa.prompt_token_ids[:40]  # deterministic
    assert pa.kv_transfer_params["kvfold"]["cache"] == os.path.join(FP, "a.kvf")
    assert os.path.isabs(pb.kv_transfer_params["kvfold"]["cache"])
    assert pa.tokens_prompt()["cache_salt"] == pa.cache_salt
    with pytest.raises(ValueError, match="at least one token"):
        kvfold.prompt(a, [], id_range=V_)
    am = cache(root, "am.kvf", 16, 3, method="am")
    with pytest.raises(ValueError, match="method am"):
        kvfold.prompt(am, [1], id_range=V_)
    with pytest.raises(_kvfold.KvfError, match="missing.kvf"):
        kvfold.prompt(os.path.join(root, "missing.kvf"), [1], id_range=V_)


def test_prompt_id_range_from_model_dir():
    from conftest import DATA
    assert kvfold.prompt.__module__ == "kvfold.prompt"
    from kvfold.prompt import model_id_range
    assert 2 < model_id_range(os.path.join(DATA, "records-qwen3")) <= 3200


@pytest.mark.parametrize("attn_metadata,hooks", [(True, True), (None, False), (True, False)])
def test_several_requests_documented_outcomes(root, attn_metadata, hooks):
    """Valid, no-kvfold, missing, corrupt, truncated, other-model, wrong-count and retried requests
    in one engine; each ends as documented."""
    good1, good2 = cache(root, "g1.kvf", 40, 11), cache(root, "g2.kvf", 23, 12)
    corrupt = cache(root, "corrupt.kvf", 64, 13)
    damage_chunk(corrupt, "values", 1)
    truncated = cache(root, "trunc.kvf", 64, 14)
    with open(truncated, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    other = os.path.join(root, FP, "other.kvf")
    write_cache(other, L_, H_, D_, 32, 15, fp=OTHER_FP)
    missing_src = cache(root, "gone.kvf", 32, 16)

    eng = Engine(MODEL, {"cache_root": root, "model_fingerprint": FP}, num_blocks=128, token_budget=256,
                 attn_metadata=attn_metadata, layer_hooks=hooks)
    reqs = {}
    reqs["good1"], _ = request("good1", good1, [1, 2, 3], root)
    reqs["good2"], _ = request("good2", good2, [4], root, max_tokens=3)
    reqs["plain"] = Request("plain", [7] * 20)
    reqs["missing"], _ = request("missing", missing_src, [1, 2], root)
    os.remove(missing_src)
    reqs["corrupt"], _ = request("corrupt", corrupt, [1, 2], root)
    reqs["other"], _ = request("other", other, [1, 2], root)
    reqs["retried"], _ = request("retried", good1, [8, 9], root)
    r, p = request("short", good2, [1, 2], root)
    r.prompt_token_ids = p.prompt_token_ids[:20] + [1, 2]  # 20 of the 23 placeholders
    reqs["short"] = r
    r, p = request("only", good2, [1], root)
    r.prompt_token_ids = p.prompt_token_ids[:23]  # nothing after the placeholders
    reqs["only"] = r
    # truncated: the scheduler cannot even read the header
    r, _ = request("trunc", cache(root, "trunc-src.kvf", 64, 14), [3], root)
    r.kv_transfer_params["kvfold"]["cache"] = os.path.relpath(truncated, root)
    reqs["trunc"] = r
    eng.fail_alloc["retried"] = 2
    for r in reqs.values():
        eng.add_request(r)

    asked = []
    orig = eng.scheduler.get_num_new_matched_tokens

    def spy(req, n):
        out = orig(req, n)
        asked.append((req.request_id, n, out))
        return out
    eng.scheduler.get_num_new_matched_tokens = spy
    eng.step()
    # loads happened in step 1 for the good requests: K/V in the blocks equal the file's
    assert torch.equal(loaded(eng, reqs["good1"], 40), expect(good1))
    assert torch.equal(loaded(eng, reqs["good2"], 23), expect(good2))
    # the question's slots were computed by the "model" (not overwritten by the load)
    q = loaded(eng, reqs["good1"], 43, t0=40)
    assert bool((q == COMPUTED).all())
    eng.run()
    st = {rid: r.status for rid, r in eng.finished.items()}
    assert st["good1"] == st["good2"] == st["plain"] == st["retried"] == "FINISHED_LENGTH"
    for rid in ("missing", "corrupt", "other", "short", "only", "trunc"):
        assert st[rid] == "FINISHED_ERROR", rid
    answers = {}
    for rid, n, out in asked:
        answers.setdefault(rid, set()).add(out)
    assert answers["plain"] == {(0, False)}
    assert answers["good1"] == {(40, False)} and answers["good2"] == {(23, False)}
    assert answers["retried"] == {(40, False)} and sum(a[0] == "retried" for a in asked) == 3
    assert answers["short"] == {(20, True)}  # the placeholder run is claimed (async: never shared), then fails
    assert answers["only"] == {(22, True)}
    assert answers["missing"] == answers["other"] == {(32, True)}
    assert torch.equal(loaded(eng, reqs["retried"], 40), expect(good1))
    eng.shutdown()


def test_on_invalid_ignore_claims_nothing(root):
    """"ignore" claims nothing for a request it cannot serve, except under kvfold's own salt."""
    path = cache(root, "x.kvf", 32, 21)
    eng = Engine(MODEL, {"cache_root": root, "on_invalid": "ignore"})
    r, _ = request("r", path, [1], root)
    os.remove(path)
    assert eng.scheduler.get_num_new_matched_tokens(r, 0) == (32, True)
    plain = Request("plain", r.prompt_token_ids, r.kv_transfer_params, "another salt")
    assert eng.scheduler.get_num_new_matched_tokens(plain, 0) == (0, False)


def test_idempotent_and_metadata_once(root):
    path = cache(root, "x.kvf", 40, 22)
    eng = Engine(MODEL, {"cache_root": root})
    r, _ = request("r", path, [1, 2], root)
    s = eng.scheduler
    assert [s.get_num_new_matched_tokens(r, 0) for _ in range(3)] == [(40, False)] * 3
    assert s.get_num_new_matched_tokens(r, 32) == (8, False)
    assert s.build_connector_meta(None).loads == []  # nothing before allocation
    s.update_state_after_alloc(r, type("B", (), {"get_block_ids": lambda self: ([5, 9, 2, 7],)})(), 8)
    m1, m2 = s.build_connector_meta(None), s.build_connector_meta(None)  # async scheduling: next step first
    assert [(x.t0, x.t1, x.block_ids) for x in m1.loads] == [(32, 40, [5, 9, 2, 7])] and m2.loads == []
    assert s.request_finished(r, [5, 9, 2, 7]) == (False, None)


def test_preemption_and_resume_reload(root):
    path = cache(root, "p.kvf", 48, 31)
    eng = Engine(MODEL, {"cache_root": root}, num_blocks=64)
    r, _ = request("r", path, [1, 2, 3], root, max_tokens=4)
    eng.add_request(r)
    eng.step()
    first = list(r.blocks)
    assert eng.worker.last_loads == [("r", False)]
    eng.preempt_next = {"r"}
    eng.step()  # preempted, then resumed in the same step with new blocks: reloaded from the pool
    assert r.num_preemptions == 1 and r.blocks != first
    assert eng.worker.last_loads == [("r", True)]
    assert torch.equal(loaded(eng, r, 48), expect(path))
    eng.run()
    assert eng.finished["r"].status == "FINISHED_LENGTH"


def test_prefix_cache_hit_loads_the_rest(root):
    path = cache(root, "pc.kvf", 40, 41)
    eng = Engine(MODEL, {"cache_root": root}, prefix_caching=True, num_blocks=64)
    a, _ = request("a", path, [1, 2], root)
    eng.add_request(a)
    eng.run()
    b, _ = request("b", path, [3, 4, 5], root)
    eng.add_request(b)
    eng.step()
    spec = eng.metas[-1].loads[0]
    assert (spec.t0, spec.t1) == (32, 40)  # blocks 0-1 came from the local prefix cache
    assert b.blocks[:2] == a.blocks[:2]
    assert torch.equal(loaded(eng, b, 40), expect(path))


def test_chunked_prefill_and_unaligned_c(root):
    path = cache(root, "ch.kvf", 37, 51)
    eng = Engine(MODEL, {"cache_root": root}, token_budget=8, num_blocks=64)
    r, _ = request("r", path, list(range(1, 21)), root)
    eng.add_request(r)
    eng.run()
    assert eng.finished["r"].status == "FINISHED_LENGTH" and len(eng.metas[0].loads) == 1
    assert torch.equal(loaded(eng, r, 37), expect(path))
    assert bool((loaded(eng, r, 57, t0=37) == COMPUTED).all())


@pytest.mark.parametrize("layout,order", PROFILE_LAYOUTS)
@pytest.mark.parametrize("bs,kbs", [(16, 16), (32, 32), (32, 16), (128, 128)])
@pytest.mark.parametrize("cache_dtype,file_dtype", [(torch.bfloat16, "bfloat16"), (torch.float16, "float32"),
                                                    (torch.bfloat16, "float16")])
def test_layouts_block_sizes_dtypes(root, layout, order, bs, kbs, cache_dtype, file_dtype):
    """Every layout of the profile, recognised from its shape alone (no kv_layout)."""
    path = cache(root, "l.kvf", 45, 61, dtype=file_dtype)
    eng = Engine(MODEL, {"cache_root": root}, layout=layout, order=order, block_size=bs,
                 kernel_block_size=kbs, dtype=cache_dtype, num_blocks=24)
    assert eng.worker._layout == layout
    r, _ = request("r", path, [1, 2], root)
    eng.add_request(r)
    eng.step()
    want = expect(path, "bfloat16" if cache_dtype == torch.bfloat16 else "float16")
    assert torch.equal(loaded(eng, r, 45), want)


@pytest.mark.parametrize("layout,order", PROFILE_LAYOUTS)
def test_torch_copy_path(root, layout, order):
    """The path used for device (CUDA) tensors, exercised on host tensors."""
    path = cache(root, "t.kvf", 45, 62)
    eng = Engine(MODEL, {"cache_root": root, "copy_backend": "torch"}, layout=layout,
                 order=order, block_size=32, kernel_block_size=16, num_blocks=24)
    r, _ = request("r", path, [1, 2], root)
    eng.add_request(r)
    eng.step()
    assert torch.equal(loaded(eng, r, 45), expect(path))


# kv_layout names an attention backend: each must accept the shapes that backend has had
# (vLLM's get_kv_cache_shape at 28be48fa: FlexAttention and ROCm kv-first, FlashInfer and Triton
# blocks-first, CPU its own; packed in the newer ones)
BACKEND_LAYOUTS = {"flash_attn": ("kv_first", "blocks_first", "packed"),
                   "flex_attention": ("kv_first", "blocks_first", "packed"),
                   "flashinfer": ("blocks_first", "packed"), "triton": ("blocks_first", "packed"),
                   "cpu": ("cpu", "packed"), "rocm_attn": ("kv_first",)}


@pytest.mark.parametrize("backend", sorted(BACKEND_LAYOUTS))
def test_kv_layout_aliases_match_their_backend(root, backend):
    """An alias accepts exactly its backend's layouts (docs/connector.md, "KV layouts") and
    loads correctly through each; any other layout is refused at start-up, naming the alias."""
    path = cache(root, "a.kvf", 40, 63)
    for layout in ("kv_first", "blocks_first", "cpu", "packed"):
        make = lambda: Engine(MODEL, {"cache_root": root, "kv_layout": backend}, layout=layout,  # noqa: E731
                              num_blocks=24)
        if layout not in BACKEND_LAYOUTS[backend]:
            with pytest.raises(ValueError, match=f"matches none .*kv_layout '{backend}'"):
                make()
            continue
        eng = make()
        assert eng.worker._layout == layout
        r, _ = request("r", path, [1], root)
        eng.add_request(r)
        eng.step()
        assert torch.equal(loaded(eng, r, 40), expect(path))


def test_detect_layout_by_shape():
    from kvfold.blocks import detect_layout
    H, D = 2, 16
    assert detect_layout((9, 2, 16, H, D), 16, H, D, "cuda") == "blocks_first"  # FlashAttention from v0.23
    assert detect_layout((2, 9, 16, H, D), 16, H, D, "cuda") == "kv_first"      # FlashAttention before
    assert detect_layout((2, 9, H, 16, D), 16, H, D, "cpu") == "cpu"
    assert detect_layout((9, H, 16, 2 * D), 16, H, D, "cuda") == "packed"       # v0.26+
    assert detect_layout((9, H, 16, 2 * D), 32, H, D, "cuda") == "packed"       # kernel blocks of 16 in 32
    with pytest.raises(ValueError, match="ambiguous between kv_first and blocks_first"):
        detect_layout((2, 2, 16, H, D), 16, H, D, "cuda")  # 2 blocks: both 5-D shapes fit
    assert detect_layout((2, 2, 16, H, D), 16, H, D, "cuda", "flashinfer") == "blocks_first"
    with pytest.raises(ValueError, match="matches none"):
        detect_layout((9, H, 16, D), 16, H, D, "cuda")  # packed without V
    with pytest.raises(ValueError, match="matches none"):
        detect_layout((9, 2 * H, 16, D), 16, H, D, "cuda")  # FlashInfer NVFP4-style split heads
    with pytest.raises(ValueError, match="not one of"):
        detect_layout((9, 2, 16, H, D), 16, H, D, "cuda", "paged")


def test_tensor_parallel_rank_writes_its_heads(root, monkeypatch):
    import vllm.distributed.parallel_state as ps
    monkeypatch.setattr(ps, "_TP_RANK", 1)
    monkeypatch.setattr(ps, "_TP_SIZE", 2)
    model = ModelConfig("stub-model", L_, 4, D_, V_)
    path = os.path.join(root, FP, "tp.kvf")
    write_cache(path, L_, 4, D_, 33, 71)
    eng = Engine(model, {"cache_root": root}, num_blocks=16, local_kv_heads=2)
    r, _ = request("r", path, [1], root)
    eng.add_request(r)
    eng.step()
    assert torch.equal(loaded(eng, r, 33), expect(path)[:, :, :, 2:4])


def test_tensor_parallel_rank_reads_only_its_heads(root, monkeypatch):
    """Rank 1 of 4 reads only its KV head's chunks: a quarter of the file's K/V bytes, counted by
    the extension, against an unsharded load of the same file that reads all of them."""
    import vllm.distributed.parallel_state as ps
    C, H = 40, 4
    model = ModelConfig("stub-model", L_, H, D_, V_)
    path = os.path.join(root, FP, "tp4.kvf")
    write_cache(path, L_, H, D_, C, 72)
    whole = 2 * L_ * H * (C * D_ * 2 + 4)  # every (layer, head) chunk of keys and values, with sums
    before = _kvfold.kv_bytes_read()
    eng = Engine(model, {"cache_root": root}, num_blocks=16)
    r, _ = request("r", path, [1], root)
    eng.add_request(r)
    eng.step()
    assert _kvfold.kv_bytes_read() - before == whole
    monkeypatch.setattr(ps, "_TP_RANK", 1)
    monkeypatch.setattr(ps, "_TP_SIZE", 4)
    before = _kvfold.kv_bytes_read()
    eng = Engine(model, {"cache_root": root}, num_blocks=16, local_kv_heads=1)
    r, _ = request("r", path, [1], root)
    eng.add_request(r)
    eng.step()
    assert _kvfold.kv_bytes_read() - before == whole // 4
    assert torch.equal(loaded(eng, r, C), expect(path)[:, :, :, 1:2])


def test_refusals(root):
    with pytest.raises(ValueError, match="fp8"):
        Engine(MODEL, {"cache_root": root}, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block size 48"):
        Engine(MODEL, {"cache_root": root}, block_size=48)
    path = cache(root, "r.kvf", 16, 81)
    eng = Engine(MODEL, {"cache_root": root})
    r, _ = request("r", path, [1], root)
    r.kv_transfer_params["kvfold"]["cache"] = "../../etc/passwd"
    assert eng.scheduler.get_num_new_matched_tokens(r, 0) == (16, True)  # claimed (asynchronously) to fail it
    assert "outside cache_root" in eng.scheduler._decisions["r"].reason


@pytest.mark.parametrize("policy", ["recompute", None])
def test_refuses_to_start_unless_failure_policy_is_fail(root, policy):
    """Under "recompute" (or a vLLM without the setting) a failed load would be computed from the
    placeholder ids and those blocks could enter the prefix cache: both roles refuse to start."""
    with pytest.raises(ValueError, match='kv_load_failure_policy.*"kv_load_failure_policy": "fail"'):
        Engine(MODEL, {"cache_root": root}, policy=policy)


def test_prefix_hit_path_fails_an_unservable_request(root):
    """A request whose claim the local prefix-cache hit already covers still fails when its cache
    cannot be served: one more token is claimed (asynchronously, so its block stays private) and
    reported, also when it is the prompt's last token; the hit blocks stay cached."""
    path = cache(root, "ph.kvf", 32, 91)
    eng = Engine(MODEL, {"cache_root": root}, prefix_caching=True, num_blocks=64)
    a, _ = request("a", path, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], root)
    eng.add_request(a)
    eng.run()
    assert eng.finished["a"].status == "FINISHED_LENGTH"
    os.remove(path)  # the cache is gone: its blocks remain in vLLM's prefix cache
    b = Request("b", a.prompt_token_ids + [99] * 8, a.kv_transfer_params, a.cache_salt, max_tokens=1)
    eng.add_request(b)
    eng.step()
    spec = eng.metas[-1].loads[0]
    assert spec.reason and (spec.t0, spec.t1) == (48, 49)  # hit 3 blocks (48 tokens) > C = 32: one token more
    assert eng.finished["b"].status == "FINISHED_ERROR"
    # the whole prompt but its last token hit: that token is claimed
    c = Request("c", a.prompt_token_ids[:49], a.kv_transfer_params, a.cache_salt, max_tokens=1)
    eng.add_request(c)
    eng.step()
    spec = eng.metas[-1].loads[0]
    assert spec.reason and spec.asynchronous and (spec.t0, spec.t1) == (48, 49)
    assert eng.finished["c"].status == "FINISHED_ERROR"
    assert eng.cached_blocks(c, 3) == 3


def test_malformed_params_fail_the_request(root):
    eng = Engine(MODEL, {"cache_root": root})
    r = Request("m", [5] * 40, {"kvfold": {"cache": "x.kvf"}}, max_tokens=1)  # no n_tokens, key, id_range
    eng.add_request(r)
    eng.run()
    assert eng.finished["m"].status == "FINISHED_ERROR"
    ok = Engine(MODEL, {"cache_root": root, "on_invalid": "ignore"})
    r = Request("m", [5] * 40, {"kvfold": {"cache": "x.kvf"}}, max_tokens=1)
    ok.add_request(r)
    ok.run()
    assert ok.finished["m"].status == "FINISHED_LENGTH"


def test_shared_kv_and_draft_layers(root):
    """A layer sharing another's KV tensor (vLLM gives it its target's tensor) is written once; a
    draft model's layers (indices past the model's) get zeros in the loaded slots."""
    model = ModelConfig("stub-model", 3, H_, D_, V_)
    path = os.path.join(root, FP, "sh.kvf")
    k, v = write_cache(path, 3, H_, D_, 40, 95)
    # layer 2 shares layer 0's KV in the model: the file holds the same K/V for both
    k[2], v[2] = k[0], v[0]
    from util import header
    from kvfold import _kvfold as ext
    ext.write(path, header(3, H_, D_, 40, "%032x" % 95), k.tobytes(), v.tobytes())
    eng = Engine(model, {"cache_root": root}, num_blocks=24,
                 extra_layers={"model.layers.3.self_attn.attn": None, "model.layers.4.self_attn.attn": None})
    shared = dict(eng.caches)
    shared["model.layers.2.self_attn.attn"] = shared["model.layers.0.self_attn.attn"]
    eng.caches = shared
    eng.worker.register_kv_caches(dict(shared))
    assert eng.worker._tensor_layers == [0, 1] and len(eng.worker._draft) == 2
    r, _ = request("r", path, [1, 2], root)
    eng.add_request(r)
    eng.step()
    slots = slots_of(r.blocks, eng.bs, 0, 40)
    want = expect(path)
    for i in range(3):
        got = gather(eng.caches[f"model.layers.{i}.self_attn.attn"], eng.layout, slots).float()
        assert torch.equal(got, want[:, i]), i
    for n in ("model.layers.3.self_attn.attn", "model.layers.4.self_attn.attn"):
        assert bool((gather(eng.caches[n], eng.layout, slots) == 0).all())
    with pytest.raises(ValueError, match=r"no KV cache registered for layers \[1\]"):
        eng.worker.register_kv_caches({n: t for n, t in shared.items() if ".1." not in n})


@pytest.mark.parametrize("dcp,pcp,interleave", [(2, 1, 1), (2, 2, 1), (4, 1, 8), (1, 2, 16)])
def test_context_parallel_ranks_write_their_tokens(root, monkeypatch, dcp, pcp, interleave):
    """With decode/prefill context parallelism the scheduler's blocks hold block_size x dcp x pcp
    tokens spread over the ranks; each rank writes exactly the tokens vLLM's block table gives it,
    in the slot it gives them (written out here from that rule)."""
    import vllm.distributed.parallel_state as ps
    from harness import KVCacheBlocks, ParallelConfig
    path = cache(root, "cp.kvf", 77, 97)
    cp, bs = dcp * pcp, 16
    want = expect(path)
    seen = set()
    for rank in range(cp):
        monkeypatch.setattr(ps, "_DCP_RANK", rank % dcp)
        monkeypatch.setattr(ps, "_PCP_RANK", rank // dcp)
        eng = Engine(MODEL, {"cache_root": root}, num_blocks=24, check_untouched=False)
        eng.vllm_config.parallel_config = ParallelConfig(dcp, pcp, interleave)
        cls = type(eng.worker)
        sched = cls(eng.vllm_config, eng.scheduler.role, eng.kv_cache_config)
        worker = cls(eng.vllm_config, eng.worker.role, eng.kv_cache_config)
        assert sched._block_size == bs * cp
        worker.register_kv_caches(dict(eng.caches))
        r, _ = request("r", path, [1], root)
        assert sched.get_num_new_matched_tokens(r, 0) == (77, False)
        ids = [7, 3, 11]  # scheduler blocks of bs * cp tokens
        sched.update_state_after_alloc(r, KVCacheBlocks((ids,)), 77)
        worker.bind_connector_metadata(sched.build_connector_meta(None))
        worker.start_load_kv(None)
        assert not worker.get_block_ids_with_load_errors()
        for p in range(77):
            vo = p % (bs * cp)
            if (vo // interleave) % cp != rank:
                continue
            seen.add(p)
            slot = ids[p // (bs * cp)] * bs + vo // (cp * interleave) * interleave + vo % interleave
            for i, n in enumerate(eng.layer_names):
                got = gather(eng.caches[n], eng.layout, [slot]).float()[:, 0]
                assert torch.equal(got, want[:, i, p]), (rank, p)
    assert seen == set(range(77))


def dst_of(t, layer=0):
    from kvfold.blocks import host_destination
    return host_destination(t, layer)


def test_a_file_under_another_documents_name_is_refused(tmp_path):
    """A content-addressed name (<doc>.<method>-<budget>.<recipe16>.kvf) must be what the header
    holds: a file copied over another document's name is neither read nor loaded."""
    doc, other = "%032x" % (7 * 7919 + 1), "%032x" % 12345
    good = str(tmp_path / f"{doc}.fold-0.25.{'0' * 16}.kvf")
    write_cache(good, 1, 2, 16, 16, 7)
    assert _kvfold.read_header(good)["document_digest"] == doc
    bad = str(tmp_path / f"{other}.fold-0.25.{'0' * 16}.kvf")
    os.replace(good, bad)
    for read in (lambda: _kvfold.read_header(bad), lambda: _kvfold.load(bad, "float32")):
        with pytest.raises(_kvfold.KvfError, match="the document differs"):
            read()


def test_c_copy_refusals(root):
    src = bytearray(2 * 1 * 16 * 2 * 16 * 2)
    t = make_cache("blocks_first", 4, 16, 2, 16, torch.bfloat16)
    dst = [dst_of(t)]
    with pytest.raises(_kvfold.KvfError, match="block size 48"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, dst, "blocks_first", [1], 48, 0, 16)
    with pytest.raises(ValueError, match="fp8"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, [dst[0][:4] + ("float8_e4m3fn", 0)], "blocks_first",
                            [1], 16, 0, 16)
    with pytest.raises(_kvfold.KvfError, match="block id 4 outside"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, dst, "blocks_first", [4], 16, 0, 16)
    with pytest.raises(ValueError, match="layout 'paged'"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, dst, "paged", [1], 16, 0, 16)
    with pytest.raises(_kvfold.KvfError, match="not a cpu cache"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, dst, "cpu", [1], 16, 0, 16, 0, 2)
    with pytest.raises(_kvfold.KvfError, match="not a packed cache"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, dst, "packed", [1], 16, 0, 16)


def test_c_copy_size_overflow_is_refused():
    """C = 2^61 made 2 * L * C * H * D * 2 wrap to a small number, passing the size check."""
    src = bytearray(64)
    t = make_cache("blocks_first", 4, 16, 2, 16, torch.bfloat16, fill=0)
    with pytest.raises(_kvfold.KvfError, match="smaller than"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 2 ** 61, 2, 16, [dst_of(t)], "blocks_first", [1], 16, 0, 16)
    with pytest.raises(_kvfold.KvfError, match="smaller than"):
        _kvfold.copy_blocks(src, "bfloat16", 2 ** 30, 2 ** 20, 2 ** 10, 2 ** 4, [dst_of(t)], "blocks_first", [1], 16,
                            0, 16)


def test_c_copy_head_offsets_are_64_bit():
    """head_start = 2^31 - 1 overflowed head_start + kv_heads (int) and read far outside the source."""
    src = bytearray(2 * 1 * 16 * 2 * 16 * 2)
    t = make_cache("blocks_first", 4, 16, 2, 16, torch.bfloat16, fill=0)
    for hs in (2 ** 31 - 1, 2 ** 62, -1):
        with pytest.raises(_kvfold.KvfError, match="outside the cache's 2 kv heads"):
            _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, [dst_of(t)], "blocks_first", [1], 16, 0, 16, hs, 2)


def test_c_copy_each_destination_has_its_own_dtype(root):
    """Layers of mixed dtypes: each tensor is written in its own dtype (the first tensor's dtype
    was used for all, writing 4-byte floats past 2-byte tensors)."""
    path = cache(root, "md.kvf", 20, 98, dtype="float32")
    h, buf = _kvfold.load(path, "float32")
    tensors = [make_cache("blocks_first", 4, 16, 2, 16, dt, fill=0) for dt in (torch.float32, torch.bfloat16)]
    from kvfold.blocks import copy_to_blocks
    copy_to_blocks(buf, "float32", 2, 20, 2, 16, tensors, "blocks_first", [1, 2], 16, 0, 20)
    f32 = torch.from_numpy(file_kv(path, "float32").copy())
    assert torch.equal(gather(tensors[0], "blocks_first", slots_of([1, 2], 16, 0, 20)), f32[:, 0])
    assert torch.equal(gather(tensors[1], "blocks_first", slots_of([1, 2], 16, 0, 20)).float(),
                       f32[:, 1].to(torch.bfloat16).float())
    assert bool((tensors[1][0] == 0).all()) and bool((tensors[1][3] == 0).all())  # nothing outside its blocks


def test_c_load_refuses_spans_outside_the_file(root):
    """load's layers and heads: an empty span, or one outside the file's, is a ValueError naming the file."""
    path = cache(root, "span.kvf", 20, 99, dtype="float32")
    h, whole = _kvfold.load(path, "float32")
    L, H = h["n_layers"], h["kv_heads"]
    assert L >= 2 and H >= 2
    for kw in (dict(layers=(0, L + 1)), dict(layers=(1, 1)), dict(layers=(-1, 1)), dict(layers=(L, -1)),
               dict(heads=(0, H + 1)), dict(heads=(1, 0)), dict(heads=(-1, 1)), dict(heads=(H, -1))):
        what, (lo, hi) = next(iter(kw.items()))
        n, unit = (L, "") if what == "layers" else (H, " kv heads")
        hi = n if hi < 0 else hi
        with pytest.raises(ValueError, match=re.escape(f"load: {what} [{lo}, {hi}) outside {path}'s {n}{unit}")):
            _kvfold.load(path, "float32", **kw)
    _, last = _kvfold.load(path, "float32", layers=(L - 1, -1), heads=(H - 1, -1))  # -1: up to the end
    assert len(last) == len(whole)


def test_c_copy_refuses_read_only_and_short_memory():
    src = bytearray(2 * 1 * 16 * 2 * 16 * 2)
    t = make_cache("blocks_first", 4, 16, 2, 16, torch.bfloat16, fill=0)
    buf, off, shape, strides, dt, layer = dst_of(t)
    ro = np.frombuffer(bytes(buf.nbytes), dtype=np.uint8)  # read-only memory
    with pytest.raises(ValueError, match="destination 0 is not writable memory"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, [(ro, off, shape, strides, dt, layer)], "blocks_first",
                            [1], 16, 0, 16)
    with pytest.raises(ValueError, match="not writable memory .bytes"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, [(bytes(buf.nbytes), off, shape, strides, dt, layer)],
                            "blocks_first", [1], 16, 0, 16)
    short = bytearray(buf.nbytes - 2)  # one element short of the shape's extent
    with pytest.raises(_kvfold.KvfError, match="reach element"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, [(short, off, shape, strides, dt, layer)], "blocks_first",
                            [1], 16, 0, 16)
    with pytest.raises(_kvfold.KvfError, match="reach element"):  # an offset past the end
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, [(buf, 8, shape, strides, dt, layer)], "blocks_first",
                            [1], 16, 0, 16)
    with pytest.raises(_kvfold.KvfError, match="overflow"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, [(buf, 0, shape, (2 ** 62,) + strides[1:], dt, layer)],
                            "blocks_first", [1], 16, 0, 16)
    with pytest.raises(_kvfold.KvfError, match="layer 1 outside"):
        _kvfold.copy_blocks(src, "bfloat16", 1, 16, 2, 16, [(buf, off, shape, strides, dt, 1)], "blocks_first",
                            [1], 16, 0, 16)


def test_stub_follows_vllm(root):
    """The stand-in's base class takes kv_cache_config as a required argument and refuses the
    layout query on itself, as vLLM's does; the scheduler calls update_state_after_alloc for every
    allocated request (with 0 external tokens too), and the waiting queue stops at the first
    request it cannot allocate (vLLM's `break`), so later requests wait."""
    import inspect
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    assert inspect.signature(KVConnectorBase_V1.__init__).parameters["kv_cache_config"].default is inspect._empty
    with pytest.raises(TypeError):
        KVConnectorBase_V1.get_required_kvcache_layout(None)
    assert hasattr(KVConnectorBase_V1, "has_pending_push_work") == (vllm.PROFILE >= "0.26")
    eng = Engine(MODEL, {"cache_root": root})
    calls = []
    orig = eng.scheduler.update_state_after_alloc
    eng.scheduler.update_state_after_alloc = lambda r, b, n: (calls.append((r.request_id, n)), orig(r, b, n))
    path = cache(root, "s.kvf", 32, 99)
    a, _ = request("a", path, [1], root)
    eng.add_request(a)
    eng.add_request(Request("b", [5] * 20))
    eng.fail_alloc["a"] = 1
    eng.step()
    assert eng.steps[-1]["scheduled"] == {}  # b waits behind a
    eng.step()
    assert eng.steps[-1]["scheduled"] == {"a": 1, "b": 20} and calls == [("a", 32), ("b", 0)]


def test_claiming_nothing_would_poison_the_prefix_cache(root, monkeypatch):
    """Why a failing request under kvfold's salt never gets "nothing here" (on_invalid "ignore"
    applies to other salts only): with that rule bypassed, the request is computed from the
    placeholder ids, its blocks enter the prefix cache under the cache's hashes, and a well-formed
    request after it hits them and attends to placeholder K/V. (Under kv_load_failure_policy
    "recompute" vLLM would do the same to a failed load: the connector refuses to start then.)"""
    import kvfold.connector as kc
    monkeypatch.setattr(kc, "_in_kvfold_namespace", lambda request: False)
    path = cache(root, "rc.kvf", 32, 101)
    eng = Engine(MODEL, {"cache_root": root, "on_invalid": "ignore"}, prefix_caching=True)
    r, p = request("r", path, [1, 2], root)
    r.kv_transfer_params = {"kvfold": dict(p.kv_transfer_params["kvfold"], cache="missing.kvf")}
    eng.add_request(r)
    eng.run()
    assert eng.finished["r"].status == "FINISHED_LENGTH"
    assert eng.cached_blocks(r, 2) == 2  # both placeholder blocks are reusable
    g, _ = request("g", path, [3], root)
    eng.add_request(g)
    eng.run()
    assert eng.finished["g"].status == "FINISHED_LENGTH"
    assert not torch.equal(loaded(eng, g, 32), expect(path))  # served the placeholders' K/V


def test_pipelined_cold_load(root):
    """A cold load reads layer ranges in order and hands each over once; a damaged chunk in the
    last range fails the load (and so the request) after the earlier ranges were copied."""
    from kvfold.loader import layer_ranges, pipelined_load
    assert layer_ranges(36, 4) == [(0, 9), (9, 18), (18, 27), (27, 36)]
    assert layer_ranges(2, 4) == [(0, 1), (1, 2)] and layer_ranges(5, 1) == [(0, 5)]
    model = ModelConfig("stub-model", 5, H_, D_, V_)
    path = os.path.join(root, FP, "pl.kvf")
    write_cache(path, 5, H_, D_, 40, 103)
    buf, seen = bytearray(2 * 5 * 40 * H_ * D_ * 2), []
    h, out = pipelined_load(path, "bfloat16", buf, 5, lambda h, l0, l1: seen.append((l0, l1)), parts=3)
    assert seen == [(0, 1), (1, 3), (3, 5)] and out is buf and h["n_tokens"] == 40
    assert bytes(buf) == bytes(_kvfold.load(path, "bfloat16")[1])
    damage_chunk(path, "values", (4, 16, 0, 0))  # layer 4, tokens 16..31
    eng = Engine(model, {"cache_root": root, "load_parts": 3}, num_blocks=24, check_untouched=False)
    r, _ = request("r", path, [1], root)
    eng.add_request(r)
    eng.run()
    assert eng.finished["r"].status == "FINISHED_ERROR" and eng.worker._pool.staging.stats["new"] == 1
    assert len(eng.worker._pool) == 0


def test_c_copy_random_arguments():
    """Seeded random calls of copy_blocks, valid and not (layouts, stride orders, kernel blocks,
    token ranges, block ids, heads, context parallelism): each either writes exactly the expected
    slots (checked against a torch reference) or is refused leaving the tensor untouched. Under
    the sanitizer build any out-of-bounds access would abort the run."""
    from harness import ORDERS
    rng = np.random.default_rng(7)
    L, C, SH, D = 2, 40, 4, 8
    src = torch.from_numpy(rng.standard_normal((2, L, C, SH, D), dtype=np.float32)).to(torch.bfloat16)
    raw = bytearray(src.view(torch.int16).numpy().tobytes())
    outcomes = {True: 0, False: 0}
    for case in range(300):
        layout = ["kv_first", "blocks_first", "cpu", "packed"][rng.integers(4)]
        order = list(ORDERS[layout])[rng.integers(len(ORDERS[layout]))]
        kbs = int(rng.choice([16, 32]))
        cp = int(rng.choice([1, 1, 2]))
        bs = kbs * int(rng.choice([1, 2])) * cp
        heads = int(rng.integers(1, SH + 1))
        hs = int(rng.integers(-1, SH + 1))
        nblk = int(rng.integers(1, 8))
        t0, t1 = sorted(int(x) for x in rng.integers(-2, C + 3, 2))
        ids = [int(x) for x in rng.integers(0, nblk * kbs // (bs // cp) + 2, 4)]
        t = make_cache(layout, nblk, kbs, heads, D, torch.bfloat16, order, fill=0)
        before = t.clone()
        valid = (0 <= t0 <= t1 <= C and 0 <= hs <= SH - heads and (t1 == t0 or (t1 - 1) // bs < len(ids))
                 and all((b + 1) * (bs // cp // kbs) <= nblk for b in ids[t0 // bs:(t1 - 1) // bs + 1] if t1 > t0))
        args = (raw, "bfloat16", L, C, SH, D, [dst_of(t, 1)], layout, ids, bs, t0, t1, hs, heads, cp, case % cp, 1)
        outcomes[valid] += 1
        if not valid:
            with pytest.raises((_kvfold.KvfError, ValueError)):
                _kvfold.copy_blocks(*args)
            assert torch.equal(t.view(torch.int16), before.view(torch.int16)), case
            continue
        _kvfold.copy_blocks(*args)
        want = before.clone()
        rank = case % cp
        for p in range(t0, t1):
            vo = p % bs
            if vo % cp != rank:
                continue
            slot = ids[p // bs] * (bs // cp) + vo // cp
            from harness import slot_view
            slot_view(want, layout, slot).copy_(src[:, 1, p, hs:hs + heads])
        assert torch.equal(t.view(torch.int16), want.view(torch.int16)), case
    assert min(outcomes.values()) >= 50, outcomes


@pytest.mark.parametrize("use_torch", [False, True])
def test_head_major_decode_copies_the_same_blocks(root, use_torch):
    """load(head_major=True) holds each head's slots together, [2, L, H, C, D], as the file's
    chunks do; copy_to_blocks(head_major=True) from it writes what the token-major path writes,
    and a head range reads only those heads."""
    from kvfold.blocks import copy_to_blocks
    L, H, D, C, bs = 3, 4, 16, 37, 16
    path = os.path.join(root, FP, "hm.kvf")
    write_cache(path, L, H, D, C, 73)
    h, tok = _kvfold.load(path, "bfloat16")
    _, hm = _kvfold.load(path, "bfloat16", head_major=True)
    t = torch.frombuffer(tok, dtype=torch.bfloat16).view(2, L, C, H, D)
    m = torch.frombuffer(hm, dtype=torch.bfloat16).view(2, L, H, C, D)
    assert torch.equal(m.transpose(2, 3), t)
    import h5py  # an independent reader of the same file: bf16 is stored as uint16 bits
    with h5py.File(path, "r") as f:
        for i, name in enumerate(("keys", "values")):
            assert np.array_equal(f[name][:], t[i].view(torch.int16).numpy().view(np.uint16))
    ids = [5, 1, 3]
    for head_start, heads in ((0, H), (2, 1)):
        a = [torch.zeros(8, 2, bs, heads, D, dtype=torch.bfloat16) for _ in range(L)]
        b = [torch.zeros(8, 2, bs, heads, D, dtype=torch.bfloat16) for _ in range(L)]
        copy_to_blocks(tok, "bfloat16", L, C, H, D, a, "blocks_first", ids, bs, 0, C, head_start, use_torch, heads)
        copy_to_blocks(hm, "bfloat16", L, C, H, D, b, "blocks_first", ids, bs, 0, C, head_start, use_torch, heads,
                       head_major=True)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert torch.equal(b[1][5, 0, :, 0], t[0, 1, :bs, head_start])  # block 5 holds tokens 0..15
    buf = bytearray(len(hm))
    _kvfold.load(path, "bfloat16", out=buf, heads=(1, 2), head_major=True)
    got = torch.frombuffer(buf, dtype=torch.bfloat16).view(2, L, H, C, D)
    assert torch.equal(got[:, :, 1], m[:, :, 1]) and not got[:, :, 0].any() and not got[:, :, 2:].any()


@pytest.mark.parametrize("layout,order", PROFILE_LAYOUTS)
@pytest.mark.parametrize("file_dtype,cache_dtype", [("bfloat16", torch.bfloat16), ("float32", torch.float16)])
@pytest.mark.parametrize("overlap", [True, False])
def test_one_pass_load_writes_what_load_then_copy_writes(root, layout, order, file_dtype, cache_dtype, overlap):
    """load_blocks (a cold load in one pass, with the next layer read ahead on a helper thread or
    not) fills the buffer as load() does and the blocks as copy_to_blocks from it does, for a head
    range, tokens [t0, t1), every layout; a payload digest other than the file's, or a damaged
    layer (read ahead while the one before is copied), is refused."""
    from harness import make_cache
    from kvfold.blocks import copy_to_blocks, host_destination
    from kvfold.loader import one_pass_load
    L, H, D, C, bs = 3, 4, 16, 45, 16
    path = os.path.join(root, FP, "op.kvf")
    write_cache(path, L, H, D, C, 74, dtype=file_dtype)
    dt = "bfloat16" if cache_dtype == torch.bfloat16 else "float16"
    ids, (h0, h1), (t0, t1) = [7, 2, 5], (1, 3), (3, 41)
    want = [make_cache(layout, 9, bs, h1 - h0, D, cache_dtype, order) for _ in range(L)]
    got = [make_cache(layout, 9, bs, h1 - h0, D, cache_dtype, order) for _ in range(L)]
    ref = bytearray(2 * L * H * C * D * 2)
    _kvfold.load(path, dt, out=ref, heads=(h0, h1))
    copy_to_blocks(ref, dt, L, C, H, D, want, layout, ids, bs, t0, t1, h0, False, h1 - h0)
    buf = bytearray(len(ref))
    dests = [host_destination(t, i) for i, t in enumerate(got)]
    payload = _kvfold.read_header(path)["payload_digest"]
    h = one_pass_load(path, dt, buf, dests, layout, ids, bs, t0, t1, n_layers=L, kv_heads=H, head_dim=D,
                      heads=(h0, h1), payload_digest=payload, overlap=overlap)
    assert h["payload_digest"] == payload and bytes(buf) == bytes(ref)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # NaN fill outside [t0, t1) too
    with pytest.raises(_kvfold.KvfError, match="changed since the request was scheduled"):
        one_pass_load(path, dt, buf, dests, layout, ids, bs, t0, t1, payload_digest="0" * 32)
    damage_chunk(path, "values", (L - 1, 0, h1 - 1, 0))
    with pytest.raises(_kvfold.KvfError, match="checksum mismatch in values, layer 2 head 2"):
        one_pass_load(path, dt, buf, dests, layout, ids, bs, t0, t1, heads=(h0, h1), overlap=overlap)
    damage_chunk(path, "keys", (1, 0, h0, 0))  # the earlier damage is found first
    with pytest.raises(_kvfold.KvfError, match="checksum mismatch in keys, layer 1 head 1"):
        one_pass_load(path, dt, buf, dests, layout, ids, bs, t0, t1, heads=(h0, h1), overlap=overlap)


def test_one_pass_loads_on_threads_at_once(root):
    """Loads of files of different shapes on several threads at once (the scratches are kept
    between loads, one set shared): each writes exactly what load() gives."""
    import threading
    from kvfold.blocks import host_destination
    from kvfold.loader import one_pass_load
    from harness import make_cache
    shapes = [(3, 4, 45), (2, 2, 130), (4, 4, 16), (3, 2, 64)]  # layers, kv heads, C
    paths = []
    for i, (L, H, C) in enumerate(shapes):
        paths.append(os.path.join(root, FP, f"t{i}.kvf"))
        write_cache(paths[-1], L, H, D_, C, 300 + i)
    errors = []

    def run(i):
        L, H, C = shapes[i]
        try:
            for _ in range(20):
                ref = bytearray(2 * L * H * C * D_ * 2)
                _kvfold.load(paths[i], "bfloat16", out=ref)
                buf = bytearray(len(ref))
                ids = list(range(-(-C // 16)))
                caches = [make_cache("blocks_first", len(ids), 16, H, D_, torch.bfloat16, "nhd") for _ in range(L)]
                dests = [host_destination(t, l) for l, t in enumerate(caches)]
                one_pass_load(paths[i], "bfloat16", buf, dests, "blocks_first", ids, 16, 0, C)
                assert bytes(buf) == bytes(ref), paths[i]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(shapes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_read_ahead_only_with_a_spare_core(monkeypatch):
    """one_pass_load reads ahead on a helper thread only when the load average leaves a core idle."""
    import kvfold.loader as ld
    seen = []
    monkeypatch.setattr(ld, "_kvfold", type("X", (), {"load_blocks": staticmethod(lambda *a: seen.append(a[-1]))}))
    monkeypatch.setattr(ld.os, "cpu_count", lambda: 2)
    for load, want in ((0.2, True), (1.0, True), (1.25, True), (1.3, False), (1.5, False), (12.0, False)):
        monkeypatch.setattr(ld.os, "getloadavg", lambda load=load: (load, load, load))
        assert ld.spare_core() is want
        ld.one_pass_load("f.kvf", "bfloat16", None, [], "blocks_first", [], 16, 0, 0)
        assert seen.pop() is want
    ld.one_pass_load("f.kvf", "bfloat16", None, [], "blocks_first", [], 16, 0, 0, overlap=True)
    assert seen.pop() is True
