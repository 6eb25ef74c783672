#!/usr/bin/python3
"""Makes tests/data/records-llama3-chat/model.safetensors: records-llama3-induct fine-tuned on chat
turns laid out as kvfold lays them out (tools/doc_chat.h), so that behind the assistant's header the
model answers the records questions as the bare-text model does after "A:".

  tools/train-records-chat.py --kvfold build/kvfold [--steps N] [--lr LR] [--seed S] [--threads T]
                              [--lines 4,6,8] [--chat-share F] [--repeat-share F]
                              [--base DIR] [--chat DIR] [--check-only]

Rows (seeded fresh documents of --lines record lines `- <name> <value>` with filler sentences;
names and values are the tokenizer's whole record words; never the records-dev documents):
  chat repeat:   A X B1 instruction B2 | X          (| : the loss on what follows)
  chat question: A X H "Q: <name>?\nA:" T | <name> <value> \n
  bare repeat:   X\n "Repeat the records above.\n" | X\n
  bare question: X\n "Q: <name>?\nA:" | <name> <value> \n
X is the document as the template writes it (trimmed); A, H, T, B1, B2 the template's pieces, cut
at sentinels from `kvfold chat-template` renderings as doc_chat.c cuts them; the chat instruction
is kvfold's default or records-dev's. Ids come from kvfold's own tokenizer (the C extension beside
the kvfold binary: build/python/kvfold/_kvfold). The torch forward (fp32 over the bf16 weights) is
checked against `kvfold logits` (every logit of the last position) before and after training.
Prints the greedy accuracy on held-out questions (16 and 64 record lines) and the teacher-forced
copy accuracy of held-out repeats, chat and bare, before and after; writes bf16 safetensors over
--chat's model.safetensors (a link to the base's is replaced). Debian's python3-torch and
python3-numpy only; one thread by default, so the result is the same run to run.
"""
import argparse
import json
import math
import os
import random
import struct
import subprocess
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")
FILLER = ("a and as at bridge bright by careful copper distant early engine for forest from garden gentle harbor "
          "heavy house in is lantern letter light market meadow morning narrow north of on open paper quiet "
          "river round signal silver simple stone the to valley was window winter with yellow").split()
INSTRUCTIONS = ("Repeat the previous context verbatim.", "Repeat the records above.\n")  # kvfold's, records-dev's
SENT = {"doc": "kvfoldSentinelDocument7f3a", "q": "kvfoldSentinelQuestion7f3a",
        "i": "kvfoldSentinelInstruction7f3a", "r": "kvfoldSentinelRepeat7f3a"}


# ---- weights ----

def load_safetensors(path):
    """name -> float32 tensor (bf16 upcast), and the names in file order."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        body = f.read()
    out = {}
    for name, t in head.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "BF16", (path, name, t["dtype"])
        a, b = t["data_offsets"]
        bits = np.frombuffer(body[a:b], np.uint16).astype(np.uint32) << np.uint32(16)
        out[name] = torch.from_numpy(bits.view(np.float32).reshape(t["shape"]).copy())
    return out, [k for k in head if k != "__metadata__"]


def bf16_bits(x):
    """float32 tensor -> numpy uint16 bf16 bits, rounded to nearest even."""
    u = x.detach().contiguous().numpy().astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def save_safetensors(path, weights, order):
    header, off, blobs = {}, 0, []
    for name in order:
        b = bf16_bits(weights[name]).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(weights[name].shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    if os.path.islink(path):
        os.unlink(path)
    os.replace(tmp, path)


# ---- the model: Llama, fp32 ----

class Llama:
    def __init__(self, w, cfg):
        self.w, self.cfg = w, cfg
        self.L, self.nh, self.nkv, self.hd = (cfg["num_hidden_layers"], cfg["num_attention_heads"],
                                              cfg["num_key_value_heads"], cfg["head_dim"])
        self.eps = cfg["rms_norm_eps"]
        self.inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd))

    def rms(self, x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * g

    def rope(self, T):
        ang = torch.arange(T, dtype=torch.float64)[:, None] * self.inv_freq[None, :]  # [T, hd/2]
        ang = torch.cat([ang, ang], -1)
        return torch.cos(ang).float(), torch.sin(ang).float()

    @staticmethod
    def rotate(x, cos, sin):  # x [B, h, T, hd]; Hugging Face's rotate_half convention
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin

    def __call__(self, ids, at=None):
        """ids [B, T] -> logits [B, T, V]; with at (a [B, T] bool mask), only those positions' [N, V]."""
        w, B, T = self.w, ids.shape[0], ids.shape[1]
        cos, sin = self.rope(T)
        mask = torch.full((T, T), float("-inf")).triu(1)
        x = w["model.embed_tokens.weight"][ids]  # [B, T, H]
        for l in range(self.L):
            p = f"model.layers.{l}."
            h = self.rms(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(B, T, self.nh, self.hd).transpose(1, 2)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(B, T, self.nkv, self.hd).transpose(1, 2)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(B, T, self.nkv, self.hd).transpose(1, 2)
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
            rep = self.nh // self.nkv  # query head j reads KV head j // rep
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.hd) + mask, -1) @ v  # [B, nh, T, hd]
            x = x + a.transpose(1, 2).reshape(B, T, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = self.rms(x, w[p + "post_attention_layernorm.weight"])
            g = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + g @ w[p + "mlp.down_proj.weight"].T
        x = x if at is None else x[at]
        return self.rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


# ---- kvfold: tokenizer, template pieces, logits ----

def run(args, text=None):
    p = subprocess.run(args, input=text, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"train-records-chat: {' '.join(args[:2])}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def tokenizer(kvfold, model):
    ext = os.path.join(os.path.dirname(os.path.abspath(kvfold)), "python", "kvfold")
    sys.path.insert(0, ext)
    try:
        import _kvfold
    except ImportError as e:
        sys.exit(f"train-records-chat: kvfold's C extension not found in {ext} ({e}): build kvfold first")
    tok = _kvfold.Tokenizer(model)
    return lambda s: tok.encode(s, add_special=False) if s else []


def pieces(kvfold, model, encode):
    """The template's pieces around the turns' contents, as ids (tools/doc_chat.h's A, H, T, B1, B2)."""
    def render(msgs, gen):
        conv = json.dumps([{"role": r, "content": SENT[c]} for r, c in msgs])
        return run([kvfold, "chat-template", "--model", model] + (["--generation-prompt"] if gen else []), conv)

    def cut(s, keys):
        out = []
        for k in keys:
            assert s.count(SENT[k]) == 1, (s, k)
            a, s = s.split(SENT[k])
            out.append(a)
        return out + [s]
    a, h, t = cut(render([("user", "doc"), ("user", "q")], True), ["doc", "q"])
    a2, b1, b2, _ = cut(render([("user", "doc"), ("user", "i"), ("assistant", "r")], False), ["doc", "i", "r"])
    assert a2 == a
    return {k: encode(v) for k, v in (("A", a), ("H", h), ("T", t), ("B1", b1), ("B2", b2))}


def check_forward(model, kvfold, model_dir, rows, tol=1e-3):
    """Last-position logits of each row against `kvfold logits` (every id): max |difference|, which
    must stay under tol (else the torch model is not the one kvfold runs: exit)."""
    worst, V = 0.0, model.cfg["vocab_size"]
    for ids in rows:
        top = json.loads(run([kvfold, "logits", "--model", model_dir, "--ids", ",".join(map(str, ids)),
                              "--top", str(V), "--format", "json"]))["top"]
        assert len(top) == V, len(top)
        ref = torch.zeros(V)
        for e in top:
            ref[e["id"]] = e["logit"]
        with torch.no_grad():
            got = model(torch.tensor([ids]))[0, -1]
        worst = max(worst, (got - ref).abs().max().item())
    if worst > tol:
        sys.exit(f"train-records-chat: the torch forward differs from `kvfold logits` on {model_dir} by {worst:.2e}")
    return worst


# ---- data ----

def vocab_words(model_dir):
    """The tokenizer's record words: names and values are whole words (no longer word extends them)."""
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    inv = {v: k for k, v in vocab.items()}

    def words(lo, hi):
        s = [inv[i][1:] for i in range(lo, hi + 1) if inv.get(i, "")[1:].isalpha() and inv[i][0] == "\u0120"
             and inv[i][1:].islower()]
        return sorted(w for w in s if w not in FILLER and not any(o != w and o.startswith(w) for o in s))
    return words(281, 2160), words(2165, 2876)  # the name and value ranges of the records vocabulary


def document(rng, names, values, n):
    """n record lines with filler sentences between them; the text and its records."""
    recs = list(zip(rng.sample(names, n), [rng.choice(values) for _ in range(n)]))
    lines = []
    for name, value in recs:
        while rng.random() < 0.3:
            s = rng.sample(FILLER, rng.randint(2, 5))
            lines.append(" ".join([s[0].capitalize()] + s[1:]) + ".")
        lines.append(f"- {name} {value}")
    return "\n".join(lines) + "\n", recs


def make_row(rng, encode, P, names, values, n, chat, repeat_share=0.25):
    """One row: (ids, index of the first target position)."""
    text, recs = document(rng, names, values, n)
    x = encode(text.strip() if chat else text)
    if rng.random() < repeat_share:
        instr = rng.choice(INSTRUCTIONS) if chat else INSTRUCTIONS[1]
        head = P["A"] + x + P["B1"] + encode(instr) + P["B2"] if chat else x + encode(instr)
        return head + x, len(head)
    name, value = rng.choice(recs)
    q = encode(f"Q: {name}?\nA:")
    head = P["A"] + x + P["H"] + q + P["T"] if chat else x + q
    return head + encode(f" {name} {value}\n"), len(head)


def batch(rows):
    """ids [B, T] (zeros after a row's end: causal attention never reads them), at [B, T] the
    positions that predict a target, target [N] their targets, weight [N] (each row weighs the same)."""
    T = max(len(r) for r, _ in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    at = torch.zeros(len(rows), T, dtype=torch.bool)
    weight = torch.zeros(len(rows), T)
    for i, (r, s) in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        at[i, s - 1:len(r) - 1] = True
        weight[i, s - 1:len(r) - 1] = 1.0 / (len(r) - s)
    target = torch.roll(ids, -1, 1)[at]
    return ids, at, target, weight[at]


def copy_accuracy(model, rows):
    """Teacher-forced token accuracy over the repeat rows' targets."""
    ok = n = 0
    with torch.no_grad():
        for r, s in rows:
            pred = model(torch.tensor([r]))[0, s - 1:len(r) - 1].argmax(-1)
            ok, n = ok + int((pred == torch.tensor(r[s:])).sum()), n + len(r) - s
    return ok / n


def accuracy(model, rows):
    """Rows whose every target token is the argmax (with teacher forcing: the greedy answer)."""
    ok = 0
    with torch.no_grad():
        for r, s in rows:
            pred = model(torch.tensor([r]))[0, s - 1:len(r) - 1].argmax(-1)
            ok += bool((pred == torch.tensor(r[s:])).all())
    return ok


def held_out(seed, encode, P, names, values):
    """Held-out rows of documents of 16 and 64 record lines, chat and bare: 32 questions and 4 repeats each."""
    held = random.Random(seed)
    tests, copies = {}, {}
    for kind in ("chat", "bare"):
        tests[kind], copies[kind] = [], []
        while len(tests[kind]) < 32 or len(copies[kind]) < 4:
            r, s = make_row(held, encode, P, names, values, held.choice((16, 64)), kind == "chat", 0.5)
            (tests if len(r) - s == 3 else copies)[kind].append((r, s))
        tests[kind], copies[kind] = tests[kind][:32], copies[kind][:4]
    return tests, copies


def train(model, a, rng, encode, P, names, values):
    """AdamW over every weight: warm-up, cosine decay; each step a batch of rows of one document length."""
    lines = [int(x) for x in a.lines.split(",")]
    params = [t.requires_grad_() for t in model.w.values()]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    t0 = time.time()
    for step in range(a.steps):
        n = rng.choice(lines)  # record lines of this batch's documents
        ids, at, target, weight = batch([make_row(rng, encode, P, names, values, n, rng.random() < a.chat_share,
                                                  a.repeat_share) for _ in range(a.batch)])
        lp = torch.log_softmax(model(ids, at), -1).gather(-1, target[:, None])[:, 0]
        loss = -(lp * weight).sum() / a.batch
        opt.zero_grad()
        loss.backward()
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (step + 1) / 20) * (0.5 + 0.5 * math.cos(math.pi * step / a.steps))
        opt.step()
        if step % 10 == 0 or step == a.steps - 1:
            print(f"step {step} lines {n} loss {loss.item():.4f} {time.time() - t0:.0f} s", flush=True)
    for t in params:
        t.requires_grad_(False)
    for k in model.w:  # the model kvfold will run: bf16
        model.w[k] = torch.from_numpy((bf16_bits(model.w[k]).astype(np.uint32) << 16).view(np.float32))
    return time.time() - t0


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvfold", required=True, help="the kvfold binary (its build has the C extension)")
    ap.add_argument("--base", default=os.path.join(DATA, "records-llama3-induct"), help="the weights to start from")
    ap.add_argument("--chat", default=os.path.join(DATA, "records-llama3-chat"),
                    help="the chat model directory: its tokenizer and template; model.safetensors is written there")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lines", default="4,6,8", help="record lines of the training documents (one per batch)")
    ap.add_argument("--chat-share", type=float, default=0.85, help="share of chat rows (the rest bare text)")
    ap.add_argument("--repeat-share", type=float, default=0.1, help="share of repeat rows (the rest questions)")
    ap.add_argument("--check-only", action="store_true", help="the forward check and the accuracies, no training")
    return ap.parse_args()


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    with open(os.path.join(a.base, "config.json")) as f:
        cfg = json.load(f)
    w, order = load_safetensors(os.path.join(a.base, "model.safetensors"))
    model = Llama(w, cfg)
    encode = tokenizer(a.kvfold, a.chat)
    P = pieces(a.kvfold, a.chat, encode)
    names, values = vocab_words(a.chat)
    print(f"pieces {P}\n{len(names)} names, {len(values)} values", flush=True)
    probe = [make_row(rng, encode, P, names, values, 24, chat)[0] for chat in (True, False, True)]
    print(f"forward vs kvfold logits: max |diff| {check_forward(model, a.kvfold, a.base, probe):.2e}", flush=True)
    tests, copies = held_out(a.seed + 1, encode, P, names, values)

    def show(tag):
        print(tag, ", ".join(f"{k} questions {accuracy(model, tests[k])}/{len(tests[k])} (repeat copy accuracy "
                             f"{copy_accuracy(model, copies[k]):.2f})" for k in tests), flush=True)
    show("before:")
    if a.check_only:
        return
    took = train(model, a, rng, encode, P, names, values)
    show(f"after {a.steps} steps ({took:.0f} s):")
    out = os.path.join(a.chat, "model.safetensors")
    save_safetensors(out, model.w, order)
    print(f"forward vs kvfold logits on the new weights: max |diff| "
          f"{check_forward(model, a.kvfold, a.chat, probe):.2e}\nwrote {out}")


if __name__ == "__main__":
    main()
