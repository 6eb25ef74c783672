#!/usr/bin/env python3
"""Writes a GGUF v3 file (llama.cpp's format) from a Hugging Face model directory that kvfold loads
(Qwen3 or Llama: config.json, model.safetensors or a sharded index, tokenizer.json when there is
one), with weights in F32 or BF16. numpy and the standard library only.

  tools/gguf-write.py MODEL_DIR OUT.gguf --type f32|bf16

F32 holds the checkpoint's values exactly (bf16 and f16 widen losslessly); BF16 rounds f32
weights to nearest even and copies bf16 ones bit for bit. Norm weights and rope factors stay F32,
as llama.cpp's own converter keeps them. Without tokenizer.json (tools/make-random-model.py's
models) a placeholder vocabulary is written: the 256 byte symbols, then '[T<id>]'; token ids work,
text does not tokenize into anything meaningful.

Layout notes (why the tensors are not copied as they are):
- GGUF dims list the fastest-moving axis first: a [out, in] weight is written with dims (in, out).
- llama.cpp's 'llama' architecture rotates adjacent pairs (x0, x1), (x2, x3), ... while Hugging
  Face's Llama rotates halves (x_i, x_{i+d/2}); q_proj and k_proj rows are reordered per head so
  both give the same scores. 'qwen3' rotates halves in llama.cpp too: no reordering.
- llama3 RoPE scaling travels as a 'rope_freqs.weight' tensor of per-frequency divisors.
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32
# value types of the GGUF spec
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9
# tensor types (ggml_type) and file types (llama_ftype)
GGML_F32, GGML_BF16 = 0, 30
FTYPE = {"f32": 0, "bf16": 32}
# tokenizer.ggml.token_type values
TOK_NORMAL, TOK_CONTROL, TOK_USER_DEFINED, TOK_UNUSED = 1, 3, 4, 5


class ConvertError(Exception):
    pass


def fail(msg):
    raise ConvertError(msg)


# ---------------------------------------------------------------- inputs


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        fail(f"{path}: cannot read ({e.strerror})")
    except ValueError as e:
        fail(f"{path}: not valid JSON ({e})")


class SafeTensors:
    """The tensors of a checkpoint directory, read lazily through np.memmap."""
    DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}

    def __init__(self, model_dir):
        self.dir = model_dir
        self.entries = {}  # name -> (path, numpy dtype, safetensors dtype, shape, data start in file)
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            files = sorted(set(read_json(index).get("weight_map", {}).values()))
            if not files:
                fail(f"{index}: empty weight_map")
        else:
            files = ["model.safetensors"]
        for name in files:
            if "/" in name or name in ("", ".", ".."):
                fail(f"{index}: shard name '{name}' must be a plain file name")
            self._read_header(os.path.join(model_dir, name))

    def _read_header(self, path):
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    fail(f"{path}: shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    fail(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
                header = json.loads(f.read(n))
        except OSError as e:
            fail(f"{path}: cannot read ({e.strerror})")
        except ValueError as e:
            fail(f"{path}: header is not valid JSON ({e})")
        if not isinstance(header, dict):
            fail(f"{path}: header is not a JSON object")
        for name, t in header.items():
            if name == "__metadata__":
                continue
            try:
                self._add(path, size, 8 + n, name, t)
            except (AttributeError, KeyError, TypeError, ValueError):
                fail(f"{path}: tensor '{name}' has a malformed header entry (dtype, shape, data_offsets)")

    def _add(self, path, size, base, name, t):
        dtype = self.DTYPES.get(t.get("dtype"))
        if dtype is None:
            fail(f"{path}: tensor '{name}' has dtype {t.get('dtype')} (supported: BF16, F16, F32)")
        shape, (lo, hi) = tuple(t["shape"]), t["data_offsets"]
        if hi - lo != int(np.prod(shape)) * np.dtype(dtype).itemsize or base + hi > size:
            fail(f"{path}: tensor '{name}' data_offsets [{lo}, {hi}] do not fit its shape or the file")
        self.entries[name] = (path, dtype, t["dtype"], shape, base + lo)

    def has(self, name):
        return name in self.entries

    def load(self, name, shape):
        """The tensor as stored (bf16 as uint16 bits), checked against the shape config.json implies."""
        if name not in self.entries:
            fail(f"{self.dir}: the checkpoint has no tensor '{name}'")
        path, dtype, dname, got, off = self.entries[name]
        if got != tuple(shape):
            fail(f"{path}: tensor '{name}' has shape {list(got)}, config.json implies {list(shape)}")
        return np.memmap(path, dtype=dtype, mode="r", offset=off, shape=got), dname


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x):
    """float32 -> bf16 bits, rounded to nearest even (NaN kept quiet)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    r = np.where((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), (u >> np.uint32(16)) | np.uint32(0x40), r)
    return r.astype(np.uint16)


def as_type(arr, dname, ggml_type):
    """Stored values -> the output type's array (bf16 copied bit for bit into BF16)."""
    if ggml_type == GGML_BF16 and dname == "BF16":
        return np.asarray(arr)
    f = bf16_to_f32(np.asarray(arr)) if dname == "BF16" else np.asarray(arr, dtype=np.float32)
    return f32_to_bf16(f) if ggml_type == GGML_BF16 else f


def hparams(model_dir):
    """config.json -> the fields the conversion needs, checked the way kvfold checks them."""
    path = os.path.join(model_dir, "config.json")
    c = read_json(path)

    def get(key, default=None):
        v = c.get(key, default)
        if v is None:
            fail(f"{path}: field '{key}' is missing")
        return v

    arch = get("model_type")
    if arch not in ("qwen3", "llama"):
        fail(f"{path}: model_type '{arch}' is not supported (qwen3, llama)")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if c.get(key):
            fail(f"{path}: '{key}: true' is not supported")
    if c.get("hidden_act", "silu") != "silu":
        fail(f"{path}: hidden_act '{c['hidden_act']}' is not supported (silu)")
    h = {"arch": arch, "vocab": get("vocab_size"), "hidden": get("hidden_size"),
         "ffn": get("intermediate_size"), "layers": get("num_hidden_layers"),
         "heads": get("num_attention_heads"), "eps": get("rms_norm_eps"),
         "ctx": c.get("max_position_embeddings") or 4096,
         "tied": bool(c.get("tie_word_embeddings", False)),
         "bos": c.get("bos_token_id"), "eos": c.get("eos_token_id")}
    h["kv_heads"] = c.get("num_key_value_heads") or h["heads"]
    h["head_dim"] = c.get("head_dim") or h["hidden"] // h["heads"]
    if isinstance(h["eos"], list):
        h["eos"] = h["eos"][0] if h["eos"] else None
    h["rope"] = rope_params(c, path)
    return h


def rope_params(c, path):
    """transformers 5's rope_parameters, else the legacy rope_theta + rope_scaling."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ("default", "linear", "llama3"):
        fail(f"{path}: rope type '{kind}' is not supported (default, linear, llama3)")
    if kind != "default" and not rope.get("factor", 1.0) >= 1:
        fail(f"{path}: rope factor must be at least 1, not {rope.get('factor')}")
    return {"type": kind, "theta": float(theta), "factor": float(rope.get("factor", 1.0)),
            "low": float(rope.get("low_freq_factor", 1.0)), "high": float(rope.get("high_freq_factor", 4.0)),
            "orig": float(rope.get("original_max_position_embeddings", 8192))}


def llama3_rope_factors(r, head_dim):
    """Per-frequency divisors of llama3 RoPE scaling ([head_dim / 2]), as transformers computes them."""
    lo_wavelen, hi_wavelen = r["orig"] / r["low"], r["orig"] / r["high"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * r["theta"] ** (i / head_dim)
        if wavelen < hi_wavelen:
            out.append(1.0)
        elif wavelen > lo_wavelen:
            out.append(r["factor"])
        else:
            smooth = (r["orig"] / wavelen - r["low"]) / (r["high"] - r["low"])
            out.append(1.0 / ((1 - smooth) / r["factor"] + smooth))
    return np.array(out, dtype=np.float32)


# ---------------------------------------------------------------- tokenizer


def byte_symbols():
    """GPT-2's byte -> printable-symbol table of byte-level BPE, in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def pre_tokenizer_name(tok):
    """llama.cpp's name for the split regex of tokenizer.json (it only matters for text input)."""
    text = json.dumps(tok.get("pre_tokenizer"))
    if "\\\\p{N}{1,3}" in text:
        return "llama-bpe"
    if "\\\\p{N}|" in text:
        return "qwen2"
    return "default"


def vocab_from_tokenizer(path, n_vocab):
    """tokens, token types and merges from a byte-level BPE tokenizer.json, padded to n_vocab."""
    tok = read_json(path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        fail(f"{path}: model.type must be BPE with a vocab object (byte-level BPE only)")
    tokens, types = [None] * n_vocab, [TOK_UNUSED] * n_vocab
    for text, i in model["vocab"].items():
        if not 0 <= i < n_vocab:
            fail(f"{path}: token '{text}' has id {i}, outside vocab_size {n_vocab} of config.json")
        tokens[i], types[i] = text, TOK_NORMAL
    for a in tok.get("added_tokens") or []:
        i = a.get("id")
        if not isinstance(i, int) or not 0 <= i < n_vocab:
            fail(f"{path}: added token '{a.get('content')}' has id {i}, outside vocab_size {n_vocab}")
        tokens[i], types[i] = a["content"], TOK_CONTROL if a.get("special") else TOK_USER_DEFINED
    for i in range(n_vocab):
        if tokens[i] is None:
            tokens[i] = f"[PAD{i}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return tokens, types, merges, pre_tokenizer_name(tok)


def placeholder_vocab(n_vocab):
    """Byte symbols then '[T<id>]': ids round-trip, text is not meant to."""
    syms = byte_symbols()[:n_vocab]
    tokens = syms + [f"[T{i}]" for i in range(len(syms), n_vocab)]
    return tokens, [TOK_NORMAL] * n_vocab, [], "default"


def tokenizer_kvs(model_dir, h):
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(path):
        tokens, types, merges, pre = vocab_from_tokenizer(path, h["vocab"])
    else:
        tokens, types, merges, pre = placeholder_vocab(h["vocab"])
    kvs = [("tokenizer.ggml.model", T_STRING, "gpt2"), ("tokenizer.ggml.pre", T_STRING, pre),
           ("tokenizer.ggml.tokens", (T_ARRAY, T_STRING), tokens),
           ("tokenizer.ggml.token_type", (T_ARRAY, T_INT32), types),
           ("tokenizer.ggml.merges", (T_ARRAY, T_STRING), merges),
           ("tokenizer.ggml.add_bos_token", T_BOOL, False)]
    for key, i in (("bos", h["bos"]), ("eos", h["eos"])):
        if isinstance(i, int) and 0 <= i < h["vocab"]:
            kvs.append((f"tokenizer.ggml.{key}_token_id", T_UINT32, i))
    return kvs


# ---------------------------------------------------------------- model


def model_kvs(h, out_type, name):
    a = h["arch"]
    kvs = [("general.architecture", T_STRING, a), ("general.name", T_STRING, name),
           ("general.file_type", T_UINT32, FTYPE[out_type]), ("general.alignment", T_UINT32, ALIGNMENT),
           (f"{a}.vocab_size", T_UINT32, h["vocab"]), (f"{a}.context_length", T_UINT32, h["ctx"]),
           (f"{a}.embedding_length", T_UINT32, h["hidden"]), (f"{a}.block_count", T_UINT32, h["layers"]),
           (f"{a}.feed_forward_length", T_UINT32, h["ffn"]),
           (f"{a}.attention.head_count", T_UINT32, h["heads"]),
           (f"{a}.attention.head_count_kv", T_UINT32, h["kv_heads"]),
           # head_dim may differ from hidden / heads (llama.cpp's default without these keys)
           (f"{a}.attention.key_length", T_UINT32, h["head_dim"]),
           (f"{a}.attention.value_length", T_UINT32, h["head_dim"]),
           (f"{a}.rope.dimension_count", T_UINT32, h["head_dim"]),
           (f"{a}.rope.freq_base", T_FLOAT32, h["rope"]["theta"]),
           (f"{a}.attention.layer_norm_rms_epsilon", T_FLOAT32, h["eps"])]
    if h["rope"]["type"] == "linear":
        kvs += [(f"{a}.rope.scaling.type", T_STRING, "linear"),
                (f"{a}.rope.scaling.factor", T_FLOAT32, h["rope"]["factor"])]
    return kvs


def rotary_pairs(w, n_head):
    """Rows of a [n_head * d, in] projection from rotate-half order to adjacent pairs, per head:
    row j < d/2 of a head goes to 2j, row d/2 + j to 2j + 1."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_plan(h, st, out_type):
    """(GGUF name, HF name or array, [out, in] shape, rows per rotary group or 0, ggml type), in order."""
    H, I, hd, V = h["hidden"], h["ffn"], h["head_dim"], h["vocab"]
    big = GGML_BF16 if out_type == "bf16" else GGML_F32
    plan = [("token_embd.weight", "model.embed_tokens.weight", (V, H), 0, big)]
    if h["rope"]["type"] == "llama3":
        plan.append(("rope_freqs.weight", llama3_rope_factors(h["rope"], hd), (hd // 2,), 0, GGML_F32))
    pairs = h["arch"] == "llama"
    for l in range(h["layers"]):
        p, b = f"model.layers.{l}.", f"blk.{l}."
        plan += [(b + "attn_norm.weight", p + "input_layernorm.weight", (H,), 0, GGML_F32),
                 (b + "attn_q.weight", p + "self_attn.q_proj.weight", (h["heads"] * hd, H),
                  h["heads"] if pairs else 0, big),
                 (b + "attn_k.weight", p + "self_attn.k_proj.weight", (h["kv_heads"] * hd, H),
                  h["kv_heads"] if pairs else 0, big),
                 (b + "attn_v.weight", p + "self_attn.v_proj.weight", (h["kv_heads"] * hd, H), 0, big),
                 (b + "attn_output.weight", p + "self_attn.o_proj.weight", (H, h["heads"] * hd), 0, big)]
        if h["arch"] == "qwen3":
            plan += [(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", (hd,), 0, GGML_F32),
                     (b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", (hd,), 0, GGML_F32)]
        plan += [(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (H,), 0, GGML_F32),
                 (b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (I, H), 0, big),
                 (b + "ffn_up.weight", p + "mlp.up_proj.weight", (I, H), 0, big),
                 (b + "ffn_down.weight", p + "mlp.down_proj.weight", (H, I), 0, big)]
    plan.append(("output_norm.weight", "model.norm.weight", (H,), 0, GGML_F32))
    if not h["tied"]:  # llama.cpp reads token_embd for the output when output.weight is absent
        plan.append(("output.weight", "lm_head.weight", (V, H), 0, big))
    for _, src, shape, _, _ in plan:  # every tensor checked before anything is written
        if isinstance(src, str):
            st.load(src, shape)
    return plan


def tensor_data(st, src, shape, groups, ggml_type):
    if isinstance(src, str):
        arr, dname = st.load(src, shape)
    else:
        arr, dname = src, "F32"
    if groups:
        arr = rotary_pairs(np.asarray(arr), groups)
    return np.ascontiguousarray(as_type(arr, dname, ggml_type))


# ---------------------------------------------------------------- GGUF


def gguf_str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


SCALAR = {T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?"}


def gguf_value(vtype, value):
    if vtype == T_STRING:
        return gguf_str(value)
    if isinstance(vtype, tuple):  # (T_ARRAY, element type)
        elem = vtype[1]
        head = struct.pack("<IQ", elem, len(value))
        if elem == T_STRING:
            return head + b"".join(gguf_str(s) for s in value)
        return head + np.asarray(value, dtype=SCALAR[elem]).tobytes()
    return struct.pack(SCALAR[vtype], value)


def gguf_kv(key, vtype, value):
    code = T_ARRAY if isinstance(vtype, tuple) else vtype
    return gguf_str(key) + struct.pack("<I", code) + gguf_value(vtype, value)


def pad(n):
    return -n % ALIGNMENT


def write_gguf(path, kvs, plan, st):
    """Header, metadata, tensor infos, then each tensor's data at a 32-byte aligned offset."""
    head = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(plan), len(kvs))]
    head += [gguf_kv(*kv) for kv in kvs]
    offset = 0
    for name, _, shape, _, ggml_type in plan:
        size = int(np.prod(shape)) * (4 if ggml_type == GGML_F32 else 2)
        dims = tuple(reversed(shape))  # fastest axis first
        head.append(gguf_str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset))
        offset += size + pad(size)
    blob = b"".join(head)
    tmp = path + ".part"  # never a half-written file under the final name
    try:
        with open(tmp, "wb") as f:
            f.write(blob + b"\0" * pad(len(blob)))
            for _, src, shape, groups, ggml_type in plan:
                data = tensor_data(st, src, shape, groups, ggml_type)
                data.tofile(f)
                f.write(b"\0" * pad(data.nbytes))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return offset


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="See the module docstring for what is rounded and reordered.")
    ap.add_argument("model_dir", help="Hugging Face model directory (qwen3 or llama)")
    ap.add_argument("out", help="GGUF file to write")
    ap.add_argument("--type", choices=("f32", "bf16"), default="f32", help="weight type (default f32)")
    a = ap.parse_args()
    try:
        h = hparams(a.model_dir)
        st = SafeTensors(a.model_dir)
        plan = tensor_plan(h, st, a.type)
        name = os.path.basename(os.path.normpath(a.model_dir))
        kvs = model_kvs(h, a.type, name) + tokenizer_kvs(a.model_dir, h)
        size = write_gguf(a.out, kvs, plan, st)
    except ConvertError as e:
        print(f"gguf-write.py: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"gguf-write.py: {a.out}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"{a.out}: {h['arch']}, {len(plan)} tensors, {a.type}, {size / 1e9:.2f} GB of tensor data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
