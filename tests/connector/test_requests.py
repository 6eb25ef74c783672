"""What a client sends, and which cache it gets: every value of kv_transfer_params["kvfold"] is
checked before any work, a bad request fails alone (nothing leaves a scheduler-side method), and a
cache's identity is its content (two recipes of one document never share placeholder blocks)."""
import math
import os

import numpy as np
import pytest
import torch

import kvfold
from harness import Engine, ModelConfig, Request
from test_connector import D_, H_, L_, MODEL, V_, cache, expect, loaded, request
from util import FP, write_cache


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "caches")


def test_two_recipes_of_one_document_never_share_blocks(root):
    """Files a and b of one document (same digest, method, budget, C) with different payloads:
    their placeholder ids and salts differ, so with prefix caching a request for b after one for a
    gets b's K/V, not a's blocks."""
    doc = "%032x" % 4242
    a, b = (os.path.join(root, FP, n) for n in ("a.kvf", "b.kvf"))
    write_cache(a, L_, H_, D_, 32, 1, doc=doc)
    write_cache(b, L_, H_, D_, 32, 2, doc=doc)
    ha, hb = kvfold._kvfold.read_header(a), kvfold._kvfold.read_header(b)
    assert ha["document_digest"] == hb["document_digest"] and ha["payload_digest"] != hb["payload_digest"]
    eng = Engine(MODEL, {"cache_root": root}, prefix_caching=True, num_blocks=64)
    ra, pa = request("a", a, [1, 2, 3], root)
    rb, pb = request("b", b, [1, 2, 3], root)
    assert pa.prompt_token_ids[:32] != pb.prompt_token_ids[:32] and pa.cache_salt != pb.cache_salt
    eng.add_request(ra)
    eng.run()
    eng.add_request(rb)
    eng.run()
    assert eng.finished["b"].status == "FINISHED_LENGTH"
    assert torch.equal(loaded(eng, rb, 32), expect(b)) and not torch.equal(expect(a), expect(b))


def test_a_file_replaced_by_another_recipe_fails_the_old_prompt(root):
    """The prompt names the payload: the same name holding another recipe's bytes is refused."""
    doc = "%032x" % 4243
    path = os.path.join(root, FP, "r.kvf")
    write_cache(path, L_, H_, D_, 32, 1, doc=doc)
    r, _ = request("r", path, [1, 2], root)
    write_cache(path, L_, H_, D_, 32, 2, doc=doc)
    eng = Engine(MODEL, {"cache_root": root})
    eng.add_request(r)
    eng.run()
    assert eng.finished["r"].status == "FINISHED_ERROR"


def test_cache_key_needs_the_payload_digest(root):
    h = kvfold._kvfold.read_header(cache(root, "k.kvf", 16, 3))
    assert h["payload_digest"] in kvfold.cache_key(h)
    for bad in (None, "", "AB" * 16, "ab" * 15):
        with pytest.raises(ValueError, match="payload digest"):
            kvfold.cache_key({**h, "payload_digest": bad})


BAD_VALUES = {
    "n_tokens": [1e30, 2 ** 62, math.inf, math.nan, -1, 0, True, "32", [32], None, 32.0, 5_000_000, 10 ** 400],
    "id_range": [math.inf, 2 ** 62, 1, V_ + 1, True, 1e3, "1000", None],
    "key": [123, "", "x" * 5000, None, ["k"]],
    "cache": [123, "", "a\x00b", ["x.kvf"], {"p": 1}],
    "scheme": ["digest-v1", None, 5],
}
CASES = [(k, v) for k, vs in BAD_VALUES.items() for v in vs]


def _ids(case):
    k, v = case
    return f"{k}={type(v).__name__}:{str(v)[:12]}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_a_bad_value_fails_its_request_alone(root, case, caplog):
    """Each bad value: the request ends FINISHED_ERROR with a message naming the entry, a good
    request in the same steps is served byte-exact, and no scheduler-side call raises."""
    entry, value = case
    path = cache(root, "g.kvf", 32, 5)
    eng = Engine(MODEL, {"cache_root": root}, num_blocks=64)
    good, _ = request("good", path, [1, 2], root)
    bad, _ = request("bad", path, [1, 2], root)
    bad.kv_transfer_params["kvfold"][entry] = value
    eng.add_request(bad)
    eng.add_request(good)
    eng.run()
    assert eng.finished["bad"].status == "FINISHED_ERROR"
    assert eng.finished["good"].status == "FINISHED_LENGTH"
    assert torch.equal(loaded(eng, good, 32), expect(path))
    assert any(f"'{entry}'" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    ignore = Engine(MODEL, {"cache_root": root, "on_invalid": "ignore"})
    unsalted = Request("unsalted", bad.prompt_token_ids, bad.kv_transfer_params, None)
    assert ignore.scheduler.get_num_new_matched_tokens(unsalted, 0) == (0, False)
    claim, load_async = ignore.scheduler.get_num_new_matched_tokens(bad, 0)  # under kvfold's salt: fails anyway
    assert claim >= 1 and load_async


@pytest.mark.parametrize("spec", ["x.kvf", [1, 2], 7, {"cache": "x", "unknown": 1}, {}])
def test_malformed_entry_fails_alone(root, spec):
    eng = Engine(MODEL, {"cache_root": root})
    r = Request("m", [5] * 40, {"kvfold": spec}, max_tokens=1)
    assert eng.scheduler.get_num_new_matched_tokens(r, 0) == (1, True)  # one token claimed, to fail it
    eng.add_request(r)
    eng.run()
    assert eng.finished["m"].status == "FINISHED_ERROR"


@pytest.mark.parametrize("bad", [-1, V_, 10 ** 30, 1.5, True])
def test_question_ids_outside_the_vocabulary_fail(root, bad):
    path = cache(root, "q.kvf", 32, 6)
    eng = Engine(MODEL, {"cache_root": root})
    r, _ = request("q", path, [1, 2], root)
    r.prompt_token_ids[33] = bad
    eng.add_request(r)
    eng.run()
    assert eng.finished["q"].status == "FINISHED_ERROR"


def test_a_huge_n_tokens_builds_no_more_ids_than_the_prompt_holds(root, monkeypatch):
    """However many placeholders n_tokens claims, only the prompt's length of ids is built."""
    import kvfold.connector as kc
    built = []
    real = kc.placeholder_ids
    monkeypatch.setattr(kc, "placeholder_ids", lambda key, n, r: built.append(n) or real(key, n, r))
    path = cache(root, "h.kvf", 16, 7)
    eng = Engine(MODEL, {"cache_root": root})
    r, _ = request("h", path, [1, 2, 3, 4], root)
    for n in (5_000_000, 2 ** 31 - 1, 2 ** 62, 10 ** 30):
        r.request_id = f"h{n}"
        r.kv_transfer_params["kvfold"]["n_tokens"] = n
        claim, load_async = eng.scheduler.get_num_new_matched_tokens(r, 0)
        assert claim < len(r.prompt_token_ids) and load_async  # claimed to fail
        assert eng.scheduler._decisions[r.request_id].reason
    assert built and max(built) <= len(r.prompt_token_ids)


def test_nothing_leaves_a_scheduler_method(root, monkeypatch):
    """A fault the checks do not foresee still answers safely: the request fails or is left alone."""
    path = cache(root, "n.kvf", 32, 8)
    eng = Engine(MODEL, {"cache_root": root})
    s = eng.scheduler

    class Hostile(dict):
        def get(self, *a):
            raise RuntimeError("hostile params")
    r = Request("x", [5] * 40, Hostile(kvfold={}), max_tokens=1)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    monkeypatch.setattr(type(s), "_evaluate", lambda self, req, spec: 1 / 0)
    r2, _ = request("y", path, [1, 2], root)
    assert s.get_num_new_matched_tokens(r2, 0) == (1, True)  # failed alone
    s.update_state_after_alloc(r2, None, 1)  # no blocks object: logged, nothing raised
    s._pending = None  # any fault inside
    assert s.build_connector_meta(None).loads == []
    assert s.request_finished(r2, None) == (False, None)


def test_prompt_checks_question_ids(root):
    path = cache(root, "p.kvf", 16, 9)
    for bad in ([-1], [V_], [1.5], [True], ["3"], [1, None], [1, 2 ** 70]):
        with pytest.raises(ValueError, match="question id"):
            kvfold.prompt(path, bad, id_range=V_)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kvfold.prompt(path, [600], id_range=V_, vocab=500)
    p = kvfold.prompt(path, np.array([3, 999], dtype=np.int64), id_range=V_)
    assert p.prompt_token_ids[16:] == [3, 999] and all(type(t) is int for t in p.prompt_token_ids)
    for bad_range in (1, 2.5, True):
        with pytest.raises(ValueError, match="id_range"):
            kvfold.prompt(path, [1], id_range=bad_range)
