"""tools/plot-quality.py draws a PNG from `kvfold eval quality --format tsv` tables and refuses a
file that is not one (matplotlib is a test dependency: tools/setup.sh --tests)."""
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tools", "plot-quality.py")
HEADER = ("method\tbudget\tkl_repeat\tkl_answer\tcopy_acc\tqa_em\tlse_err\tout_err\tfact_acc\tdocs\tfailed\t"
          "fold_fallbacks\tbeta_restarts\theads_keep\theads_drop\theads_am\theads_fold\tdocs_without_probes\n")


def _table(path, rows):
    path.write_text(HEADER + "".join("\t".join(map(str, r)) + "\t1\t0\t0\t0\t4\t0\t0\t0\t0\n" for r in rows))
    return str(path)


def _run(*args):
    return subprocess.run(["/usr/bin/python3", SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_draws_every_model(tmp_path):
    rows = [("full", 1, 0, 0, 0.7, 1, 0, 0, 1)]
    for m in ["keep", "drop", "am", "fold"]:
        rows += [(m, b, 1.0, 0.1 / b, 0.5, 0.5, 0.2, 0.2, b + 0.3) for b in (0.5, 0.25, 0.1)]
    a, b = _table(tmp_path / "a.tsv", rows), _table(tmp_path / "b.tsv", rows[:7])
    out = tmp_path / "q.png"
    p = _run("--out", str(out), f"model-a={a}", f"model-b={b}")
    assert p.returncode == 0, p.stderr
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_refuses_a_table_without_fact_acc(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("method\tbudget\tkl_answer\nkeep\t0.5\t0.1\n")
    p = _run("--out", str(tmp_path / "q.png"), f"m={bad}")
    assert p.returncode == 1 and "fact_acc" in p.stderr and "bad.tsv" in p.stderr
    assert not (tmp_path / "q.png").exists()
