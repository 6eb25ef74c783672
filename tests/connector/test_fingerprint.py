"""The model fingerprint the connector takes from DIR/.kvfold-fingerprint is that of the files
kvfold's loader reads: an index and shards added beside model.safetensors, or weights changed in
place with their mtime put back, make the cached value unusable, on the C side and here."""
import json
import os
import shutil
import struct

import pytest

from conftest import DATA
from kvfold.fingerprint import read_fingerprint_cache
from test_e2e import LIB, Helper

TINY = os.path.join(DATA, "hf-qwen3-tiny")


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    for n in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(TINY, n), d / n)
    return str(d)


def loader_fingerprint(model_dir):
    """kvfold's own loader: kf_model_load (which reads or refreshes the cache file)."""
    if not os.path.exists(LIB):
        pytest.fail(f"{LIB}: the conntest helper is not built (cmake --build <dir> --target kf_conntest)")
    h = Helper(LIB)
    m = h.lib.kfct_model_load(model_dir.encode(), h.err, 512)
    assert m, h.err.value.decode()
    fp = h.lib.kfct_model_fingerprint(m).decode()
    h.lib.kfct_model_free(m)
    return fp


def flip_first_weight_byte(path):
    """The lowest mantissa byte of the first tensor: the size stays, the weights change."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + n)
        b = f.read(1)
        f.seek(8 + n)
        f.write(bytes([b[0] ^ 1]))


def tensor_names(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def test_the_cache_serves_the_loaders_fingerprint(model):
    fp = loader_fingerprint(model)
    assert read_fingerprint_cache(model) == (fp, "")


def test_an_index_and_shards_beside_the_weights(model):
    """Some repositories ship both: the loader then reads the shards, and so must the fingerprint."""
    fp = loader_fingerprint(model)
    shard = os.path.join(model, "model-00001-of-00001.safetensors")
    shutil.copy(os.path.join(model, "model.safetensors"), shard)
    flip_first_weight_byte(shard)
    with open(os.path.join(model, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {t: os.path.basename(shard) for t in tensor_names(shard)}}, f)
    got, why = read_fingerprint_cache(model)
    assert got is None and "the loader now reads" in why
    fp_shards = loader_fingerprint(model)
    assert fp_shards != fp
    assert read_fingerprint_cache(model) == (fp_shards, "")


def test_weights_changed_in_place_with_the_mtime_kept(model):
    fp = loader_fingerprint(model)
    w = os.path.join(model, "model.safetensors")
    st = os.stat(w)
    flip_first_weight_byte(w)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(w).st_mtime_ns == st.st_mtime_ns and os.stat(w).st_size == st.st_size
    got, why = read_fingerprint_cache(model)
    assert got is None and "model.safetensors changed" in why
    fp_new = loader_fingerprint(model)  # the C side's cache is invalidated too
    assert fp_new != fp
    assert read_fingerprint_cache(model) == (fp_new, "")


def test_other_weight_files_without_an_index(model):
    """vLLM would load every *.safetensors, kvfold only model.safetensors: no fingerprint."""
    loader_fingerprint(model)
    shutil.copy(os.path.join(model, "model.safetensors"), os.path.join(model, "extra.safetensors"))
    got, why = read_fingerprint_cache(model)
    assert got is None and "without model.safetensors.index.json" in why
