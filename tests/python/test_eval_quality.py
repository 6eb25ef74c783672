"""kvfold eval quality from the command line: the table's columns and its `full` row, probes built
from the records wherever they stand (checked against the record lines of the document's text),
documents without probes and failed documents counted and left out of the averages, and the
full-context fact accuracy against the independent PyTorch reference (tests/reference).

Environment: KVFOLD_BIN (default build/kvfold) and KF_TEST_DATA (default tests/data).
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "reference"))
import hf_reference as ref  # noqa: E402

DATA = os.environ.get("KF_TEST_DATA") or os.path.join(REPO, "tests", "data")
KVFOLD = os.environ.get("KVFOLD_BIN") or os.path.join(REPO, "build", "kvfold")
LLAMA = os.path.join(DATA, "records-llama3-induct")
OLD_COLUMNS = "method budget kl_repeat kl_answer copy_acc qa_em lse_err out_err".split()


def _run(*args, ok=True):
    assert os.access(KVFOLD, os.X_OK), f"kvfold binary not found at {KVFOLD} (set KVFOLD_BIN)"
    env = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2")
    p = subprocess.run([KVFOLD, *args], capture_output=True, text=True, env=env, timeout=300)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def _docs():
    with open(os.path.join(DATA, "records-dev.jsonl")) as f:
        return [json.loads(line) for line in f]


def _write(tmp_path, name, docs):
    path = tmp_path / name
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path)


def _tsv(text):
    lines = text.strip().split("\n")
    header = lines[0].split("\t")
    return header, [dict(zip(header, line.split("\t"))) for line in lines[1:]]


def test_tsv_header_full_row_and_counts(tmp_path):
    docs = _write(tmp_path, "d.jsonl", _docs()[:1])
    p = _run("eval", "quality", "--model", LLAMA, "--docs", docs, "--budget", "0.5,0.25", "--format", "tsv")
    header, rows = _tsv(p.stdout)
    assert header[:8] == OLD_COLUMNS  # scripts read these first; new columns come after
    assert header[8] == "fact_acc"
    for col in ["docs", "failed", "fold_fallbacks", "beta_restarts", "heads_keep", "heads_drop", "heads_am",
                "heads_fold", "docs_without_probes"]:
        assert col in header
    full = rows[0]
    assert (full["method"], full["budget"]) == ("full", "1")
    assert float(full["kl_repeat"]) == 0 and float(full["kl_answer"]) == 0
    assert float(full["lse_err"]) == 0 and float(full["out_err"]) == 0
    assert float(full["fact_acc"]) == 1 and float(full["qa_em"]) == 1  # this model retrieves
    assert [r["method"] for r in rows] == ["full"] + [m for m in ["keep", "drop", "am", "fold"] for _ in (0, 1)]
    for r in rows[1:]:
        assert r["docs"] == "1" and r["failed"] == "0"
        assert float(r["kl_answer"]) > 0
        assert sum(int(r[f"heads_{m}"]) for m in ["keep", "drop", "am", "fold"]) == 4  # 2 layers x 2 KV heads
        for m in ["am", "fold"]:  # the per-head choice may fall back to keep or drop, never to another bias
            assert r["method"] == m or r[f"heads_{m}"] == "0"
    # fewer keys cannot recall more: every method's fact accuracy is lower at 0.25 than at 0.5
    for m in ["keep", "drop"]:
        half, quarter = [r for r in rows if r["method"] == m]
        assert float(quarter["fact_acc"]) <= float(half["fact_acc"])


def _decode(ids):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([KVFOLD, "tokenize", "--model", LLAMA, "--ids"], input=",".join(map(str, ids)),
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _expected_probes(doc, n, form):
    """From the text alone: record lines '- name value' in order, those no question asks about."""
    asked = {re.match(r"Q: (\S+)\?", q["question"]).group(1) for q in doc["questions"]}
    records = re.findall(r"^- (\S+) (\S+)$", doc["text"], flags=re.M)
    out = []
    for name, value in records:
        if name in asked:
            continue
        out.append(f"Q: {name}?\nA:" + (f" {name} {value}\n" if form == "qa" else ""))
    return out[:n]


@pytest.mark.parametrize("form", ["qa", "question"])
def test_probes_from_a_document_that_opens_with_prose(tmp_path, form):
    doc = _docs()[7]  # doc1-7 opens with "At signal meadow north."
    assert not doc["text"].startswith("- ")
    docs = _write(tmp_path, "d.jsonl", [doc])
    out = str(tmp_path / "probes.jsonl")
    p = _run("eval", "quality", "--model", LLAMA, "--docs", docs, "--method", "full", "--probes", "6",
             "--probe-form", form, "--probes-out", out)
    assert "6.0 built on average, 0 documents without probes" in p.stdout
    assert ("question + answer" if form == "qa" else "question only") in p.stdout
    with open(out) as f:
        built = json.loads(f.readline())
    assert built["line"] == 1
    assert [_decode(ids) for ids in built["probes"]] == _expected_probes(doc, 6, form)


def test_documents_without_probes_are_counted(tmp_path):
    good, other = _docs()[0], dict(_docs()[0])
    # the same questions over a document of prose only: no record line to build probes from
    prose = [2912, 3017, 3086, 3102, 46, 10]
    other["ids"] = prose * 4
    other["text"] = "At signal meadow north.\n" * 4
    docs = _write(tmp_path, "d.jsonl", [good, other])
    p = _run("eval", "quality", "--model", LLAMA, "--docs", docs, "--method", "full,keep", "--budget", "0.5",
             "--probes", "4")
    assert "1 documents without probes (lines 2)" in p.stdout
    assert "docs:2: no probes" in p.stderr or ":2: no probes" in p.stderr
    t = _run("eval", "quality", "--model", LLAMA, "--docs", docs, "--method", "keep", "--budget", "0.5",
             "--probes", "4", "--format", "tsv")
    _, rows = _tsv(t.stdout)
    assert rows[0]["docs_without_probes"] == "1" and rows[0]["docs"] == "2"


def test_failed_document_leaves_the_averages(tmp_path):
    good = _docs()[0]
    bad = dict(good, ids=good["ids"][:10] + [99999] + good["ids"][11:])  # outside the vocabulary
    one = _write(tmp_path, "one.jsonl", [good])
    two = _write(tmp_path, "two.jsonl", [good, bad])
    args = ["eval", "quality", "--model", LLAMA, "--method", "full,drop", "--budget", "0.5", "--format", "tsv"]
    a = _run(*args, "--docs", one)
    b = _run(*args, "--docs", two, ok=False)
    assert b.returncode == 1  # reported
    assert "outside the vocabulary" in b.stderr
    assert a.stdout == b.stdout  # the failed document is in no denominator
    c = _run(*args[:-2], "--docs", two, ok=False)
    assert "2 documents read, 1 not evaluated (unreadable 0, reference failed 1)" in c.stdout


def test_full_fact_acc_matches_the_torch_reference(tmp_path):
    doc = _docs()[5]
    docs = _write(tmp_path, "d.jsonl", [doc])
    p = _run("eval", "quality", "--model", LLAMA, "--docs", docs, "--method", "full", "--format", "tsv")
    _, rows = _tsv(p.stdout)
    model = ref.load_model(LLAMA)
    hits = 0
    for q in doc["questions"]:
        ids = doc["ids"] + q["question_ids"] + q["answer_ids"][:1]  # up to the name
        with torch.no_grad():
            logits = ref.forward(model, ids)["logits"]
        hits += int(torch.argmax(logits[-1]).item() == q["answer_ids"][1])
    assert float(rows[0]["fact_acc"]) == pytest.approx(hits / len(doc["questions"]), abs=1e-4)
