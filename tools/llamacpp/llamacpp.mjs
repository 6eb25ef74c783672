// llama.cpp (node-llama-cpp's prebuilt CPU build) on a GGUF file: prefill timing, or the
// next-token log-probabilities after a list of token ids. Run by tools/bench-llamacpp.sh.
//
//   node llamacpp.mjs bench  --modules DIR --model F.gguf --tokens 512,2048 --threads T --repeat R
//   node llamacpp.mjs logits --modules DIR --model F.gguf[,G.gguf...] --ids 1,2,3 --threads T
// Also --flash auto|on|off (flash attention, default auto as in llama.cpp), --kv f16|f32 (the KV
// cache's type, default f16 as in llama.cpp; f32 for a logits comparison), --seed S and --vocab V
// (bench: the prompt is ids below V drawn with seed S; default V 1000).
//
// --modules is the folder holding node_modules/node-llama-cpp (npm ci of this folder's
// package-lock.json). Nothing is downloaded or built: a missing prebuilt binary is an error.
import { pathToFileURL } from "node:url";
import { join } from "node:path";

function die(msg) {
    console.error(`llamacpp.mjs: ${msg}`);
    process.exit(2);
}

function parseArgs(argv) {
    const mode = argv[0];
    if (mode !== "bench" && mode !== "logits")
        die("first argument must be 'bench' or 'logits'");
    const opt = { mode, threads: 1, repeat: 3, tokens: "512", seed: 1, flash: "auto", kv: "f16", vocab: 1000 };
    for (let i = 1; i < argv.length; i += 2) {
        const key = argv[i].replace(/^--/, ""), val = argv[i + 1];
        if (val === undefined)
            die(`${argv[i]} needs a value`);
        if (!["modules", "model", "tokens", "threads", "repeat", "ids", "seed", "flash", "kv", "vocab"].includes(key))
            die(`unknown option ${argv[i]}`);
        opt[key] = val;
    }
    for (const key of ["threads", "repeat", "seed", "vocab"]) {
        opt[key] = Number(opt[key]);
        if (!Number.isInteger(opt[key]) || opt[key] < (key === "seed" ? 0 : 1))
            die(`--${key} must be a positive integer`);
    }
    if (!opt.modules || !opt.model)
        die("--modules and --model are required");
    if (!["auto", "on", "off"].includes(opt.flash))
        die("--flash must be auto, on or off");
    if (!["f16", "f32"].includes(opt.kv))
        die("--kv must be f16 or f32");
    return opt;
}

function intList(text, what) {
    const v = String(text).split(/[ ,]+/).filter(Boolean).map(Number);
    if (v.length === 0 || v.some(x => !Number.isInteger(x) || x < 0))
        die(`${what}: not a list of non-negative integers: '${text}'`);
    return v;
}

// A fixed-seed generator of token ids (xorshift32): the same prompt on every run.
function randomIds(n, vocab, seed) {
    let s = (seed * 2654435761 + 1) >>> 0 || 1;
    const ids = new Array(n);
    for (let i = 0; i < n; i++) {
        s ^= s << 13; s >>>= 0; s ^= s >>> 17; s ^= s << 5; s >>>= 0;
        ids[i] = s % vocab;
    }
    return ids;
}

async function getLlama(opt) {
    const lib = await import(pathToFileURL(join(opt.modules, "node_modules/node-llama-cpp/dist/index.js")).href);
    return lib.getLlama({
        gpu: false, build: "never", skipDownload: true, usePrebuiltBinaries: true, progressLogs: false,
        maxThreads: opt.threads, logLevel: lib.LlamaLogLevel.error,
    });
}

async function load(llama, opt, path, maxTokens) {
    const model = await llama.loadModel({ modelPath: path, gpuLayers: 0 });
    const flash = { auto: "auto", on: true, off: false }[opt.flash];
    const context = await model.createContext({
        contextSize: maxTokens, batchSize: maxTokens, sequences: 1, threads: opt.threads, flashAttention: flash,
        experimentalKvCacheKeyType: opt.kv.toUpperCase(), experimentalKvCacheValueType: opt.kv.toUpperCase(),
    });
    return { model, context, sequence: context.getSequence() };
}

// One prefill of ids from an empty cache, the last position's next token computed (as in kvfold's
// bench prefill, whose last position goes through the lm_head); returns seconds.
async function prefillOnce(sequence, ids) {
    await sequence.clearHistory();
    const input = ids.map((t, i) => (i === ids.length - 1 ? [t, { generateNext: { token: true } }] : t));
    const t0 = process.hrtime.bigint();
    await sequence.controlledEvaluate(input);
    return Number(process.hrtime.bigint() - t0) / 1e9;
}

function median(v) {
    const s = [...v].sort((a, b) => a - b), m = s.length >> 1;
    return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

async function bench(opt) {
    const counts = intList(opt.tokens, "--tokens");
    const { context, sequence } = await load(await getLlama(opt), opt, opt.model, Math.max(...counts));
    console.log(`llama.cpp ${opt.model}: threads ${context.currentThreads}, flash attention ${opt.flash}, KV cache ${opt.kv}`);
    for (const n of counts) {
        const ids = randomIds(n, opt.vocab, opt.seed);
        await prefillOnce(sequence, ids); // warm-up: pages the weights in, sizes the buffers
        const times = [];
        for (let r = 0; r < opt.repeat; r++)
            times.push(await prefillOnce(sequence, ids));
        const t = median(times);
        console.log(`prefill ${n} median_s ${t.toFixed(4)} runs ${times.map(x => x.toFixed(4)).join(",")}`);
        console.log(`tokens_per_s ${(n / t).toFixed(2)}`);
    }
}

// Log-probabilities of every token after the ids, one JSON object per model of the comma-separated
// --model list: node-llama-cpp gives the softmax of the raw logits (greedy sampler: no
// temperature, no penalties) as probabilities.
async function logits(opt) {
    const ids = intList(opt.ids, "--ids");
    const llama = await getLlama(opt);
    for (const path of opt.model.split(",")) {
        const { model, context, sequence } = await load(llama, opt, path, ids.length);
        const input = ids.map((t, i) => (i === ids.length - 1 ? [t, { generateNext: { probabilities: true } }] : t));
        const out = await sequence.controlledEvaluate(input);
        const probs = out[ids.length - 1]?.next?.probabilities;
        if (!probs)
            die(`${path}: llama.cpp returned no probabilities for the last position`);
        const logp = {};
        for (const [tok, p] of probs)
            if (p > 0)
                logp[tok] = Math.log(p);
        console.log(JSON.stringify({ model: path, n_tokens: ids.length, logp }));
        await context.dispose();
        await model.dispose();
    }
}

const opt = parseArgs(process.argv.slice(2));
try {
    await (opt.mode === "bench" ? bench(opt) : logits(opt));
} catch (e) {
    die(`${opt.model}: ${e.message}`);
}
process.exit(0);
