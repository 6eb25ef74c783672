"""Helpers of the Slurm test (test_slurm.sh), with Debian's python3:

  manifest SRC OUT N            the N shortest records documents of SRC, cut to 160 tokens
  check ROOT DOCS MODEL KVFOLD [--absent-shard i/N]
                                every document of DOCS has exactly one valid cache file under
                                ROOT/<model-fp>/ (kvfold verify), and nothing else is there (no
                                temporary, lock or partial file); with --absent-shard, the documents
                                of that shard have at most one file instead
  summaries LOGDIR JOB DOCS N DONE SKIPPED
                                the last summary line of each task log of array JOB adds up: each
                                task's documents are its shard, none failed or busy, and the tasks
                                did DONE and skipped SKIPPED documents in all
  reader ROOT MODEL DOCS WORKDIR NAME
                                a serving node: polls ROOT/<model-fp>/ and loads every *.kvf that
                                appears through the connector's load path (kvfold._kvfold:
                                read_header, then load with the model's fingerprint and shapes,
                                Fletcher32 checked on every chunk), reloads them all every half
                                second (none may change), and writes WORKDIR/NAME.json when
                                WORKDIR/stop appears

The extension comes from KVFOLD_EXT_DIR (the build's python/kvfold), as in tests/connector. Cache
files are found as *.kvf only: their names are not otherwise assumed.
"""
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_kvfold():
    """The kvfold package from connector/ with the C extension from KVFOLD_EXT_DIR."""
    src = os.path.join(REPO, "connector", "kvfold")
    ext = os.environ.get("KVFOLD_EXT_DIR") or os.path.join(REPO, "build", "python", "kvfold")
    spec = importlib.util.spec_from_file_location("kvfold", os.path.join(src, "__init__.py"),
                                                  submodule_search_locations=[src, ext])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvfold"] = mod
    spec.loader.exec_module(mod)
    return mod


def read_docs(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def model_info(model):
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim


def fingerprint(kvfold_bin, model):
    out = subprocess.run([kvfold_bin, "model-info", model], check=True, capture_output=True, text=True).stdout
    return re.search(r"^fingerprint\s+([0-9a-f]{32})$", out, re.M).group(1)


def cmd_manifest(src, out, n):
    rows = sorted(read_docs(src), key=lambda r: (len(r["ids"]), r["id"]))[:int(n)]
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps({"id": r["id"], "ids": r["ids"][:160],
                                "repeat_instruction_ids": r["repeat_instruction_ids"]}) + "\n")
    return 0


def shard_of(index, n):
    return index % n


def cmd_check(root, docs_path, model, kvfold_bin, *opt):
    kvfold = load_kvfold()
    absent = None
    if opt:
        if opt[0] != "--absent-shard" or len(opt) != 2:
            raise SystemExit("check: unknown options %r" % (opt,))
        i, n = (int(x) for x in opt[1].split("/"))
        absent = (i, n)
    docs = read_docs(docs_path)
    want = {}
    for k, d in enumerate(docs):
        want.setdefault(kvfold._kvfold.document_digest(d["ids"]), []).append(k)
    fp = fingerprint(kvfold_bin, model)
    errors = []
    top = sorted(os.listdir(root)) if os.path.isdir(root) else []
    if top != [fp]:
        errors.append("%s holds %s, expected only the model's folder %s" % (root, top, fp))
    d = os.path.join(root, fp)
    names = sorted(os.listdir(d)) if os.path.isdir(d) else []
    found = {}
    for name in names:
        path = os.path.join(d, name)
        if not name.endswith(".kvf") or not os.path.isfile(path):
            errors.append("left over: %s" % path)
            continue
        v = subprocess.run([kvfold_bin, "verify", path, "--model", model], capture_output=True, text=True)
        if v.returncode != 0:
            errors.append("invalid: %s: %s" % (path, (v.stdout + v.stderr).strip()[-300:]))
            continue
        h = kvfold._kvfold.read_header(path)
        found.setdefault(h["document_digest"], []).append(name)
    for digest, names_ in found.items():
        if digest not in want:
            errors.append("a file of no document of the manifest: %s" % names_)
    for digest, idx in want.items():
        n_files = len(found.get(digest, []))
        may_be_absent = absent is not None and all(shard_of(k, absent[1]) == absent[0] for k in idx)
        if n_files > 1 or (n_files == 0 and not may_be_absent):
            errors.append("document %s (line %d): %d files %s" % (docs[idx[0]]["id"], idx[0] + 1, n_files,
                                                                 found.get(digest, [])))
    for e in errors:
        print("  " + e)
    n_valid = sum(len(v) for v in found.values())
    print("  %d valid files for %d documents, %d other entries" % (n_valid, len(want), len(names) - n_valid))
    return 1 if errors else 0


SUMMARY = re.compile(r"^compact: (\d+) documents \(shard (\d+)/(\d+)\): (\d+) done, (\d+) skipped.*?(\d+) busy.*?"
                     r"(\d+) failed", re.M)


def cmd_summaries(logdir, job, docs_path, n, done, skipped):
    n, done, skipped = int(n), int(done), int(skipped)
    n_docs = len(read_docs(docs_path))
    errors = []
    tot_done = tot_skipped = 0
    for i in range(n):
        path = os.path.join(logdir, "kvfold-compact-%s_%d.out" % (job, i))
        try:
            text = open(path).read()
        except OSError as e:
            errors.append("task %d: no log: %s" % (i, e))
            continue
        m = SUMMARY.findall(text)
        if not m:
            errors.append("task %d: no summary line in %s" % (i, path))
            continue
        docs_, si, sn, d, s, b, f = (int(x) for x in m[-1])
        size = len(range(i, n_docs, n))
        if (si, sn) != (i, n) or docs_ != size or b or f or d + s != size:
            errors.append("task %d: summary %r, expected shard %d/%d of %d documents, all done or skipped"
                          % (i, m[-1], i, n, size))
        tot_done += d
        tot_skipped += s
    if (tot_done, tot_skipped) != (done, skipped):
        errors.append("the tasks did %d and skipped %d documents, expected %d and %d"
                      % (tot_done, tot_skipped, done, skipped))
    for e in errors:
        print("  " + e)
    print("  summaries: %d done, %d skipped over %d tasks" % (tot_done, tot_skipped, n))
    return 1 if errors else 0


def load_once(kvfold, path, fp, dims):
    """The connector's path: header (cached by the connector per inode), then the whole payload in
    the serving dtype, refused unless it is the served model's and every chunk's checksum holds."""
    h = kvfold._kvfold.read_header(path)
    h2, buf = kvfold._kvfold.load(path, "bfloat16", fp, *dims)
    if h2 != h:
        raise ValueError("header changed between read_header and load")
    n_layers, kv_heads, head_dim = dims
    if len(buf) != 2 * n_layers * int(h["n_tokens"]) * kv_heads * head_dim * 2:
        raise ValueError("payload of %d bytes for %d tokens" % (len(buf), h["n_tokens"]))
    return h, hashlib.sha256(buf).hexdigest()


def cmd_reader(root, model, docs_path, workdir, name):
    kvfold = load_kvfold()
    dims = model_info(model)
    want = {kvfold._kvfold.document_digest(d["ids"]) for d in read_docs(docs_path)}
    stop, writers_done = os.path.join(workdir, "stop"), os.path.join(workdir, "writers-done")
    seen = {}  # name -> {"ino", "sha", "digest", "during_job"}
    errors, loads, passes = [], 0, 0
    fp = None
    next_full = 0.0
    open(os.path.join(workdir, name + ".ready"), "w").close()
    while True:
        last = os.path.exists(stop)
        if fp is None:
            # directories only: a stray file in the root must not be taken for the fingerprint
            subdirs = [s for s in os.listdir(root) if os.path.isdir(os.path.join(root, s))] if os.path.isdir(root) else []
            fp = subdirs[0] if len(subdirs) == 1 else None
        d = os.path.join(root, fp) if fp else None
        names = sorted(n for n in os.listdir(d) if n.endswith(".kvf")) if d and os.path.isdir(d) else []
        gone = set(seen) - set(names)
        if gone:
            errors.append("files disappeared: %s" % sorted(gone))
        full = time.monotonic() >= next_full or last  # all of them again: none may change
        if full:
            next_full = time.monotonic() + 0.5
        for n in names:
            if n in seen and not full:
                continue
            path = os.path.join(d, n)
            try:
                ino = os.stat(path).st_ino
                h, sha = load_once(kvfold, path, fp, dims)
                loads += 1
            except Exception as e:  # noqa: BLE001 — every failure is the finding
                errors.append("%s: %s: %s" % (n, type(e).__name__, e))
                continue
            old = seen.get(n)
            if old is None:
                if h["document_digest"] not in want:
                    errors.append("%s: document %s is not in the manifest" % (n, h["document_digest"]))
                seen[n] = {"ino": ino, "sha": sha, "digest": h["document_digest"],
                           "during_job": not os.path.exists(writers_done)}
            elif (old["ino"], old["sha"]) != (ino, sha):
                errors.append("%s: changed after it appeared (inode %d -> %d)" % (n, old["ino"], ino))
        passes += 1
        if last or len(errors) > 50:
            break
        time.sleep(0.02)
    with open(os.path.join(workdir, name + ".json"), "w") as f:
        json.dump({"files": len(seen), "during_job": sum(v["during_job"] for v in seen.values()),
                   "digests": sorted(v["digest"] for v in seen.values()), "loads": loads, "passes": passes,
                   "errors": errors}, f)
    return 0


def main(argv):
    cmds = {"manifest": cmd_manifest, "check": cmd_check, "summaries": cmd_summaries, "reader": cmd_reader}
    if len(argv) < 2 or argv[1] not in cmds:
        print(__doc__)
        return 2
    return cmds[argv[1]](*argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
