"""Chat caches (kvfold compact --chat) through kvfold.prompt: the question goes between the ids the
file records; a chat cache is never asked as bare text nor the reverse; a cache made with another
tokenizer is refused by prompt() and by the connector, naming both digests."""
import os

import numpy as np
import pytest

import kvfold
from harness import Engine, ModelConfig, Request
from test_connector import D_, H_, L_, V_
from util import FP, header

PRE, QPRE, QSUF = [9, 1, 2], [4, 1, 3], [4, 1, 5, 6]  # made-up template pieces (ids)
CHAT = {"chat_template_digest": "5e" * 16, "chat_prefix_ids": "9,1,2", "chat_question_prefix_ids": "4,1,3",
        "chat_question_suffix_ids": "4,1,5,6"}


def write(path, C=32, **extra):
    rng = np.random.default_rng(C)
    k = rng.standard_normal((L_, C, H_, D_), dtype=np.float32)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    kvfold._kvfold.write(path, {**header(L_, H_, D_, C, "%032x" % 77), **extra}, k.tobytes(), k.tobytes())
    return path


@pytest.fixture
def model(tmp_path):
    """A model directory with a tokenizer.json (its bytes are all the digest looks at)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(b'{"model": {"vocab": {"a": 0}}}')
    return str(d)


def test_the_record_reads_back(tmp_path):
    h = kvfold._kvfold.read_header(write(str(tmp_path / "c.kvf"), **CHAT))
    assert {k: h[k] for k in CHAT} == CHAT
    plain = kvfold._kvfold.read_header(write(str(tmp_path / "p.kvf")))
    assert all(plain[k] == "" for k in CHAT)


def test_a_question_goes_between_the_recorded_pieces(tmp_path):
    path = write(str(tmp_path / "c.kvf"), **CHAT)
    p = kvfold.prompt(path, question=[7, 8], id_range=V_)
    assert p.n_placeholders == 32 and p.prompt_token_ids[32:] == QPRE + [7, 8] + QSUF
    seen = []
    t = kvfold.prompt(path, question="why?", id_range=V_, tokenizer=lambda s: seen.append(s) or [11, 12])
    assert seen == ["why?"] and t.prompt_token_ids[32:] == QPRE + [11, 12] + QSUF
    assert t.prompt_token_ids[:32] == p.prompt_token_ids[:32]  # the cache's placeholders, whatever the question


def test_chat_and_bare_text_are_not_mixed(tmp_path):
    chat, plain = write(str(tmp_path / "c.kvf"), **CHAT), write(str(tmp_path / "p.kvf"))
    with pytest.raises(ValueError, match="compacted through a chat template.*question="):
        kvfold.prompt(chat, [7, 8], id_range=V_)
    with pytest.raises(ValueError, match="compacted from bare text.*question_ids"):
        kvfold.prompt(plain, question=[7, 8], id_range=V_)
    with pytest.raises(ValueError, match="one of them"):
        kvfold.prompt(chat, [7], question=[7], id_range=V_)
    with pytest.raises(ValueError, match="one of them"):
        kvfold.prompt(chat, id_range=V_)


def test_another_tokenizer_is_refused_naming_both(tmp_path, model):
    mine = kvfold.tokenizer_digest(model)
    assert len(mine) == 32 and mine != kvfold.tokenizer_digest(str(tmp_path))  # "" without tokenizer.json
    ok = write(str(tmp_path / "ok.kvf"), tokenizer_digest=mine)
    assert kvfold.prompt(ok, [3], model=model, id_range=V_).n_placeholders == 32
    other = write(str(tmp_path / "other.kvf"), tokenizer_digest="0f" * 16)
    with pytest.raises(ValueError, match="another tokenizer.*%s.*%s" % ("0f" * 16, mine)):
        kvfold.prompt(other, [3], model=model, id_range=V_)
    unknown = write(str(tmp_path / "unknown.kvf"))  # ids given directly: nothing to check
    assert kvfold.prompt(unknown, [3], model=model, id_range=V_).n_placeholders == 32


def test_the_connector_refuses_another_tokenizer(tmp_path, model):
    root = str(tmp_path / "caches")
    mine = kvfold.tokenizer_digest(model)
    good = write(os.path.join(root, FP, "good.kvf"), tokenizer_digest=mine)
    bad = write(os.path.join(root, FP, "bad.kvf"), tokenizer_digest="0f" * 16)
    eng = Engine(ModelConfig(model, L_, H_, D_, V_), {"cache_root": root, "model_fingerprint": FP})
    for rid, path in (("good", good), ("bad", bad)):
        p = kvfold.prompt(path, [1, 2], id_range=V_, cache_root=root)
        eng.add_request(Request(rid, p.prompt_token_ids, p.kv_transfer_params, p.cache_salt))
        eng.run()
    assert eng.finished["good"].status == "FINISHED_LENGTH"
    assert eng.finished["bad"].status == "FINISHED_ERROR"
