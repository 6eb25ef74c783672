"""Seeded fuzz of kv_transfer_params through vLLM's real scheduler: 10,000 requests with random
parameters (wrong types, huge, negative, infinite and NaN numbers, bad names and placeholders,
valid parameters on the wrong prompt), batched 256 to a step beside well-formed requests. The
scheduler never raises, every request ends, and every well-formed request is served byte-exact.
The fuzzed requests carry other salts than the well-formed ones' (forged requests under a
cache's own salt: test_forged_placeholders_fail_alone).
"""
import logging
import random

import pytest
import torch

import kvfold
from engine import RealEngine
from harness import Request
from test_connector import MODEL, V_, cache, expect, loaded

N_FUZZ = 10_000
BATCH = 256
NUMBERS = [0, 1, -1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 999, 1000, 1001, 2 ** 31, 2 ** 62, 2 ** 63, 2 ** 64, -(2 ** 63),
           5_000_000, 1e30, -1e30, float("inf"), float("-inf"), float("nan"), 1.5, 32.0, True, False, None, "32", "x",
           [], {}, [32], b"32"]


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "caches")


def _number(rng, good):
    return good if rng.random() < 0.3 else rng.choice(NUMBERS)


def fuzz_params(rng, valid):
    """Random kv_transfer_params: mostly a mutation of a valid one, sometimes anything at all."""
    roll = rng.random()
    if roll < 0.05:
        return rng.choice([None, [], "kvfold", 7, {"kvfold": None}, {"kvfold": []}, {"kvfold": "x"}, {"other": 1}])
    spec = dict(valid)
    for k in rng.sample(list(spec), rng.randint(1, len(spec))):
        r = rng.random()
        if r < 0.15:
            del spec[k]
        elif k in ("n_tokens", "id_range"):
            spec[k] = _number(rng, spec[k])
        elif k == "cache":
            spec[k] = rng.choice(["", "/", "..", "../../etc/passwd", "/dev/zero", "missing.kvf", spec[k] + "x", 5,
                                  None, "\x00", "a" * 5000, spec[k]])
        elif k == "key":
            spec[k] = rng.choice(["", "x", spec[k] + "x", 5, None, spec[k].upper(), spec[k]])
        else:
            spec[k] = rng.choice(["digest-v0", "", None, 1, spec[k]])
    if rng.random() < 0.1:
        spec[rng.choice(["extra", "n_tokens_", "cache_salt"])] = rng.choice([1, "x", None])
    return {"kvfold": spec} if rng.random() < 0.95 else {"kvfold": spec, "other": rng.random()}


def test_fuzzed_kv_transfer_params(root, caplog):
    caplog.set_level(logging.CRITICAL, logger="kvfold.connector")  # one warning per failed request
    caplog.set_level(logging.CRITICAL, logger="vllm")
    rng = random.Random(2026)
    files = [cache(root, f"g{i}.kvf", C, 500 + i) for i, C in enumerate((16, 32, 40, 48))]
    prompts = [kvfold.prompt(p, [1], id_range=V_, cache_root=root) for p in files]
    want = {p: expect(p) for p in files}
    eng = RealEngine(MODEL, {"cache_root": root}, prefix_caching=True, num_blocks=2048, token_budget=16384,
                     max_num_seqs=BATCH, check_untouched=False, mark_computed=False)
    good, fuzzed, n = {}, 0, 0
    while fuzzed < N_FUZZ:
        for _ in range(BATCH):
            i = rng.randrange(len(files))
            p, C = prompts[i], prompts[i].n_placeholders
            question = [rng.randrange(V_) for _ in range(rng.randint(1, 4))]
            rid = f"q{n}"
            n += 1
            if rng.random() < 0.1:  # well-formed, beside the fuzz
                good[rid] = (Request(rid, p.prompt_token_ids[:C] + question, p.kv_transfer_params, p.cache_salt,
                                     max_tokens=1), files[i])
                eng.add_request(good[rid][0])
                continue
            params = fuzz_params(rng, p.kv_transfer_params["kvfold"])
            ids = p.prompt_token_ids[:C] if rng.random() < 0.7 else [rng.randrange(V_) for _ in range(rng.randint(0, C))]
            eng.add_request(Request(rid, ids + question, params, rng.choice([None, "s", p.cache_salt + "x"]),
                                    max_tokens=1))
            fuzzed += 1
        _drain(eng, good, want)
    assert len(eng.finished) == n, "every request ended"
    assert all(eng.finished[rid].status == "FINISHED_LENGTH" for rid in good)


def _drain(eng, good, want):
    """Steps until the batch has ended; each well-formed request is checked in the step that
    scheduled it (once it finished its blocks may serve later requests)."""
    for _ in range(1000):
        if not (eng.sched.has_unfinished_requests() or eng.delayed):
            return
        for rid in eng.step()["scheduled"]:
            if rid in good:
                r, path = good[rid]
                assert torch.equal(loaded(eng, r, want[path].shape[2]), want[path]), rid
    raise AssertionError("a batch did not end")


def _run_checked(eng, want):
    """Runs to the end; each request of want is checked byte-exact in the step that computes it
    (its first C slots hold the file's K/V then); returns the ids ever scheduled to compute."""
    computed = set()
    for _ in range(200):
        if not (eng.sched.has_unfinished_requests() or eng.delayed):
            return computed
        for rid in eng.step()["scheduled"]:
            computed.add(rid)
            if rid in want:
                r, path = want[rid]
                assert torch.equal(loaded(eng, r, 32), expect(path)), rid
    raise AssertionError("requests did not finish")


FORGERIES = {
    "missing file": lambda p: ({"kvfold": dict(p.kv_transfer_params["kvfold"], cache="missing.kvf")}, p.cache_salt),
    "no parameters": lambda p: (None, p.cache_salt),
    "other salt": lambda p: (p.kv_transfer_params, "kvfold-0"),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
@pytest.mark.parametrize("first", ["forged", "good"])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_forged_placeholders_fail_alone(root, mode, prefix_caching, first, forgery):
    """A request with a cache's placeholder ids under a kvfold salt but nothing the connector
    can serve (a missing file, no kvfold parameters, another cache's salt), scheduled in the same
    step as a well-formed request of that cache: the forged one fails alone (its claim is
    asynchronous, so vLLM never caches or shares its blocks), is never computed, and the
    well-formed one, and one after both, are served the file's K/V byte-exact."""
    path = cache(root, "n.kvf", 32, 520)
    p = kvfold.prompt(path, [1], id_range=V_, cache_root=root)
    eng = RealEngine(MODEL, {"cache_root": root, "load_mode": mode}, prefix_caching=prefix_caching,
                     num_blocks=64)
    params, salt = FORGERIES[forgery](p)
    forged = Request("forged", p.prompt_token_ids, params, salt, max_tokens=1)
    good = Request("good", p.prompt_token_ids[:32] + [2, 3], p.kv_transfer_params, p.cache_salt, max_tokens=1)
    for r in ((forged, good) if first == "forged" else (good, forged)):
        eng.add_request(r)
    computed = _run_checked(eng, {"good": (good, path)})
    assert eng.finished["forged"].status == "FINISHED_ERROR" and "forged" not in computed
    assert eng.finished["good"].status == "FINISHED_LENGTH" and "good" in computed
    specs = [s for m in eng.metas for s in m.loads]
    assert all(s.reason and s.asynchronous for s in specs if s.req_id == "forged")
    assert [(s.t0, s.t1, s.reason) for s in specs if s.req_id == "good"] in ([(0, 32, None)], [])
    again = Request("again", p.prompt_token_ids[:32] + [4], p.kv_transfer_params, p.cache_salt, max_tokens=1)
    eng.add_request(again)
    _run_checked(eng, {"again": (again, path)})
    assert eng.finished["again"].status == "FINISHED_LENGTH"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_forged_request_after_a_full_hit_fails_alone(root, mode):
    """The cache's blocks are in vLLM's prefix cache and a forged request's prompt is all hits but
    its last token: it claims that token (asynchronously) and fails; the cached blocks stay."""
    path = cache(root, "h.kvf", 32, 521)
    p = kvfold.prompt(path, [1], id_range=V_, cache_root=root)
    eng = RealEngine(MODEL, {"cache_root": root, "load_mode": mode, "on_invalid": "ignore"}, prefix_caching=True,
                     num_blocks=64)
    first = Request("first", p.prompt_token_ids, p.kv_transfer_params, p.cache_salt, max_tokens=1)
    eng.add_request(first)
    _run_checked(eng, {"first": (first, path)})
    bad = dict(p.kv_transfer_params["kvfold"], cache="missing.kvf")
    forged = Request("forged", p.prompt_token_ids, {"kvfold": bad}, p.cache_salt, max_tokens=1)
    good = Request("good", p.prompt_token_ids[:32] + [2, 3], p.kv_transfer_params, p.cache_salt, max_tokens=1)
    eng.add_request(forged)
    eng.add_request(good)
    computed = _run_checked(eng, {"good": (good, path)})
    assert [(s.t0, s.t1, s.asynchronous) for m in eng.metas for s in m.loads if s.req_id == "forged"] == \
        [(32, 33, True)]
    assert eng.finished["forged"].status == "FINISHED_ERROR" and "forged" not in computed
    assert eng.finished["good"].status == "FINISHED_LENGTH"
    assert eng.cached_blocks(good, 2) == 2
