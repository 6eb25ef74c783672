"""The semantic end-to-end check on the trained records model.

kvfold compacts a records document (fold, budget 0.25) and writes it as a kvf file (conntest.c:
kf_compact + kvf_write, as `kvfold compact` does). The connector loads the file into paged blocks
in vLLM's call order (harness.Engine); the C slots are gathered back from the blocks through the
tensor's strides and attached to kvfold's own paged engine, and a question runs on top at
positions C, C+1, ... Its logits must match, within 1e-4, the compactor's in-memory evaluation of
the same cache with K/V rounded to the KV cache's dtype (what any bf16/fp16 cache holds), for every
layout, block size and dtype. The blocks must also hold exactly the file's K/V in that dtype.
"""
import ctypes
import json
import os

import numpy as np
import pytest
import torch

import kvfold
from conftest import DATA, REPO
from harness import PROFILE_LAYOUTS, Engine, ModelConfig, Request, gather, slots_of
from kvfold.prompt import model_id_range

RECORDS = os.path.join(DATA, "records-qwen3")
LIB = os.environ.get("KVFOLD_CONNTEST_LIB") or os.path.join(REPO, "build", "tests", "libkf_conntest.so")


class Helper:
    def __init__(self, path):
        lib = ctypes.CDLL(path)
        P, I, D, C = ctypes.c_void_p, ctypes.c_int, ctypes.c_double, ctypes.c_char_p
        I32, F32, I64 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int64)
        lib.kfct_model_load.restype = P
        lib.kfct_model_load.argtypes = [C, C, I]
        lib.kfct_model_free.argtypes = [P]
        lib.kfct_model_shape.argtypes = [P, ctypes.POINTER(ctypes.c_int)]
        lib.kfct_model_fingerprint.restype = C
        lib.kfct_model_fingerprint.argtypes = [P]
        lib.kfct_compact.restype = P
        lib.kfct_compact.argtypes = [P, I32, I, I32, I, C, D, I64, C, I]
        lib.kfct_compacted_free.argtypes = [P]
        lib.kfct_compacted_write.argtypes = [P, P, I32, I, C, C, C, I]
        lib.kfct_compacted_logits.argtypes = [P, P, C, I32, I, F32, C, I]
        lib.kfct_kv_logits.argtypes = [P, F32, F32, ctypes.c_int64, I32, I, F32, C, I]
        self.lib = lib
        self.err = ctypes.create_string_buffer(512)

    def check(self, rc):
        if rc:
            raise RuntimeError(self.err.value.decode())


def i32(a):
    a = np.ascontiguousarray(a, dtype=np.int32)
    return a, a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))


def f32(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not os.path.exists(LIB):
        pytest.fail(f"{LIB}: the conntest helper is not built (cmake --build <dir> --target kf_conntest)")
    h = Helper(LIB)
    m = h.lib.kfct_model_load(RECORDS.encode(), h.err, 512)
    if not m:
        raise RuntimeError(h.err.value.decode())
    shape = (ctypes.c_int * 4)()
    h.lib.kfct_model_shape(m, shape)
    n_layers, kv_heads, head_dim, vocab = list(shape)
    fp = h.lib.kfct_model_fingerprint(m).decode()
    with open(os.path.join(DATA, "records-dev.jsonl")) as f:
        doc = json.loads(f.readlines()[1])  # doc1-1
    ids, pids = i32(doc["ids"])
    instr, pinstr = i32(doc["repeat_instruction_ids"])
    C = ctypes.c_int64()
    c = h.lib.kfct_compact(m, pids, len(ids), pinstr, len(instr), b"fold", 0.25, ctypes.byref(C), h.err, 512)
    if not c:
        raise RuntimeError(h.err.value.decode())
    root = str(tmp_path_factory.mktemp("caches"))
    digest = kvfold._kvfold.document_digest(doc["ids"])
    files = {}
    for dt in ("float32", "bfloat16"):
        path = os.path.join(root, fp, f"{digest}.fold-0.25.{dt}.kvf")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        h.check(h.lib.kfct_compacted_write(m, c, pids, len(ids), dt.encode(), path.encode(), h.err, 512))
        files[dt] = path
    q = doc["questions"][0]["question_ids"]
    qa, pq = i32(q)
    ref = {}
    for dt in ("bfloat16", "float16", "float32"):
        out = np.zeros((len(q), vocab), np.float32)
        h.check(h.lib.kfct_compacted_logits(m, c, dt.encode(), pq, len(q), f32(out), h.err, 512))
        ref[dt] = out
    model = ModelConfig(RECORDS, n_layers, kv_heads, head_dim, vocab)
    yield dict(h=h, m=m, model=model, fp=fp, root=root, files=files, q=q, ref=ref, C=C.value)
    h.lib.kfct_compacted_free(c)
    h.lib.kfct_model_free(m)


def test_frames_agree(setup):
    """Rounding the cache to bf16 moves the logits (by ~0.3 here): hence the comparison against the
    rounded in-memory cache, not the fp32 one."""
    d = float(np.abs(setup["ref"]["bfloat16"] - setup["ref"]["float32"]).max())
    assert 0 < d < 1.0


@pytest.mark.parametrize("layout,order", PROFILE_LAYOUTS)
@pytest.mark.parametrize("bs,kbs", [(16, 16), (32, 32), (32, 16)])
@pytest.mark.parametrize("cache_dtype,file_dtype", [(torch.bfloat16, "float32"), (torch.float16, "float32"),
                                                    (torch.bfloat16, "bfloat16")])
def test_question_logits_through_blocks(setup, layout, order, bs, kbs, cache_dtype, file_dtype):
    s, C = setup, setup["C"]
    path = s["files"][file_dtype]
    eng = Engine(s["model"], {"cache_root": s["root"], "model_fingerprint": s["fp"], "kv_layout": layout},
                 layout=layout, order=order, block_size=bs, kernel_block_size=kbs, dtype=cache_dtype,
                 num_blocks=C // bs + 8, check_untouched=False)
    p = kvfold.prompt(path, s["q"], id_range=model_id_range(RECORDS), cache_root=s["root"])
    req = Request("q", p.prompt_token_ids, p.kv_transfer_params, p.cache_salt)
    eng.add_request(req)
    eng.step()
    assert not eng.steps[0]["errors"] and eng.metas[0].loads[0].t1 == C
    slots = slots_of(req.blocks, bs, 0, C)
    kv = torch.stack([gather(eng.caches[n], layout, slots) for n in eng.layer_names], 1)  # [2, L, C, H, D]
    dname = "bfloat16" if cache_dtype == torch.bfloat16 else "float16"
    h, raw = kvfold._kvfold.load(path, dname)
    want = torch.frombuffer(raw, dtype=cache_dtype).view(kv.shape)
    assert torch.equal(kv, want)  # exactly the file's K/V in the cache's dtype
    kv = kv.float().numpy()
    keys, values = np.ascontiguousarray(kv[0]), np.ascontiguousarray(kv[1])
    qa, pq = i32(s["q"])
    out = np.zeros_like(s["ref"][dname])
    s["h"].check(s["h"].lib.kfct_kv_logits(s["m"], f32(keys), f32(values), C, pq, len(s["q"]), f32(out),
                                           s["h"].err, 512))
    diff = float(np.abs(out - s["ref"][dname]).max())
    assert diff < 1e-4, f"max |dlogit| {diff:.2e}"
