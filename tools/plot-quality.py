#!/usr/bin/python3
"""Fact accuracy and answer KL against budget, for every method and model, from the TSV tables of
`kvfold eval quality --format tsv`.

    tools/plot-quality.py --out docs/quality.png records-qwen3=qwen.tsv records-llama3-induct=llama.tsv

Each argument is NAME=FILE (NAME labels the model's row of panels). One panel row per model: fact
accuracy (left) and answer KL (right, log scale) against the kept fraction; one line per method,
the `full` row (the uncompacted cache) as a dashed line at fact accuracy. Needs Debian's
python3-matplotlib.
"""
import argparse
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

NEEDED = ("method", "budget", "kl_answer", "fact_acc")
STYLE = {"keep": ("tab:gray", "s"), "drop": ("tab:blue", "o"), "am": ("tab:green", "^"), "fold": ("tab:red", "D")}


def read_table(path):
    """{method: [(budget, fact_acc, kl_answer)]} sorted by budget; raises ValueError on a bad file."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows or any(c not in rows[0] for c in NEEDED):
        raise ValueError(f"{path}: not a `kvfold eval quality --format tsv` table with columns {', '.join(NEEDED)}")
    out = {}
    for r in rows:
        out.setdefault(r["method"], []).append((float(r["budget"]), float(r["fact_acc"]), float(r["kl_answer"])))
    for v in out.values():
        v.sort()
    return out


def plot(tables, out_path):
    fig, axes = plt.subplots(len(tables), 2, figsize=(9, 3.2 * len(tables)), squeeze=False)
    for (name, table), (ax_fact, ax_kl) in zip(tables, axes):
        for method, points in table.items():
            if method == "full":
                ax_fact.axhline(points[0][1], color="black", ls="--", lw=1, label="full")
                continue
            color, marker = STYLE.get(method, ("tab:purple", "x"))
            b = [p[0] for p in points]
            ax_fact.plot(b, [p[1] for p in points], color=color, marker=marker, label=method)
            ax_kl.plot(b, [max(p[2], 1e-5) for p in points], color=color, marker=marker, label=method)
        ax_fact.set(title=f"{name}: fact accuracy", xlabel="kept fraction (budget)", ylabel="fact_acc",
                    ylim=(-0.03, 1.03))
        ax_kl.set(title=f"{name}: answer KL", xlabel="kept fraction (budget)", ylabel="kl_answer (nats)",
                  yscale="log")
        for ax in (ax_fact, ax_kl):
            ax.set_xscale("log")
            ticks = sorted({p[0] for m, pts in table.items() if m != "full" for p in pts})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.grid(alpha=0.3)
        ax_fact.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=80)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("tables", nargs="+", metavar="NAME=FILE", help="a model's name and its eval TSV")
    args = ap.parse_args(argv)
    tables = []
    for spec in args.tables:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            ap.error(f"'{spec}': give NAME=FILE")
        try:
            tables.append((name, read_table(path)))
        except (OSError, ValueError) as e:
            print(f"plot-quality: {e}", file=sys.stderr)
            return 1
    plot(tables, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
