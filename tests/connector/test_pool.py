"""The retention pool's eviction order: lowest probability_of_reuse * reload_seconds / pages first."""
import os

from kvfold.pool import RetentionPool


def touch(tmp_path, name):
    p = os.path.join(tmp_path, name)
    open(p, "wb").close()
    return p


def loader(nbytes, pages, seconds):
    return lambda: ({"n_tokens": pages * 16}, bytearray(nbytes))


def test_eviction_order(tmp_path, monkeypatch):
    pool = RetentionPool(limit_bytes=300)
    a, b, c, d = (touch(tmp_path, n) for n in "abcd")
    ea, hit = pool.get(a, "bfloat16", loader(100, 1, 0))
    assert not hit
    pool.get(b, "bfloat16", loader(100, 1, 0))
    pool.get(c, "bfloat16", loader(100, 1, 0))
    # reload cost: a slow to reload per page, b cheap; c hit often
    pool._entries[RetentionPool.key(a, "bfloat16")].reload_s = 1.0
    pool._entries[RetentionPool.key(b, "bfloat16")].reload_s = 0.01
    pool._entries[RetentionPool.key(c, "bfloat16")].reload_s = 0.01
    for _ in range(5):
        assert pool.get(c, "bfloat16", loader(100, 1, 0))[1]
    pool.get(d, "bfloat16", loader(100, 1, 0))  # evicts b: cheap to reload and never reused
    kept = set(pool.entries())
    assert os.path.realpath(b) not in kept and {os.path.realpath(x) for x in (a, c, d)} <= kept
    assert pool.stats["evictions"] == 1 and pool.bytes == 300


def test_too_large_is_not_retained(tmp_path):
    pool = RetentionPool(limit_bytes=50)
    a = touch(tmp_path, "a")
    e, hit = pool.get(a, "bfloat16", loader(100, 1, 0))
    assert len(e.data) == 100 and len(pool) == 0 and pool.stats["not_retained"] == 1


def test_replaced_file_is_a_miss(tmp_path):
    pool = RetentionPool(limit_bytes=1000)
    a = touch(tmp_path, "a")
    pool.get(a, "bfloat16", loader(10, 1, 0))
    os.remove(a)
    with open(a, "wb") as f:
        f.write(b"x")
    assert not pool.get(a, "bfloat16", loader(10, 1, 0))[1]


def test_staging_buffers_are_reused(tmp_path):
    """A cold load decodes into a staging buffer; an entry that is not retained gives its buffer
    back after release, an evicted entry on eviction; the next load of a fitting size reuses it."""
    pool = RetentionPool(limit_bytes=100)
    a, b, c = (touch(tmp_path, n) for n in "abc")
    seen = []

    def load(buf):
        seen.append(buf)
        buf[:] = bytes([len(seen)]) * len(buf)
        return {"n_tokens": 16}, buf

    big, hit = pool.get(a, "bfloat16", load, nbytes=150)  # larger than the pool: not retained
    assert not hit and not big.retained and bytes(big.data) == b"\x01" * 150
    pool.release(big)
    e, _ = pool.get(b, "bfloat16", load, nbytes=80)  # reuses a's buffer (150 bytes hold 80)
    assert pool.staging.stats == {"new": 1, "reused": 1} and e.retained and bytes(e.data) == b"\x02" * 80
    pool.release(e)  # retained: its buffer stays with the entry
    assert pool.get(b, "bfloat16", load, nbytes=80)[0].data is e.data
    pool.get(c, "bfloat16", load, nbytes=60)  # no free buffer: a new one; then b is evicted, its buffer freed
    assert pool.stats["evictions"] == 1 and pool.staging.stats["new"] == 2
    assert bytes(pool.get(b, "bfloat16", load, nbytes=80)[0].data) == b"\x04" * 80


def test_failed_load_gives_the_buffer_back(tmp_path):
    pool = RetentionPool(limit_bytes=1000)
    a = touch(tmp_path, "a")

    def boom(buf):
        raise OSError("unreadable")
    try:
        pool.get(a, "bfloat16", boom, nbytes=64)
    except OSError:
        pass
    pool.get(a, "bfloat16", lambda buf: ({"n_tokens": 16}, buf), nbytes=64)
    assert pool.staging.stats == {"new": 1, "reused": 1}
