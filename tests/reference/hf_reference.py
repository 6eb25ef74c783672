#!/usr/bin/python3
"""Independent PyTorch reference of the Qwen3 / Llama 3 decoder forward pass.

Written from the published architecture (not from kvfold's C code) so that it can check it.
Weights load as stored (bf16, f16, f32) and everything computes in fp32, like kvfold's CPU path.
Needs only torch and numpy: safetensors and config.json are parsed here.

    load_model(dir) -> Model
    forward(model, ids) -> {"hidden": [L+1 x [T, H]], "k": [L x [kv, T, d]], "v": [...], "logits": [T, V]}

Tensor conventions follow the golden files (tests/data/FIXTURES.md): hidden[0] is the embedding
output, hidden[i] the output of layer i (1-based), hidden[L] the final norm's output; k/v are the
cached keys (after k_norm and RoPE) and values of each layer.

CLI:
    hf_reference.py logits --model DIR --ids 1,2,3 [--top 5] [--json]
    hf_reference.py bench --model DIR --tokens N [--repeat 3] [--threads T] [--seed S]
"""
import argparse
import json
import math
import os
import statistics
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

SUPPORTED_TYPES = ("qwen3", "llama")


# --- safetensors ---------------------------------------------------------------------------------

_NP_DTYPES = {
    "F32": np.float32, "F16": np.float16, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path):
    """Return {name: np.ndarray} of one .safetensors file; floats stay in their stored precision
    except BF16, which numpy lacks and which is widened (exactly) to float32."""
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[begin:end]
        shape = info["shape"]
        dtype = info["dtype"]
        if dtype == "BF16":
            # bf16 is the top half of an fp32: shift the bits up and reinterpret.
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif dtype in _NP_DTYPES:
            arr = np.frombuffer(raw, dtype=np.dtype(_NP_DTYPES[dtype]).newbyteorder("<"))
        else:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        out[name] = arr.reshape(shape)
    return out


def _read_model_weights(model_dir):
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    weights = {}
    for shard in shards:
        weights.update(read_safetensors(os.path.join(model_dir, shard)))
    return weights


# --- config --------------------------------------------------------------------------------------

def rope_settings(cfg):
    """Normalise both config forms to one dict with rope_type, rope_theta and the type's parameters.
    transformers 5 writes `rope_parameters` (theta inside); older checkpoints write a top-level
    `rope_theta` plus `rope_scaling` (null, or a dict keyed by `rope_type` or the older `type`)."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
    else:
        params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = rope_type
    params["rope_theta"] = float(theta)
    if rope_type not in ("default", "linear", "llama3"):
        raise NotImplementedError(f"rope type {rope_type!r} (supported: default, linear, llama3)")
    return params


def rope_inv_freq(head_dim, rope):
    """Per-pair inverse frequencies [head_dim/2] in fp32, as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
    kind = rope["rope_type"]
    if kind == "linear":
        # Position interpolation: positions / factor is the same as frequencies / factor.
        inv_freq = inv_freq / float(rope["factor"])
    elif kind == "llama3":
        factor = float(rope["factor"])
        low = float(rope["low_freq_factor"])
        high = float(rope["high_freq_factor"])
        old_ctx = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (beyond the original context / low) are interpolated by `factor`,
        # short ones (below original context / high) kept, the band between blended smoothly.
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


class Model:
    """Config values and fp32 weights of one decoder."""

    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        self.cfg = cfg
        self.model_type = cfg.get("model_type")
        if self.model_type not in SUPPORTED_TYPES:
            raise ValueError(f"{model_dir}: model_type {self.model_type!r} is not qwen3 or llama")
        self.hidden_size = cfg["hidden_size"]
        self.n_layers = cfg["num_hidden_layers"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv_heads = cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = cfg.get("head_dim") or self.hidden_size // self.n_heads
        self.vocab_size = cfg["vocab_size"]
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.rope = rope_settings(cfg)
        self.inv_freq = rope_inv_freq(self.head_dim, self.rope)
        self.scale = self.head_dim ** -0.5
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r}")

        raw = _read_model_weights(model_dir)
        # np.frombuffer views are read-only; copy into fp32 torch tensors once.
        self.w = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in raw.items()
                  if v.dtype.kind == "f"}
        if "lm_head.weight" in self.w:
            self.lm_head = self.w["lm_head.weight"]
        elif cfg.get("tie_word_embeddings", False):
            self.lm_head = self.w["model.embed_tokens.weight"]
        else:
            raise ValueError(f"{model_dir}: no lm_head.weight and tie_word_embeddings is false")

    def layer(self, i, name):
        return self.w.get(f"model.layers.{i}.{name}")


def load_model(model_dir):
    return Model(model_dir)


# --- forward -------------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def linear(x, model, i, name):
    return F.linear(x, model.layer(i, name + ".weight"), model.layer(i, name + ".bias"))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(model, positions):
    # NeoX layout: pair j is (x[j], x[j + d/2]), both halves use the same angle.
    angles = positions.float()[:, None] * model.inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def attention(q, k, v, scale):
    """Causal GQA attention. q [H, T, d]; k, v [KV, T, d] -> [T, H*d]."""
    n_heads, t, d = q.shape
    group = n_heads // k.shape[0]
    # Each KV head serves `group` consecutive query heads.
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    scores = scores - scores.amax(dim=-1, keepdim=True)
    probs = scores.exp()
    probs = probs / probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, v)
    return out.transpose(0, 1).reshape(t, n_heads * d)


def forward(model, ids, last_only=False, keep=True):
    """Run the decoder over `ids` (positions 0..T-1).

    last_only: compute logits for the last position only (as a prefill does).
    keep: collect hidden states and K/V (off for benchmarks)."""
    ids = torch.as_tensor(list(ids) if not torch.is_tensor(ids) else ids, dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("empty id list")
    if int(ids.min()) < 0 or int(ids.max()) >= model.vocab_size:
        raise ValueError(f"token id out of range [0, {model.vocab_size})")
    t = ids.shape[0]
    nh, nkv, d = model.n_heads, model.n_kv_heads, model.head_dim
    cos, sin = rope_cos_sin(model, torch.arange(t))

    x = model.w["model.embed_tokens.weight"][ids]
    hidden, ks, vs = [x], [], []
    for i in range(model.n_layers):
        h = rms_norm(x, model.layer(i, "input_layernorm.weight"), model.eps)
        q = linear(h, model, i, "self_attn.q_proj").view(t, nh, d).transpose(0, 1)
        k = linear(h, model, i, "self_attn.k_proj").view(t, nkv, d).transpose(0, 1)
        v = linear(h, model, i, "self_attn.v_proj").view(t, nkv, d).transpose(0, 1)
        q_norm = model.layer(i, "self_attn.q_norm.weight")
        if q_norm is not None:  # Qwen3: per-head RMSNorm of q and k, before RoPE
            q = rms_norm(q, q_norm, model.eps)
            k = rms_norm(k, model.layer(i, "self_attn.k_norm.weight"), model.eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if keep:
            ks.append(k.contiguous())
            vs.append(v.contiguous())
        a = attention(q, k, v, model.scale)
        x = x + linear(a, model, i, "self_attn.o_proj")

        h = rms_norm(x, model.layer(i, "post_attention_layernorm.weight"), model.eps)
        gate = linear(h, model, i, "mlp.gate_proj")
        up = linear(h, model, i, "mlp.up_proj")
        x = x + linear(F.silu(gate) * up, model, i, "mlp.down_proj")
        if keep and i < model.n_layers - 1:
            hidden.append(x)

    if last_only:
        x = x[-1:]
    x = rms_norm(x, model.w["model.norm.weight"], model.eps)
    if keep and not last_only:
        hidden.append(x)
    logits = F.linear(x, model.lm_head)
    return {"hidden": hidden, "k": ks, "v": vs, "logits": logits}


# --- CLI -----------------------------------------------------------------------------------------

def _parse_ids(text):
    parts = text.replace(",", " ").split()
    try:
        return [int(p) for p in parts]
    except ValueError as e:
        raise SystemExit(f"hf_reference: --ids: {e}")


def cmd_logits(args):
    model = load_model(args.model)
    ids = _parse_ids(sys.stdin.read() if args.ids == "-" else args.ids)
    with torch.no_grad():
        logits = forward(model, ids, last_only=True, keep=False)["logits"][-1]
    probs = torch.softmax(logits, dim=-1)
    top = torch.topk(logits, min(args.top, logits.numel()))
    rows = [{"id": int(i), "logit": float(logits[i]), "prob": float(probs[i])} for i in top.indices]
    if args.json:
        print(json.dumps({"position": len(ids) - 1, "n_tokens": len(ids), "top": rows}))
    else:
        print(f"{len(ids)} tokens; next-token prediction after position {len(ids) - 1}:")
        print(f"  {'rank':>4} {'id':>8} {'logit':>12} {'prob':>9}")
        for r, row in enumerate(rows, 1):
            print(f"  {r:>4} {row['id']:>8} {row['logit']:>12.4f} {row['prob']:>9.4f}")


def cmd_bench(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.vocab_size, (args.tokens,), generator=gen)
    times = []
    with torch.no_grad():
        for run in range(args.repeat + 1):  # run 0 is the warm-up
            start = time.perf_counter()
            forward(model, ids, last_only=True, keep=False)
            if run:
                times.append(time.perf_counter() - start)
    med = statistics.median(times)
    print(f"model {args.model} tokens {args.tokens} threads {torch.get_num_threads()} "
          f"torch {torch.__version__}")
    print(f"median_s {med:.6f}")
    print(f"tokens_per_s {args.tokens / med:.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description="PyTorch reference forward pass (Qwen3 / Llama 3).")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("logits", help="top next-token ids after a list of ids")
    pl.add_argument("--model", required=True, help="Hugging Face model directory")
    pl.add_argument("--ids", required=True, help="ids separated by commas or spaces; '-' reads stdin")
    pl.add_argument("--top", type=int, default=5)
    pl.add_argument("--json", action="store_true", help="one JSON object, like `kvfold logits --format json`")
    pb = sub.add_parser("bench", help="tokens/s of a prefill of random ids (last logits only)")
    pb.add_argument("--model", required=True)
    pb.add_argument("--tokens", type=int, default=512)
    pb.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up (median)")
    pb.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    pb.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    try:
        if args.command == "logits":
            cmd_logits(args)
        else:
            cmd_bench(args)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        # Bad model directories and ids are user errors: one line, not a traceback.
        print(f"hf_reference {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
