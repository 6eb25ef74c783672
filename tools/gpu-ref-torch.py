#!/usr/bin/env python3
"""Reference timings for tools/gpu-check.sh, through PyTorch on the same GPU:

  gpu-ref-torch.py prefill 4096,16384,32768   transformers Qwen3 with the Qwen3-4B shapes, random
                                              weights, bf16, sdpa; last position's logits only
  gpu-ref-torch.py sdpa 32768,131072          one chunk of 4096 queries (32 heads) against N keys
                                              (8 KV heads, head_dim 128), causal aligned bottom-right

Prints one line per size: 'ref <kind> <size> <median seconds>'. Medians of CUDA-event timings
after warm-up; fresh random inputs, never zeros.
"""
import statistics
import sys

import torch


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def prefill(sizes):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                      rope_theta=1e6, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    for n in sizes:
        ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda")
        with torch.inference_mode():
            t = timed(lambda: model(input_ids=ids, logits_to_keep=1, use_cache=False), 3)
        print(f"ref prefill {n} {t:.4f}", flush=True)


def sdpa(sizes, chunk=4096, hq=32, hkv=8, d=128):
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    for n in sizes:
        q = torch.randn(1, hq, chunk, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        mask = causal_lower_right(chunk, n)
        t = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), 20)
        flops = 4.0 * hq * d * (chunk * (n - chunk) + chunk * (chunk + 1) / 2)
        print(f"ref sdpa {n} {t:.6f}  # {flops / t / 1e12:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("prefill", "sdpa"):
        sys.exit(__doc__)
    sizes = [int(x) for x in sys.argv[2].split(",")]
    (prefill if sys.argv[1] == "prefill" else sdpa)(sizes)
