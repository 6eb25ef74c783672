/* kvfold bench tokenize — encoding throughput of the tokenizer on a generated (or given) text.
 * tools/bench-tokenize.sh runs the JavaScript tokenizer on the same text and prints the ratio. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/tokenizer.h"
#include "formats/escape.h"
#include "tools/cli.h"
#include "tools/commands.h"

typedef struct {
    const char *dir, *input, *save;
    long long mb;
} tok_opts;

#define T(field) OFF(tok_opts, field)
static const cli_opt kRows[] = {
    {"model", 0, OPT_STR, "DIR", T(dir), .help = "model directory with tokenizer.json"},
    {"mb", 0, OPT_LLONG, "N", T(mb), .lo = 1, .hi = 4096, .def = "10", .help = "megabytes of generated text"},
    {"input", 0, OPT_STR, "FILE", T(input), .help = "encode this file instead (UTF-8)"},
    {"save-text", 0, OPT_STR, "FILE", T(save), .help = "write the text that was encoded to FILE"},
    {0}};

const cli_command cli_bench_tokenize_command = {
    .name = "bench tokenize",
    .usage = "kvfold bench tokenize --model DIR [--mb N] [--input FILE] [--save-text FILE]\n",
    .about = "Encode N MB of text and print MB/s. The text is generated from a fixed seed\n"
             "(English-like prose, source code, numbers, CJK and other scripts, emoji, in paragraphs), or\n"
             "read from --input. It is encoded one paragraph at a time: the text is cut after every blank\n"
             "line (\"\\n\\n\"), as tools/bench-tokenize.sh cuts it for the JavaScript tokenizer.\n",
    .groups = (const cli_group[]){{NULL, kRows, 0}, {0}},
    .notes = "Last line: 'mb_per_s <value>' for scripts.\n",
    .exit_status = "  0  measured\n"
                   "  1  the tokenizer or the input cannot be read, or the text cannot be saved\n"
                   "  2  usage errors\n",
    .example = "  kvfold bench tokenize --model Qwen3-0.6B --mb 50\n",
};

static uint64_t rng_state;
static uint32_t rng(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

static const char *const kWords[] = {
    "the", "of", "and", "to", "in", "is", "was", "that", "for", "it", "with", "as", "his", "on",
    "be", "at", "by", "had", "are", "but", "from", "or", "have", "an", "they", "which", "one",
    "you", "were", "her", "all", "she", "there", "would", "their", "we", "him", "been", "has",
    "when", "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about",
    "into", "than", "them", "can", "only", "other", "new", "some", "could", "time", "these",
    "compaction", "attention", "document", "matching", "question", "answer", "records", "model",
    "cache", "values", "keys", "budget", "tokenizer", "don't", "it's", "we're", "they'll",
    "I've", "Kubernetes", "PostgreSQL", "naïve", "café", "Zürich", "straße", "Ångström"};
static const char *const kCode[] = {
    "    for (size_t i = 0; i < n; i++) {\n        acc += x[i] * w[i];\n    }\n",
    "def softmax(x):\n    e = np.exp(x - x.max())\n    return e / e.sum()\n",
    "if (rc != 0) { fprintf(stderr, \"%s: %s\\n\", path, strerror(errno)); return -1; }\n",
    "{\"id\": 1234, \"name\": \"kvfold\", \"tags\": [\"kv\", \"cache\"], \"ok\": true}\n",
    "SELECT doc_id, COUNT(*) AS n FROM chunks GROUP BY doc_id HAVING n > 16;\n"};
static const char *const kOther[] = {
    "我们在苹果公司工作了一千三百一十四天，", "東京都の天気は晴れです。", "한국어 텍스트도 있습니다. ",
    "Привет, как дела? ", "Καλημέρα κόσμε. ", "مرحبا بالعالم ", "🙂🚀 ", "👩‍💻 ", "३४५ ",
    "e\xcc\x81t\xc3\xa9 "};

typedef struct {
    char *buf;
    size_t len, cap;
} text_buf;

static int put(text_buf *t, const char *s) {
    size_t n = strlen(s);
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 1 << 20;
        while (cap < t->len + n + 1)
            cap *= 2;
        char *b = realloc(t->buf, cap);
        if (!b)
            return -1;
        t->buf = b;
        t->cap = cap;
    }
    memcpy(t->buf + t->len, s, n + 1);
    t->len += n;
    return 0;
}

/* Paragraphs of prose with some code, numbers and other scripts, each ending in "\n\n". */
static char *generate(size_t bytes, size_t *len) {
    text_buf t = {0};
    rng_state = 0x9E3779B97F4A7C15ULL;
    char num[32];
    while (t.len < bytes) {
        int sentences = 2 + (int)(rng() % 6);
        for (int s = 0; s < sentences; s++) {
            uint32_t kind = rng() % 20;
            if (kind == 0) {
                if (put(&t, kCode[rng() % (sizeof kCode / sizeof *kCode)]))
                    return NULL;
                continue;
            }
            if (kind == 1) {
                if (put(&t, kOther[rng() % (sizeof kOther / sizeof *kOther)]))
                    return NULL;
                continue;
            }
            int words = 4 + (int)(rng() % 16);
            for (int w = 0; w < words; w++) {
                if (w && put(&t, " "))
                    return NULL;
                if (rng() % 25 == 0) {
                    snprintf(num, sizeof num, "%u", rng() % 100000);
                    if (put(&t, num))
                        return NULL;
                } else if (put(&t, kWords[rng() % (sizeof kWords / sizeof *kWords)])) {
                    return NULL;
                }
                if (rng() % 12 == 0 && put(&t, ","))
                    return NULL;
            }
            if (put(&t, rng() % 5 ? ". " : "?\n"))
                return NULL;
        }
        if (put(&t, "\n\n"))
            return NULL;
    }
    *len = t.len;
    return t.buf;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 20, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n == cap) {
            char *b = realloc(buf, cap *= 2);
            if (!b) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = b;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    fclose(f);
    *len = n;
    return buf;
}

int cmd_bench_tokenize(int argc, char **argv) {
    tok_opts o = {.mb = 10};
    int first;
    const int prc = cli_opts_parse(&cli_bench_tokenize_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    if (first < argc)
        return cli_usage_error("bench tokenize", "unexpected argument '%s'", argv[first]);
    if (!o.dir)
        return cli_usage_error("bench tokenize", "--model DIR is required");
    const char *dir = o.dir, *input = o.input, *save = o.save;
    const long long mb = o.mb;

    kf_error err = {0};
    kf_tokenizer *tok = NULL;
    double t0 = cli_now();
    if (kf_tokenizer_open(&tok, dir, &err) != KF_OK) {
        cli_error("bench tokenize", "%s", err.msg);
        return KF_EXIT_FAIL;
    }
    double load_s = cli_now() - t0;
    size_t len = 0;
    char *text = input ? read_file(input, &len) : generate((size_t)mb * 1000000, &len);
    if (!text) {
        cli_error("bench tokenize", input ? "%s: cannot read" : "out of memory%s", input ? input : "");
        kf_tokenizer_close(tok);
        return KF_EXIT_FAIL;
    }
    int rc = KF_EXIT_OK;
    if (save) {
        FILE *f = fopen(save, "wb");
        if (!f || fwrite(text, 1, len, f) != len || fclose(f) != 0) {
            cli_error("bench tokenize", "%s: cannot write", save);
            free(text);
            kf_tokenizer_close(tok);
            return KF_EXIT_FAIL;
        }
    }
    /* Paragraph boundaries: after every "\n\n" (as JavaScript's split(/(?<=\n\n)/)). */
    kf_token_ids ids = {0};
    size_t first_end = len;
    for (size_t p = 2; p < len; p++)
        if (text[p - 1] == '\n' && text[p - 2] == '\n') {
            first_end = p;
            break;
        }
    if (kf_tokenizer_encode(tok, text, first_end, 0, &ids, &err) != KF_OK) { /* warm-up */
        cli_error("bench tokenize", "%s", err.msg);
        rc = KF_EXIT_FAIL;
        goto done;
    }
    ids.n = 0;
    size_t tokens = 0;
    t0 = cli_now();
    for (size_t start = 0, p = 1; start < len; p++) {
        if (p == len || (p >= 2 && text[p - 1] == '\n' && text[p - 2] == '\n')) {
            if (kf_tokenizer_encode(tok, text + start, p - start, 0, &ids, &err) != KF_OK) {
                cli_error("bench tokenize", "%s", err.msg);
                rc = KF_EXIT_FAIL;
                goto done;
            }
            tokens += ids.n;
            ids.n = 0;
            start = p;
        }
    }
    double s = cli_now() - t0;
    printf("kvfold %s: %zu bytes, %zu tokens, %.3f s (tokenizer load %.3f s)\n", KF_ESC(dir), len, tokens, s,
           load_s);
    printf("mb_per_s %.3f\n", (double)len / 1e6 / s);
done:
    kf_token_ids_free(&ids);
    free(text);
    kf_tokenizer_close(tok);
    return rc;
}
