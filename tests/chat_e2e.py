#!/usr/bin/env python3
"""kvfold compact --chat -> kvfold ask --chat, end to end on the chat fixture (tests/data/
records-llama3-chat: records-llama3-induct fine-tuned on chat turns, with Llama 3's chat template and
its special tokens).

  1. The ids a chat cache stands for, against jinja2 (Debian's python3-jinja2, set up as Hugging
     Face's apply_chat_template sets it up): the conversation [user: document, user: question]
     with the generation prompt, rendered by jinja2 and tokenized whole by `kvfold tokenize`, must
     be the file's recorded prefix + the document + the recorded question prefix + the question +
     the recorded suffix; the document part is checked against the file's document digest (ask
     --doc with those ids).
  2. The records questions through the chat template: the full chat context (budget 1: keep,
     float32, every key, the exact K/V) must answer them right (the greedy answer, up to 4 tokens,
     EOS or "\n" ends it, is the record's " name value\n": the fixture is chat-trained), and the
     caches must agree with it token for token (kvfold ask --compare): every answer at budget 1, at
     least a floor at budget 0.5 (fold).
  3. verify on a chat cache: the document through the template matches, the KL is reported (0 for
     the exact cache); eval quality --chat measures a chat document (the full row at KL 0, no row failed).
  4. Refusals: --chat on a bare-text cache and the reverse (exit 2), another chat template (exit 1,
     both digests), a model without a chat template given --chat (compact, ask: exit 2), a cache asked
     with the untrained weights (exit 1: another model), a cache made with another tokenizer (the same
     weights: exit 1, both digests).

Usage: chat_e2e.py KVFOLD DATA_DIR
"""
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jinja_oracle import hf_environment  # noqa: E402  (exits with a clear message without jinja2)

DOCS = ("doc1-0", "doc1-5", "doc1-1", "doc1-6")  # 16, 16, 64 and 64 record lines: 32 questions
FLOOR_RIGHT = 31  # the full chat context's right answers of 32 (measured 32; 0 before chat training)
FLOOR_HALF = 26  # agreements of 32 at budget 0.5 (measured 29, first token 32; 7 before chat training)


def run(*args, ok=(0,), **kw):
    p = subprocess.run(list(args), capture_output=True, text=True, **kw)
    if p.returncode not in ok:
        sys.exit(f"chat_e2e: FAIL: {' '.join(args[:3])}... exit {p.returncode}: {p.stderr.strip()[-800:]}")
    return p


def tokenize(kvfold, model, text):
    out = run(kvfold, "tokenize", "--model", model, input=text).stdout.strip()
    return [int(x) for x in out.split(",")] if out else []


def compact(kvfold, model, root, path, *flags):
    run(kvfold, "compact", "--model", model, "--out", root, "-q", *flags, path)
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kvf")]
    assert len(files) == 1, files
    return files[0]


def record(kvfold, path):
    h = json.loads(run(kvfold, "inspect", "--json", path).stdout)
    ids = lambda s: [int(x) for x in s.split(",")] if s else []  # noqa: E731
    c = h["chat"]
    return h, ids(c["prefix_ids"]), ids(c["question_prefix_ids"]), ids(c["question_suffix_ids"])


def check_oracle(kvfold, model, cfg, path, exact, text, questions, tmp):
    """Part 1: the cache's ids against jinja2's rendering, tokenized whole; ask --chat's question
    against those ids asked on an exact bare-text cache of the same context."""
    h, pre, qpre, qsuf = record(kvfold, path)
    tmpl = hf_environment().from_string(cfg["chat_template"])
    D = h["n_doc_tokens"]
    for q in questions:
        s = tmpl.render(messages=[{"role": "user", "content": text}, {"role": "user", "content": q}],
                        add_generation_prompt=True, bos_token=cfg["bos_token"], eos_token=cfg["eos_token"])
        want = tokenize(kvfold, model, s)
        got_tail = qpre + tokenize(kvfold, model, q) + qsuf
        assert want[:len(pre)] == pre, ("prefix", want[:len(pre)], pre)
        assert want[D:] == got_tail, ("question", want[D:], got_tail)
    body = os.path.join(tmp, "body.json")  # the document as jinja2 + whole tokenization make it
    with open(body, "w") as f:
        json.dump(want[len(pre):D], f)
    run(kvfold, "ask", "--chat", path, "--model", model, "--doc", body, "--max-tokens", "1", "-q", "x")
    chat_ids = os.path.join(tmp, "chat-ids.jsonl")  # a manifest's ids with --chat: after the template's beginning
    with open(chat_ids, "w") as f:
        f.write(json.dumps({"ids": want[len(pre):D]}) + "\n")
    run(kvfold, "compact", "--chat", "--model", model, "--out", os.path.join(tmp, "chat-ids"), "-q", "--budget", "0.5",
        "--manifest", chat_ids)
    other = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(tmp, "chat-ids")) for f in fs if f.endswith(".kvf")]
    assert os.path.basename(other[0]) == os.path.basename(path), (other, path)  # same document, same recipe
    manifest = os.path.join(tmp, "oracle.jsonl")  # the same context as ids, compacted as bare text
    with open(manifest, "w") as f:
        f.write(json.dumps({"ids": want[:D]}) + "\n")
    run(kvfold, "compact", "--model", model, "--out", os.path.join(tmp, "oracle"), "-q", "--method", "keep",
        "--budget", "1", "--dtype", "f32", "--manifest", manifest)
    bare = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(tmp, "oracle")) for f in fs if f.endswith(".kvf")]
    ask = ("--model", model, "--json", "--max-tokens", "4", "-q")
    a = json.loads(run(kvfold, "ask", bare[0], *ask, "--question-ids", ",".join(map(str, want[D:]))).stdout)
    b = json.loads(run(kvfold, "ask", "--chat", exact, *ask, questions[-1]).stdout)
    assert b["question_ids"] == want[D:] and a["answer_ids"] == b["answer_ids"], ("ask --chat's question", a, b)


def check_verify(kvfold, model, full, fold, doc_path, other_doc, question):
    """verify on chat caches: the document read through the template matches the file's digest (read
    as bare text it would not), and the KL against the full chat context is 0 for the exact cache
    (keep, f32) and positive for the folded one; another document fails."""
    digest = json.loads(run(kvfold, "inspect", "--json", fold).stdout)["document_digest"]
    kl = {}
    for name, path in (("full", full), ("fold", fold)):
        out = run(kvfold, "verify", path, "--model", model, "--doc", doc_path, "--question", question).stdout
        assert "checksums ok" in out and f"matches (digest {digest}," in out, out
        m = re.search(r"question 1: KL\(full \|\| cache\) (\S+) mean over (\d+) answer tokens, (\S+) first token", out)
        assert m and int(m.group(2)) >= 1, out
        kl[name] = float(m.group(1))
        if name == "full":
            assert "cache's greedy answer the same" in out, out
    assert kl["full"] < 1e-4 < kl["fold"], kl
    p = run(kvfold, "verify", fold, "--model", model, "--doc", other_doc, ok=(1,))
    assert "is not the document of" in p.stderr and digest in p.stderr, p.stderr


def agreement(kvfold, model, path, doc_path, qa):
    """Over the (question, answer ids) pairs qa: answers that agree with the full chat context's, whose
    first token does, and the full context's answers that are the record's (right)."""
    p = run(kvfold, "ask", "--chat", path, "--model", model, "--doc", doc_path, "--compare", "--json",
            "--max-tokens", "4", "--stop", "\n", "-q", *[q for q, _ in qa])
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(rows) == len(qa)
    return (sum(r["agree"] for r in rows), sum(r["answer_ids"][:1] == r["full_answer_ids"][:1] for r in rows),
            sum(r["full_answer_ids"] == a for r, (_, a) in zip(rows, qa)))


def check_refusals(kvfold, data, chat_file, doc_path, tmp):
    plain_model, chat_model = os.path.join(data, "records-llama3-induct"), os.path.join(data, "records-llama3-chat")
    plain = compact(kvfold, plain_model, os.path.join(tmp, "plain"), doc_path, "--budget", "0.5")
    p = run(kvfold, "ask", "--chat", plain, "--model", plain_model, "q", ok=(2,))
    assert "bare text" in p.stderr, p.stderr
    p = run(kvfold, "ask", chat_file, "--model", chat_model, "q", ok=(2,))
    assert "ask with --chat" in p.stderr, p.stderr
    p = run(kvfold, "compact", "--chat", "--model", plain_model, "--out", os.path.join(tmp, "x"), doc_path, ok=(2,))
    assert "--chat needs the model's chat template" in p.stderr, p.stderr
    p = run(kvfold, "ask", "--chat", chat_file, "--model", plain_model, "q", ok=(1,))  # the chat-trained weights
    assert "written for model" in p.stderr and "not for this model" in p.stderr, p.stderr
    retok = os.path.join(tmp, "other-tokenizer")  # the chat model's weights, the plain model's tokenizer
    os.mkdir(retok)
    for name, src in (("config.json", chat_model), ("model.safetensors", chat_model), ("tokenizer.json", plain_model),
                      ("tokenizer_config.json", plain_model)):
        os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(retok, name))
    digests = re.findall(r"[0-9a-f]{32}", run(kvfold, "inspect", chat_file).stdout.split("tokenizer")[1])[:1]
    p = run(kvfold, "ask", "--chat", chat_file, "--model", retok, "q", ok=(1,))
    assert "another tokenizer" in p.stderr and digests[0] in p.stderr, p.stderr
    theirs, mine = (json.loads(run(kvfold, "inspect", "--json", f).stdout)["tokenizer_digest"] for f in (chat_file, plain))
    p = run(kvfold, "verify", chat_file, "--model", retok, ok=(1,))
    assert theirs != mine and re.search(r"another tokenizer \(tokenizer_digest %s\) than the model's .*\(%s\)" %
                                        (theirs, mine), p.stderr), p.stderr
    edited = os.path.join(tmp, "edited-template")  # the same model and tokenizer, another template
    os.mkdir(edited)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(os.path.abspath(os.path.join(chat_model, name)), os.path.join(edited, name))
    with open(os.path.join(chat_model, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = cfg["chat_template"].replace("| trim", "")
    with open(os.path.join(edited, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    p = run(kvfold, "ask", "--chat", chat_file, "--model", edited, "q", ok=(1,))
    assert "another chat template" in p.stderr and re.search(r"\(chat_template_digest [0-9a-f]{32}\) than the "
                                                               r"model's \([0-9a-f]{32}\)", p.stderr), p.stderr
    del cfg["chat_template"]  # the same model and tokenizer without a template: --chat cannot be asked
    with open(os.path.join(edited, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    p = run(kvfold, "ask", "--chat", chat_file, "--model", edited, "q", ok=(2,))
    assert "--chat: %s: --chat needs the model's chat template" % edited in p.stderr, p.stderr


def check_eval(kvfold, data):
    """eval quality --chat: the chat context's reference and caches (the template's beginning kept
    verbatim) measure like any other: the full row at KL 0 answering every question, every row
    measured, none failed."""
    model = os.path.join(data, "records-llama3-chat")
    p = run(kvfold, "eval", "quality", "--chat", "--model", model, "--docs", os.path.join(data, "records-dev.jsonl"),
            "--limit", "1", "--methods", "full,fold", "--budgets", "0.5", "--format", "tsv", "-q")
    rows = [dict(zip(p.stdout.splitlines()[0].split("\t"), line.split("\t"))) for line in p.stdout.splitlines()[1:]]
    assert [r["method"] for r in rows] == ["full", "fold"], p.stdout
    assert all(r["docs"] == "1" and r["failed"] == "0" for r in rows), p.stdout
    assert float(rows[0]["kl_repeat"]) == 0 and float(rows[0]["kl_answer"]) == 0, p.stdout
    assert float(rows[0]["qa_em"]) == 1, p.stdout  # the chat-trained model answers through the template
    assert float(rows[1]["kl_repeat"]) > 0, p.stdout
    p = run(kvfold, "eval", "quality", "--chat", "--model", os.path.join(data, "records-llama3-induct"), "--docs",
            os.path.join(data, "records-dev.jsonl"), ok=(2,))
    assert "--chat needs the model's chat template" in p.stderr, p.stderr


def main():
    kvfold, data = sys.argv[1], sys.argv[2]
    model = os.path.join(data, "records-llama3-chat")
    with open(os.path.join(model, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    docs = {}
    with open(os.path.join(data, "records-dev.jsonl")) as f:
        for line in f:
            o = json.loads(line)
            docs[o["id"]] = o
    half = exact = first = right = n = 0
    with tempfile.TemporaryDirectory() as tmp:
        for k, name in enumerate(DOCS):
            d = docs[name]
            doc_path = os.path.join(tmp, name + ".txt")
            with open(doc_path, "w") as f:
                f.write(d["text"])
            qs = [q["question"] for q in d["questions"]]
            full = compact(kvfold, model, os.path.join(tmp, name, "keep"), doc_path, "--chat", "--method", "keep",
                           "--budget", "1", "--dtype", "f32")
            fold = compact(kvfold, model, os.path.join(tmp, name, "fold"), doc_path, "--chat", "--budget", "0.5")
            if k == 0:
                check_oracle(kvfold, model, cfg, fold, full, d["text"], qs[:3], tmp)
                check_refusals(kvfold, data, fold, doc_path, tmp)
                other = os.path.join(tmp, "other.txt")
                with open(other, "w") as f:
                    f.write(docs[DOCS[1]]["text"])
                check_verify(kvfold, model, full, fold, doc_path, other, qs[0])
            qa = [(q["question"], q["answer_ids"]) for q in d["questions"]]
            e, _, r = agreement(kvfold, model, full, doc_path, qa)
            a, a1, _ = agreement(kvfold, model, fold, doc_path, qa)
            exact, half, first, right, n = exact + e, half + a, first + a1, right + r, n + len(qs)
    check_eval(kvfold, data)
    print(f"chat_e2e: the full chat context answers {right}/{n} records questions right; agreement with it: "
          f"budget 1 (keep, f32) {exact}/{n}, budget 0.5 (fold) {half}/{n} (first token {first}/{n})")
    if right < FLOOR_RIGHT or exact != n or half < FLOOR_HALF:
        sys.exit(f"chat_e2e: FAIL: the full chat context must answer at least {FLOOR_RIGHT} right, budget 1 agree "
                 f"on every question, budget 0.5 on at least {FLOOR_HALF}")
    print("chat_e2e: ok")


if __name__ == "__main__":
    main()
