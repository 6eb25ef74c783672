"""The PyTorch reference (tests/reference/hf_reference.py) against transformers' golden tensors,
and the kvfold CLI against the reference.

Environment: KVFOLD_BIN (the kvfold binary; default build/kvfold) and KF_TEST_DATA (default
tests/data), both relative to the repository root when unset. Run with Debian's python3:
    /usr/bin/python3 -m pytest -q tests/python
"""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "reference"))
import hf_reference as ref  # noqa: E402

DATA = os.environ.get("KF_TEST_DATA") or os.path.join(REPO, "tests", "data")
KVFOLD = os.environ.get("KVFOLD_BIN") or os.path.join(REPO, "build", "kvfold")
REF_SCRIPT = os.path.join(REPO, "tests", "reference", "hf_reference.py")

GOLDEN_MODELS = ["hf-qwen3-tiny", "hf-llama3-tiny-random"]
RECORDS = os.path.join(DATA, "records-qwen3")


def rel_err(got, want):
    # Relative to the tensor's scale, not per element: the residual stream reaches ~3000 while
    # some entries sit near zero, where a per-element relative error means nothing.
    want = np.asarray(want, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.fixture(scope="module", params=GOLDEN_MODELS)
def golden_run(request):
    model_dir = os.path.join(DATA, request.param)
    model = ref.load_model(model_dir)
    golden = ref.read_safetensors(os.path.join(model_dir, "golden.safetensors"))
    with torch.no_grad():
        out = ref.forward(model, golden["input_ids"].tolist())
    return model, golden, out


# --- the reference against transformers ----------------------------------------------------------

def test_golden_hidden(golden_run):
    model, golden, out = golden_run
    assert len(out["hidden"]) == model.n_layers + 1
    for i, h in enumerate(out["hidden"]):
        want = golden[f"hidden.{i}"]
        assert h.shape == want.shape, f"hidden.{i}"
        assert rel_err(h.numpy(), want) < 1e-4, f"hidden.{i}"


def test_golden_kv(golden_run):
    model, golden, out = golden_run
    for i in range(model.n_layers):
        for name in ("k", "v"):
            want = golden[f"{name}.{i}"]
            got = out[name][i].numpy()
            assert got.shape == want.shape, f"{name}.{i}"
            assert rel_err(got, want) < 1e-4, f"{name}.{i}"


def test_golden_logits(golden_run):
    _, golden, out = golden_run
    logits = out["logits"].numpy()
    assert np.abs(logits[-16:] - golden["logits_last16"]).max() < 1e-3
    np.testing.assert_array_equal(logits.argmax(-1), golden["argmax"])


def test_last_only_matches_full(golden_run):
    model, golden, out = golden_run
    with torch.no_grad():
        last = ref.forward(model, golden["input_ids"].tolist(), last_only=True, keep=False)
    assert last["logits"].shape == (1, model.vocab_size)
    assert torch.allclose(last["logits"][0], out["logits"][-1], atol=1e-5, rtol=0)


def test_llama3_rope_scaling_matters():
    # The golden sequence (300) is longer than original_max_position_embeddings (64), so plain
    # RoPE must miss the golden keys: this guards against the scaling silently not applying.
    model = ref.load_model(os.path.join(DATA, "hf-llama3-tiny-random"))
    golden = ref.read_safetensors(os.path.join(DATA, "hf-llama3-tiny-random", "golden.safetensors"))
    model.inv_freq = ref.rope_inv_freq(model.head_dim, {"rope_type": "default",
                                                        "rope_theta": model.rope["rope_theta"]})
    with torch.no_grad():
        out = ref.forward(model, golden["input_ids"].tolist())
    assert rel_err(out["k"][0].numpy(), golden["k.0"]) > 1e-2


def test_rope_config_forms():
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    new = ref.rope_settings({"rope_parameters": dict(params, rope_theta=500000.0)})
    legacy = ref.rope_settings({"rope_theta": 500000.0, "rope_scaling": params})
    # Older checkpoints spell the key `type`.
    older_scaling = {k: v for k, v in params.items() if k != "rope_type"}
    older_scaling["type"] = "llama3"
    older = ref.rope_settings({"rope_theta": 500000.0, "rope_scaling": older_scaling})
    older.pop("type")
    assert new == legacy == older
    assert ref.rope_settings({"rope_theta": 1e4, "rope_scaling": None}) == \
        {"rope_type": "default", "rope_theta": 1e4}
    base = ref.rope_inv_freq(16, {"rope_type": "default", "rope_theta": 1e4})
    lin = ref.rope_inv_freq(16, {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0})
    assert torch.allclose(lin, base / 4)
    with pytest.raises(NotImplementedError):
        ref.rope_settings({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


# --- kvfold against the reference ----------------------------------------------------------------

def _kvfold(*args):
    if not os.access(KVFOLD, os.X_OK):
        pytest.fail(f"kvfold binary not found at {KVFOLD} (set KVFOLD_BIN)")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("OPENBLAS_NUM_THREADS", "2")
    return subprocess.run([KVFOLD, *args], capture_output=True, text=True, env=env, timeout=120)


def _records_prompts():
    with open(os.path.join(DATA, "records-dev.jsonl")) as f:
        docs = [json.loads(line) for line in f]
    # A short document alone, one repeat prompt (document copied after the instruction: the
    # attention structure the compactor relies on), and one long document cut at 300 tokens.
    short = docs[0]
    q = docs[5]["questions"][0]
    prompts = [
        ("doc", short["ids"][:300], None),
        ("repeat-chunk64", (short["ids"] + short["repeat_instruction_ids"] + short["ids"])[:300], "64"),
        ("long-chunk7", docs[3]["ids"][:300], "7"),
        ("question", (docs[5]["ids"] + q["question_ids"])[-300:], None),
    ]
    return [pytest.param(name, ids, chunk, id=name) for name, ids, chunk in prompts]


@pytest.fixture(scope="module")
def records_model():
    return ref.load_model(RECORDS)


@pytest.mark.parametrize("name,ids,chunk", _records_prompts())
def test_cli_logits_match_reference(records_model, name, ids, chunk):
    args = ["logits", "--model", RECORDS, "--ids", ",".join(map(str, ids)), "--top", "5", "--format", "json"]
    if chunk:
        args += ["--chunk", chunk]  # chunks that straddle the arena's 16-token pages
    proc = _kvfold(*args)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["n_tokens"] == len(ids)
    assert got["position"] == len(ids) - 1

    with torch.no_grad():
        logits = ref.forward(records_model, ids, last_only=True, keep=False)["logits"][-1]
    want_ids = torch.topk(logits, 5).indices.tolist()
    got_ids = [row["id"] for row in got["top"]]
    assert got_ids == want_ids, f"{name}: kvfold top-5 {got_ids}, reference {want_ids}"
    probs = torch.softmax(logits, -1)
    for row in got["top"]:
        assert abs(row["logit"] - float(logits[row["id"]])) < 1e-3, f"{name}: id {row['id']}"
        assert math.isclose(row["prob"], float(probs[row["id"]]), rel_tol=1e-3, abs_tol=1e-6)


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_cli_logits_match_golden(name):
    # Also covers the llama path (llama3 RoPE scaling, untied lm_head) that records-qwen3 does not.
    model_dir = os.path.join(DATA, name)
    golden = ref.read_safetensors(os.path.join(model_dir, "golden.safetensors"))
    ids = golden["input_ids"].tolist()
    proc = _kvfold("logits", "--model", model_dir, "--ids", ",".join(map(str, ids)), "--top", "5", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    last = golden["logits_last16"][-1]
    got = json.loads(proc.stdout)["top"]
    assert [row["id"] for row in got] == np.argsort(-last, kind="stable")[:5].tolist()
    for row in got:
        assert abs(row["logit"] - float(last[row["id"]])) < 1e-3


def test_reference_cli_logits_json():
    ids = "1,2,3,4,5"
    proc = subprocess.run([sys.executable, REF_SCRIPT, "logits", "--model", RECORDS, "--ids", ids,
                           "--top", "3", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    top = json.loads(proc.stdout)["top"]
    model = ref.load_model(RECORDS)
    with torch.no_grad():
        logits = ref.forward(model, [1, 2, 3, 4, 5])["logits"][-1]
    assert [r["id"] for r in top] == torch.topk(logits, 3).indices.tolist()


# --- kvfold CLI error handling -------------------------------------------------------------------

def test_cli_help_lists_commands():
    proc = _kvfold("--help")
    assert proc.returncode == 0
    for command in ("model-info", "logits", "bench"):
        assert command in proc.stdout, command


def test_cli_missing_model_dir(tmp_path):
    missing = str(tmp_path / "no-such-model")
    proc = _kvfold("logits", "--model", missing, "--ids", "1,2")
    assert proc.returncode == 1
    assert missing in proc.stderr


def test_cli_bad_ids_is_usage_error():
    proc = _kvfold("logits", "--model", RECORDS, "--ids", "1,abc")
    assert proc.returncode == 2
    assert "abc" in proc.stderr


def test_cli_id_outside_vocab():
    with open(os.path.join(RECORDS, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    proc = _kvfold("logits", "--model", RECORDS, "--ids", f"1,{vocab}")
    assert proc.returncode == 1
    assert str(vocab) in proc.stderr
