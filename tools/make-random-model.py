#!/usr/bin/env python3
"""Writes a Qwen3-shaped model directory with random bf16 weights (config.json + model.safetensors),
for benchmarks that need real shapes but no checkpoint. numpy and the standard library only.

  tools/make-random-model.py OUT_DIR                      # Qwen3-4B shapes (about 8 GB)
  tools/make-random-model.py OUT_DIR --layers 2 --hidden 64 --heads 4 --kv-heads 2 \
      --head-dim 16 --intermediate 128 --vocab 1000        # a tiny one, for checks

Weights are N(0, 0.02) (norm weights 1), rounded to bf16. To keep generation fast, each tensor is
a random window of one pool of 2^24 random values, not fresh draws: shapes, magnitudes and the
absence of zeros are what a timing needs.
"""
import argparse
import json
import os
import struct

import numpy as np

POOL = 1 << 24


def bf16_bits(x):
    """float32 array -> uint16 bf16 bits, rounded to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (u >> np.uint32(16)).astype(np.uint16)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=9728)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    H, hd, I, V = a.hidden, a.head_dim, a.intermediate, a.vocab
    shapes = [("model.embed_tokens.weight", (V, H), 0.02)]
    for l in range(a.layers):
        p = f"model.layers.{l}."
        shapes += [
            (p + "input_layernorm.weight", (H,), None),
            (p + "self_attn.q_proj.weight", (a.heads * hd, H), 0.02),
            (p + "self_attn.k_proj.weight", (a.kv_heads * hd, H), 0.02),
            (p + "self_attn.v_proj.weight", (a.kv_heads * hd, H), 0.02),
            (p + "self_attn.o_proj.weight", (H, a.heads * hd), 0.02),
            (p + "self_attn.q_norm.weight", (hd,), None),
            (p + "self_attn.k_norm.weight", (hd,), None),
            (p + "post_attention_layernorm.weight", (H,), None),
            (p + "mlp.gate_proj.weight", (I, H), 0.02),
            (p + "mlp.up_proj.weight", (I, H), 0.02),
            (p + "mlp.down_proj.weight", (H, I), 0.02),
        ]
    shapes.append(("model.norm.weight", (H,), None))

    header, off = {}, 0
    for name, shape, _ in shapes:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt", "generator": "kvfold tools/make-random-model.py"}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)

    rng = np.random.default_rng(a.seed)
    pool = bf16_bits(rng.standard_normal(POOL, dtype=np.float32) * np.float32(0.02))
    pool = np.concatenate([pool, pool])  # any window of length <= POOL is contiguous
    one = bf16_bits(np.ones(1, np.float32))[0]

    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for name, shape, std in shapes:
            n = int(np.prod(shape))
            if std is None:
                np.full(n, one, np.uint16).tofile(f)
                continue
            left = n
            while left:
                m = min(left, POOL)
                s = int(rng.integers(0, POOL))
                pool[s:s + m].tofile(f)
                left -= m
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": V, "hidden_size": H, "intermediate_size": I, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": hd,
        "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": True,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": a.layers, "bos_token_id": 0, "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"{a.out}: {len(shapes)} tensors, {off / 1e9:.2f} GB of bf16 weights")


if __name__ == "__main__":
    main()
