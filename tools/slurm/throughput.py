#!/usr/bin/env python3
"""Cache-building throughput on paper (docs/batch.md): documents per hour per GPU and for N GPUs,
with the file-system bytes written and read, from single-node figures. Rerun it with measured
rates (--tflops, --solve-ms) once kvfold's CUDA backend has run on a GPU.

  tools/slurm/throughput.py [--tflops 220] [--solve-ms 0.3] [--budget 0.1] [--gpus 64] [--fs-gbs 2]

Per document of D tokens, kvfold prefills the document (D tokens) and then the repeat prompt
(about D more tokens on top of it), and solves each layer's KV heads:
  FLOPs  = 2 * P * 2D                                  linear layers, P non-embedding parameters
         + L * 2 * Hq * d * D^2                        causal attention of the first prefill
         + L * 4 * Hq * d * D * 1.5D                   the repeat over 2D keys (D..2D, mean 1.5D)
  time   = FLOPs / rate + solve_ms * L * Hkv * D/1000  the per-head selection and fits
  file   = 2 (K, V) * L * C * Hkv * d * 2 bytes (bf16), C = budget * D
Rates, from the only H200 timings at hand (the AM paper's Gemma-3-12B at 60k tokens: prefill 7 s,
repeat 8 s, i.e. about 220 TFLOP/s; selection + beta + value fits 7 s over 48 layers x 8 KV heads,
i.e. 0.3 ms per head and thousand tokens).
"""
import argparse

# name: (non-embedding params, all params, layers, query heads, kv heads, head_dim)
MODELS = {
    "Qwen3-4B": (3.63e9, 4.02e9, 36, 32, 8, 128),
    "Qwen3-8B": (6.95e9, 8.19e9, 36, 32, 8, 128),
}


def per_doc(model, D, args):
    p, _, L, hq, hkv, d = MODELS[model]
    flops = 2 * p * 2 * D + L * 2 * hq * d * D * D + L * 4 * hq * d * D * 1.5 * D
    t = flops / (args.tflops * 1e12) + args.solve_ms * 1e-3 * L * hkv * D / 1000
    file_bytes = 2 * L * round(args.budget * D) * hkv * d * 2
    return t, file_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tflops", type=float, default=220, help="effective bf16 TFLOP/s of one GPU")
    ap.add_argument("--solve-ms", type=float, default=0.3, help="solve ms per KV head per 1000 tokens")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--gpus", type=int, default=64, help="N of the N-GPU column")
    ap.add_argument("--fs-gbs", type=float, default=2.0, help="the shared file system's write GB/s")
    args = ap.parse_args()
    n, fs = args.gpus, args.fs_gbs * 1e9
    print("| model, document | GPU s per doc | docs/h per GPU | written per doc | write per GPU | "
          "docs/h on %d GPUs (%.0f GB/s FS) | GPUs per GB/s of writes |" % (n, args.fs_gbs))
    print("|---|---|---|---|---|---|---|")
    for model, D in [("Qwen3-4B", 32768), ("Qwen3-8B", 8192), ("Qwen3-8B", 32768), ("Qwen3-8B", 131072)]:
        t, fb = per_doc(model, D, args)
        rate, w = 3600 / t, fb / t  # documents/h and bytes/s of one GPU
        docs_n = min(n * rate, fs / fb * 3600)
        bound = " (FS-bound)" if n * w > fs else ""
        print("| %s, %dk tokens | %.1f | %s | %s | %.0f MB/s | %s%s | %.0f |"
              % (model, D // 1024, t, fmt_docs(rate), fmt_bytes(fb), w / 1e6, fmt_docs(docs_n), bound, 1e9 / w))
    print()
    for model, (_, total, *_rest) in MODELS.items():
        print("%s weights read at each task's start: %s (bf16)" % (model, fmt_bytes(2 * total)))


def fmt_docs(x):
    return "%.0f" % x if x < 10000 else "%.0fk" % (x / 1000)


def fmt_bytes(b):
    return "%.0f MB" % (b / 1e6) if b < 1e9 else "%.1f GB" % (b / 1e9)


if __name__ == "__main__":
    main()
