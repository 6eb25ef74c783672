"""kv_connector_extra_config is checked when the connector is constructed: each bad key is named
there, instead of failing every request later."""
import pytest

from harness import Engine
from test_connector import MODEL
from util import FP

BAD = [
    ("cache_root", 123), ("cache_root", ""), ("cache_root", ["/caches"]),
    ("model_fingerprint", FP.upper()), ("model_fingerprint", int(FP, 16)), ("model_fingerprint", FP[:31]),
    ("model_fingerprint", FP + "0"), ("model_fingerprint", "zz" * 16),
    ("pool_bytes", -1), ("pool_bytes", 1.5), ("pool_bytes", "4GiB"), ("pool_bytes", True), ("pool_bytes", 2 ** 70),
    ("on_invalid", "warn"), ("on_invalid", None), ("copy_backend", "cuda"), ("load_mode", "ASYNC"),
    ("load_parts", 0), ("load_parts", 4.0), ("load_threads", 0), ("load_threads", 10 ** 6),
    ("kv_layout", "paged"), ("kv_layout", 3),
]


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v!r}"[:40] for k, v in BAD])
def test_a_bad_key_stops_construction_naming_it(tmp_path, key, value):
    with pytest.raises(ValueError, match=f"'{key}' is "):
        Engine(MODEL, {"cache_root": str(tmp_path), key: value})


def test_unknown_keys_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['pool_byte'\].*pool_bytes"):
        Engine(MODEL, {"cache_root": str(tmp_path), "pool_byte": 0})


def test_good_values_are_taken(tmp_path, monkeypatch):
    eng = Engine(MODEL, {"cache_root": str(tmp_path), "model_fingerprint": FP, "pool_bytes": 0, "load_parts": 2,
                         "load_mode": "async", "load_threads": 3, "kv_layout": "FlashInfer", "on_invalid": "ignore"},
                 layout="blocks_first")
    w = eng.worker
    assert (w._model_fp, w._pool.limit_bytes, w._load_parts, w._async, w._load_threads, w._on_invalid) == \
        (FP, 0, 2, True, 3, "ignore")
    monkeypatch.setenv("KVFOLD_CACHE_ROOT", str(tmp_path))
    assert Engine(MODEL, {}).scheduler._cache_root == str(tmp_path)


def test_hybrid_kv_cache_manager_forced_on_is_refused_naming_it(tmp_path):
    """--no-disable-hybrid-kv-cache-manager keeps vLLM's hybrid manager on for this connector, which
    does not declare SupportsHMA: construction fails with a message that says so."""
    from types import SimpleNamespace

    from kvfold.connector import KVFoldConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    eng = Engine(MODEL, {"cache_root": str(tmp_path)})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        eng.vllm_config.scheduler_config = SimpleNamespace(disable_hybrid_kv_cache_manager=False)
        with pytest.raises(ValueError, match=r"hybrid KV cache manager is on \(--no-disable-hybrid-kv-cache-manager\)"
                                             r".*SupportsHMA.*without that flag"):
            KVFoldConnector(eng.vllm_config, role, eng.kv_cache_config)
        eng.vllm_config.scheduler_config = SimpleNamespace(disable_hybrid_kv_cache_manager=True)
        KVFoldConnector(eng.vllm_config, role, eng.kv_cache_config)
