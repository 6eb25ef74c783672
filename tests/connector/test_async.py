"""load_mode "async": the request waits in vLLM's WAITING_FOR_REMOTE_KVS state while a loader
thread fills its blocks, other requests keep running, and failures and aborts end the request
without a write into blocks vLLM has freed (harness.Engine models vLLM's scheduler for this)."""
import threading

import pytest
import torch

import kvfold.connector as kc
from harness import COMPUTED, Engine, Request, gather, slots_of
from test_connector import MODEL, cache, damage_chunk, expect, loaded, request


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "caches")


class Gate:
    """Wraps the connector's cold load: loads of the gated paths block until open() (a slow file)."""

    def __init__(self, monkeypatch, *paths):
        self.paths, self.opened, self.entered = set(paths), threading.Event(), threading.Event()
        for name in ("pipelined_load", "one_pass_load"):  # the cold loads of device and host tensors
            monkeypatch.setattr(kc, name, self._gated(getattr(kc, name)))

    def _gated(self, orig):
        def slow(path, *a, **kw):
            if path in self.paths:
                self.entered.set()
                assert self.opened.wait(60), "gate never opened"
            return orig(path, *a, **kw)
        return slow

    def open(self):
        self.opened.set()


@pytest.fixture
def gate(monkeypatch):
    """gate(*paths) -> a Gate; every gate opens at teardown, so a failing test leaves no thread blocked."""
    made = []

    def make(*paths):
        made.append(Gate(monkeypatch, *paths))
        return made[-1]
    yield make
    for g in made:
        g.open()


def async_engine(root, **kw):
    extra = {"cache_root": root, "load_mode": "async", "pool_bytes": 0}
    extra.update(kw.pop("extra", {}))
    return Engine(MODEL, extra, **kw)


def test_slow_file_does_not_stall_other_requests(root, gate):
    path = cache(root, "slow.kvf", 48, 201)
    gate = gate(path)
    eng = async_engine(root, num_blocks=64)
    a, _ = request("a", path, [1, 2, 3], root, max_tokens=3)
    eng.add_request(a)
    eng.add_request(Request("b", [5] * 20, max_tokens=4))
    eng.step()
    assert eng.metas[0].loads[0].asynchronous and a.status == "WAITING_FOR_REMOTE_KVS"
    assert eng.steps[0]["scheduled"] == {"b": 20} and len(a.blocks) == 3  # blocks for C only
    assert gate.entered.wait(30)
    for _ in range(4):  # b finishes all its steps while a's file is still being read
        eng.step()
    assert eng.finished["b"].status == "FINISHED_LENGTH" and a.status == "WAITING_FOR_REMOTE_KVS"
    assert "a" not in eng.finished and a.output_token_ids == []
    gate.open()
    eng.run()
    assert eng.finished["a"].status == "FINISHED_LENGTH" and eng.async_promoted == ["a"]
    T = len(a.prompt_token_ids)
    assert torch.equal(loaded(eng, a, 48), expect(path))  # byte-identical to a synchronous decode
    assert bool((loaded(eng, a, T, t0=48) == COMPUTED).all())  # the question was computed, all of it


def test_async_matches_sync_bytes_and_prefix_hit(root):
    """Same blocks as the synchronous path, with a local prefix-cache hit (blocks 0-2 of an
    earlier request of the same cache) in front of the claim."""
    path = cache(root, "same.kvf", 64, 203)
    out = {}
    for mode in ("sync", "async"):
        eng = Engine(MODEL, {"cache_root": root, "load_mode": mode}, prefix_caching=True, num_blocks=64)
        first, _ = request("first", path, [1, 2], root)
        eng.add_request(first)
        eng.run()
        eng.uncache(first, 3)  # block 3 left the prefix cache
        r, _ = request("r", path, [3, 4, 5], root)
        eng.add_request(r)
        eng.run()
        loads = [s for m in eng.metas for s in m.loads if s.req_id == "r"]
        assert [(s.t0, s.t1, s.asynchronous) for s in loads] == [(48, 64, mode == "async")]
        out[mode] = loaded(eng, r, 64)
        assert eng.finished["r"].status == "FINISHED_LENGTH"
    assert torch.equal(out["sync"], out["async"]) and torch.equal(out["async"], expect(path))


def test_unaligned_claim_loads_synchronously(root):
    """C = 37 ends mid-block: vLLM (len(blocks) * block_size on promotion) would skip the question
    tokens of that block, so the connector loads it synchronously."""
    path = cache(root, "odd.kvf", 37, 205)
    eng = async_engine(root, num_blocks=64)
    r, _ = request("r", path, list(range(1, 21)), root)
    eng.add_request(r)
    eng.run()
    assert not eng.metas[0].loads[0].asynchronous and eng.async_promoted == []
    assert torch.equal(loaded(eng, r, 37), expect(path))
    assert bool((loaded(eng, r, 57, t0=37) == COMPUTED).all())


def test_corrupt_file_fails_the_async_request(root):
    path = cache(root, "bad.kvf", 32, 207)
    damage_chunk(path, "values", (1, 16, 0, 0))  # the header reads fine: only the load finds it
    eng = async_engine(root, num_blocks=32)
    r, _ = request("r", path, [1, 2], root)
    eng.add_request(r)
    eng.add_request(Request("b", [5] * 20, max_tokens=2))
    eng.run()
    assert eng.metas[0].loads[0].asynchronous
    assert eng.finished["r"].status == "FINISHED_ERROR" and eng.finished["r"].output_token_ids == []
    assert eng.async_promoted == [] and "r" not in eng.recomputed  # never scheduled on placeholders
    assert eng.finished["b"].status == "FINISHED_LENGTH"
    assert sorted(eng.free) == list(range(1, 32)) and not eng.delayed  # every block came back


def test_abort_while_loading_keeps_blocks_until_the_thread_stops(root, gate):
    """An abort of a request whose load is running: its blocks stay allocated until the thread
    has finished writing them; a queued load (one thread) is cancelled and writes nothing."""
    p1, p2 = cache(root, "ab1.kvf", 32, 209), cache(root, "ab2.kvf", 32, 211)
    gate = gate(p1)
    eng = async_engine(root, num_blocks=32, extra={"load_threads": 1})
    a, _ = request("a", p1, [1], root)
    b, _ = request("b", p2, [2], root)
    eng.add_request(a)
    eng.add_request(b)
    eng.step()
    assert a.status == b.status == "WAITING_FOR_REMOTE_KVS"
    assert gate.entered.wait(30)
    held_a, held_b = list(a.blocks), list(b.blocks)
    before_b = {n: gather(t, eng.layout, slots_of(held_b, eng.bs, 0, 32)).clone() for n, t in eng.caches.items()}
    eng.abort("a")
    eng.abort("b")
    for _ in range(3):
        eng.step()
    assert "a" in eng.delayed and not set(held_a) & set(eng.free)  # a's thread still runs: blocks held
    assert "b" not in eng.delayed and set(held_b) <= set(eng.free)  # b's load was cancelled: freed
    for n, t in eng.caches.items():  # and b's slots were never written
        after = gather(t, eng.layout, slots_of(held_b, eng.bs, 0, 32))
        assert torch.equal(after.view(torch.int16), before_b[n].view(torch.int16))
    gate.open()
    eng.run()
    assert set(held_a) <= set(eng.free) and not eng.delayed
    assert eng.finished["a"].status == eng.finished["b"].status == "FINISHED_ABORTED"


def test_preempted_after_async_load_reloads(root):
    """Only running requests are preempted; one preempted after its async load waits for a new
    async load (a retention-pool hit) when it resumes, and resumes as a preempted request."""
    path = cache(root, "pre.kvf", 48, 213)
    eng = Engine(MODEL, {"cache_root": root, "load_mode": "async"}, num_blocks=64)
    r, _ = request("r", path, [1, 2, 3], root, max_tokens=4)
    eng.add_request(r)
    for _ in range(2000):  # until its first load is taken up and it runs
        if r.status == "RUNNING":
            break
        eng.step()
    eng.preempt_next = {"r"}
    eng.step()
    assert r.num_preemptions == 1 and r.status == "WAITING_FOR_REMOTE_KVS"
    hits = list(eng.worker.last_loads)
    while eng.waiting or eng.running:
        eng.step()
        hits += eng.worker.last_loads
    assert eng.async_promoted == ["r", "r"] and hits == [("r", True)]
    assert eng.finished["r"].status == "FINISHED_LENGTH"
    assert torch.equal(loaded(eng, r, 48), expect(path))


def test_load_mode_is_checked(root):
    with pytest.raises(ValueError, match="load_mode"):
        Engine(MODEL, {"cache_root": root, "load_mode": "later"})


class ReportsTwice(kc.KVFoldConnector):
    """A faulty connector: reports each finished load again in the next step."""

    def get_finished(self, finished_req_ids):
        sending, recving = super().get_finished(finished_req_ids)
        again, self._again = getattr(self, "_again", None), set(recving or ())
        return sending, (recving or again) or None


def test_stand_in_refuses_unknown_load_reports(root):
    """vLLM asserts that a reported load belongs to a request it holds; so does the stand-in."""
    path = cache(root, "twice.kvf", 32, 215)
    eng = Engine(MODEL, {"cache_root": root, "load_mode": "async"}, module="test_async", class_name="ReportsTwice")
    r, _ = request("r", path, [1, 2], root)
    eng.add_request(r)
    with pytest.raises(AssertionError, match="finished load|reported twice"):
        eng.run()
