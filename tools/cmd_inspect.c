/* kvfold inspect FILE — what a kvf cache file holds: header, sizes, per-layer and per-head stats. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "formats/escape.h"
#include "formats/kvf.h"
#include "tools/cli.h"
#include "tools/commands.h"

#define CMD "inspect"

typedef struct {
    int format, layers_only; /* format: 0 text, 1 json */
} inspect_opts;

static const cli_opt kRows[] = {
    {"format", 0, OPT_CHOICE, "text|json", OFF(inspect_opts, format), .choices = "text|json", .def = "text",
     .help = "text, or json: one JSON object on stdout"},
    {"json", 0, OPT_ALIAS, .target = "format", .fixed = "json"},
    {"layers-only", 0, OPT_FLAG, NULL, OFF(inspect_opts, layers_only), .help = "per-layer statistics only (no per-head rows)"},
    {0}};

const cli_command cli_inspect_command = {
    .name = CMD,
    .usage = "kvfold inspect [--format text|json] [--layers-only] FILE\n",
    .about = "Show a kvf cache file (written by kvfold compact): its header (model fingerprint, document\n"
             "digest, D and C, method, budget, lambda, RoPE frame, dtype, shape), its sizes (bytes on disk,\n"
             "the K/V payload, and the compression against a full cache of the D document tokens in the same\n"
             "dtype), and statistics per layer and per KV head: L2 norms of the keys and values (mean, max),\n"
             "AM's bias beta (min, mean, max), the norm of the fold direction |u|, and padding slots.\n"
             "Padding slots (original position -1) are left out of the statistics.\n"
             "\n"
             "Also the method each KV head was compacted with (counts per method and a per-layer map:\n"
             "k keep, d drop, a am, f fold).\n"
             "\n"
             "Every chunk of the file is read and checked against its checksum, every layer against its\n"
             "digest, every value against its allowed range: a damaged file is refused.\n",
    .groups = (const cli_group[]){{NULL, kRows, 0}, {0}},
    .exit_status = "  0  the file is valid\n"
                   "  1  the file is refused (the message names the cause; with --format json nothing is\n"
                   "     printed on stdout, the message goes to stderr)\n"
                   "  2  usage errors\n",
    .example = "  kvfold inspect --format json kvf-cache/<fingerprint>/<digest>.fold-0.1.<recipe>.kvf\n",
};

typedef struct {
    double k_mean, k_max, v_mean, v_max; /* L2 norms over the head's slots */
    double b_min, b_mean, b_max;         /* beta */
    double u_norm;
    int64_t padding;
} head_stats;

static void norms(const float *x /* [C, H, D] */, int64_t C, int H, int D, int h, const int32_t *pos /* [C] */,
                  double *mean, double *max) {
    double sum = 0, mx = 0;
    int64_t n = 0;
    for (int64_t t = 0; t < C; t++) {
        if (pos[t] < 0)
            continue;
        const float *r = x + ((size_t)t * (size_t)H + (size_t)h) * (size_t)D;
        double s = 0;
        for (int d = 0; d < D; d++)
            s += (double)r[d] * r[d];
        s = sqrt(s);
        sum += s;
        mx = s > mx ? s : mx;
        n++;
    }
    *mean = n ? sum / (double)n : 0;
    *max = mx;
}

static json_t *stats_json(const head_stats *s) {
    return json_pack("{s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:I}", "key_norm_mean", s->k_mean, "key_norm_max",
                     s->k_max, "value_norm_mean", s->v_mean, "value_norm_max", s->v_max, "beta_min", s->b_min,
                     "beta_mean", s->b_mean, "beta_max", s->b_max, "u_norm", s->u_norm, "padding",
                     (json_int_t)s->padding);
}

static void stats_row(const char *label, const head_stats *s) {
    printf("  %-8s %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %8.4f %7lld\n", label, s->k_mean, s->k_max, s->v_mean,
           s->v_max, s->b_min, s->b_mean, s->b_max, s->u_norm, (long long)s->padding);
}

/* Per-layer summary: means of the heads' means, max of maxima, min of minima. */
static head_stats layer_summary(const head_stats *hs, int H) {
    head_stats s = {.b_min = INFINITY, .b_max = -INFINITY};
    for (int h = 0; h < H; h++) {
        s.k_mean += hs[h].k_mean / H;
        s.v_mean += hs[h].v_mean / H;
        s.b_mean += hs[h].b_mean / H;
        s.u_norm += hs[h].u_norm / H;
        s.k_max = fmax(s.k_max, hs[h].k_max);
        s.v_max = fmax(s.v_max, hs[h].v_max);
        s.b_min = fmin(s.b_min, hs[h].b_min);
        s.b_max = fmax(s.b_max, hs[h].b_max);
        s.padding += hs[h].padding;
    }
    return s;
}

/* One JSON object on stdout; -1 (after an error message, nothing printed) when one cannot be
 * built, e.g. from a path that is not UTF-8. */
static int print_json(const char *path, kvf_file *f, const struct stat *sb, const char *budget_s, double full,
                      const head_stats *st, const uint8_t *hm /* [L, H] */, const int by_method[4], int layers_only) {
    const kvf_header *h = kvf_file_header(f);
    const int L = h->n_layers, H = h->kv_heads, D = h->head_dim;
    const int64_t C = h->n_tokens, payload = kvf_kv_bytes(h); /* < 2^40 elements x 4 bytes: kvf_open bounds it */
    const double on_disk = (double)sb->st_size;
    (void)budget_s;
    json_t *layers = json_array();
    for (int l = 0; l < L; l++) {
        head_stats sum = layer_summary(st + (size_t)l * H, H);
        json_t *lj = json_pack("{s:i}", "layer", l), *sj = stats_json(&sum);
        json_object_update(lj, sj);
        json_decref(sj);
        if (!layers_only) {
            json_t *heads = json_array();
            for (int hh = 0; hh < H; hh++)
                json_array_append_new(heads, stats_json(&st[(size_t)l * H + hh]));
            json_object_set_new(lj, "heads", heads);
        }
        json_array_append_new(layers, lj);
    }
    json_t *root = json_pack(
        "{s:s, s:s, s:i, s:s, s:s, s:s, s:s, s:s, s:s, s:I, s:I, s:s, s:f, s:f, s:s, s:s, s:s, s:i, s:i, s:i, s:i}",
        "file", path, "format", KVF_FORMAT_NAME, "version", h->version, "creator", h->creator, "model_fingerprint",
        h->model_fingerprint, "tokenizer_digest", h->tokenizer_digest, "document_digest", h->document_digest,
        "recipe_digest", h->recipe_digest, "payload_digest", h->payload_digest, "n_doc_tokens",
        (json_int_t)h->n_doc_tokens, "n_tokens", (json_int_t)C, "method", kf_method_name(h->method), "budget",
        h->budget, "lambda", h->lambda, "rope_frame", kvf_rope_frame_name(h->rope_frame), "placeholder", h->placeholder,
        "dtype", kf_dtype_name(h->dtype), "n_layers", L, "kv_heads", H, "head_dim", D, "block_size", h->block_size);
    if (!root) { /* json_pack gives NULL for a string that is not UTF-8 (the path) */
        json_decref(layers);
        cli_error(CMD, "%s: cannot write the JSON (a name that is not UTF-8?)", path);
        return -1;
    }
    json_object_set_new(root, "sizes",
                        json_pack("{s:I, s:I, s:f, s:f, s:f}", "file_bytes", (json_int_t)sb->st_size, "kv_bytes",
                                  (json_int_t)payload, "full_cache_bytes", full, "token_ratio",
                                  (double)h->n_doc_tokens / (double)C, "bytes_ratio", (double)full / on_disk));
    json_object_set_new(root, "checksums", json_string("ok"));
    const int chat = h->chat_template_digest[0] != 0; /* a chat cache (kvfold compact --chat) */
    if (chat)
        json_object_set_new(root, "chat",
                            json_pack("{s:s, s:s, s:s, s:s}", "template_digest", h->chat_template_digest, "prefix_ids",
                                      h->chat_prefix_ids, "question_prefix_ids", h->chat_question_prefix_ids,
                                      "question_suffix_ids", h->chat_question_suffix_ids));
    json_t *hmj = json_array();
    for (int l = 0; l < L; l++) {
        char map[4097];
        for (int hh = 0; hh < H; hh++)
            map[hh] = "kdaf"[hm[(size_t)l * H + hh] & 3];
        map[H] = 0;
        json_array_append_new(hmj, json_string(map));
    }
    json_object_set_new(root, "head_methods",
                        json_pack("{s:i, s:i, s:i, s:i, s:o}", "keep", by_method[0], "drop", by_method[1], "am",
                                  by_method[2], "fold", by_method[3], "per_layer", hmj));
    json_object_set_new(root, "layers", layers);
    /* any part that could not be built leaves a key out: then nothing is printed */
    int bad = !layers || json_object_size(root) != (size_t)(25 + chat) || json_array_size(layers) != (size_t)L;
    char *s = bad ? NULL : json_dumps(root, JSON_INDENT(1) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(7));
    if (s)
        puts(s);
    else
        cli_error(CMD, "%s: cannot write the JSON (a name that is not UTF-8?)", path);
    const int rc = s ? 0 : -1;
    free(s);
    json_decref(root);
    return rc;
}

/* The statistics of KV head hh of one layer: k, v [C, H, D] (fp32), beta [H, C], u [H, D], and
 * p [C] the head's original positions (-1: a padding slot, left out). */
static void head_stat(const float *k, const float *v, const float *beta, const float *u, const int32_t *p, int64_t C,
                      int H, int D, int hh, head_stats *s) {
    norms(k, C, H, D, hh, p, &s->k_mean, &s->k_max);
    norms(v, C, H, D, hh, p, &s->v_mean, &s->v_max);
    s->b_min = INFINITY;
    s->b_max = -INFINITY;
    int64_t n = 0;
    for (int64_t t = 0; t < C; t++) {
        if (p[t] < 0) {
            s->padding++;
            continue;
        }
        double b = beta[(size_t)hh * (size_t)C + (size_t)t];
        s->b_min = fmin(s->b_min, b);
        s->b_max = fmax(s->b_max, b);
        s->b_mean += b;
        n++;
    }
    s->b_mean = n ? s->b_mean / (double)n : 0;
    if (!n)
        s->b_min = s->b_max = 0;
    double un = 0;
    for (int d = 0; d < D; d++)
        un += (double)u[(size_t)hh * D + d] * u[(size_t)hh * D + d];
    s->u_norm = sqrt(un);
}

/* The text form: the header, the sizes, the heads' methods, the statistics table. */
static void print_text(const char *path, kvf_file *f, double on_disk, double full, const char *budget,
                       const head_stats *st /* [L, H] */, const uint8_t *hm /* [L, H] */, const int by_method[4],
                       int layers_only) {
    const kvf_header *h = kvf_file_header(f);
    const int L = h->n_layers, H = h->kv_heads, D = h->head_dim;
    const int64_t C = h->n_tokens, payload = kvf_kv_bytes(h); /* < 2^40 elements x 4 bytes: kvf_open bounds it */
    /* the path as given may hold anything; the header's strings are checked clean (kvf_open) and
     * escaped all the same, by the one helper */
    printf("file         %s\n", KF_ESC(path));
    printf("format       %s version %d, written by %s\n", KVF_FORMAT_NAME, h->version, KF_ESC(h->creator));
    printf("model        %s\n", h->model_fingerprint);
    printf("tokenizer    %s\n", h->tokenizer_digest[0] ? h->tokenizer_digest : "(unknown)");
    printf("document     %s, D = %lld tokens\n", h->document_digest, (long long)h->n_doc_tokens);
    if (h->chat_template_digest[0]) {
        printf("chat         template %s (kvfold ask --chat)\n", h->chat_template_digest);
        printf("  before the document  %s\n", h->chat_prefix_ids);
        printf("  a question begins    %s\n", h->chat_question_prefix_ids);
        printf("  after its text       %s\n", h->chat_question_suffix_ids);
    } else {
        printf("chat         no (bare text)\n");
    }
    printf("recipe       %s\n", h->recipe_digest);
    printf("payload      %s (XXH3-128 over the head digests)\n", h->payload_digest);
    printf("compacted    C = %lld slots (%lld blocks of %d)\n", (long long)C, (long long)kvf_n_blocks(f),
           h->block_size);
    printf("method       %s, budget %s, lambda %g\n", kf_method_name(h->method), budget, h->lambda);
    printf("rope frame   %s%s\n", kvf_rope_frame_name(h->rope_frame),
           h->rope_frame == KVF_FRAME_COMPACTED ? " (question starts at position C)"
                                                : " (question starts at position D)");
    printf("placeholder  %s\n", KF_ESC(h->placeholder));
    printf("shape        %d layers x %d kv heads x head_dim %d, %s\n", L, H, D, kf_dtype_name(h->dtype));
    printf("sizes        %.0f bytes on disk, %lld of K/V; a full cache of D tokens: %.0f\n", on_disk,
           (long long)payload, full);
    printf("compression  %.2fx in tokens (D/C), %.2fx in bytes (full cache / file)\n",
           (double)h->n_doc_tokens / (double)C, (double)full / on_disk);
    printf("checksums    ok (every chunk, every layer's digest)\n");
    printf("head methods keep %d, drop %d, am %d, fold %d (of %d heads)\n", by_method[0], by_method[1],
           by_method[2], by_method[3], L * H);
    if (by_method[h->method] != L * H)
        for (int l = 0; l < L; l++) {
            printf("  layer %-4d ", l);
            for (int hh = 0; hh < H; hh++)
                putchar("kdaf"[hm[(size_t)l * H + hh] & 3]);
            putchar('\n');
        }
    printf("\n  %-8s %9s %9s %9s %9s %9s %9s %9s %8s %7s\n", "layer", "|k|mean", "|k|max", "|v|mean", "|v|max",
           "beta min", "beta mean", "beta max", "|u|", "padding");
    for (int l = 0; l < L; l++) {
        char label[32];
        snprintf(label, sizeof label, "%d", l);
        head_stats sum = layer_summary(st + (size_t)l * H, H);
        stats_row(label, &sum);
        for (int hh = 0; hh < H && !layers_only; hh++) {
            snprintf(label, sizeof label, "  h%d", hh);
            stats_row(label, &st[(size_t)l * H + hh]);
        }
    }
}

int cmd_inspect(int argc, char **argv) {
    inspect_opts o = {0};
    int first;
    const int prc = cli_opts_parse(&cli_inspect_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    if (first != argc - 1)
        return cli_usage_error(CMD, "expected one cache file");
    const char *path = argv[first];
    const int as_json = o.format == 1, layers_only = o.layers_only;
    kf_error err = {0};
    kvf_file *f;
    if (kvf_open(path, &f, &err) != KF_OK) {
        cli_error(CMD, "%s", err.msg);
        return KF_EXIT_FAIL;
    }
    const kvf_header *h = kvf_file_header(f);
    const int L = h->n_layers, H = h->kv_heads, D = h->head_dim;
    const int64_t C = h->n_tokens;
    struct stat sb;
    stat(path, &sb);
    /* D may be 2^31 - 1: in doubles (2 L D H d bytes would overflow int64) */
    const double full = 2.0 * L * (double)h->n_doc_tokens * H * D * (double)kf_dtype_size(h->dtype);
    const double on_disk = (double)sb.st_size;

    size_t ln = (size_t)C * (size_t)H * (size_t)D;
    float *k = malloc(ln * 4), *v = malloc(ln * 4), *beta = malloc((size_t)H * (size_t)C * 4),
          *u = malloc((size_t)H * (size_t)D * 4);
    void *raw = malloc(2 * ln * kf_dtype_size(h->dtype)); /* [2, C, H, D] as stored */
    int32_t *pos = malloc((size_t)H * (size_t)C * 4);
    uint8_t *hm = malloc((size_t)L * (size_t)H);                /* [L, H] */
    head_stats *st = calloc((size_t)L * (size_t)H, sizeof *st); /* [L, H] */
    int rc = KF_EXIT_FAIL;
    if (!k || !v || !beta || !u || !pos || !st || !raw || !hm) {
        cli_error(CMD, "out of memory");
        goto out;
    }
    for (int l = 0; l < L; l++) {
        char *kr = raw, *vr = kr + ln * kf_dtype_size(h->dtype);
        if (kvf_read_layer_all(f, l, kr, vr, beta, u, pos, hm + (size_t)l * H, &err) != KF_OK) {
            cli_error(CMD, "%s", err.msg);
            goto out;
        }
        kf_convert_to_f32(k, kr, h->dtype, ln);
        kf_convert_to_f32(v, vr, h->dtype, ln);
        for (int hh = 0; hh < H; hh++)
            head_stat(k, v, beta, u, pos + (size_t)hh * (size_t)C, C, H, D, hh, &st[(size_t)l * H + hh]);
    }

    char budget[32];
    kvf_format_budget(h->budget, budget, sizeof budget);
    int by_method[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < (size_t)L * (size_t)H; i++)
        by_method[hm[i] & 3]++; /* kvf_read_layer_all refused values above 3 */
    if (as_json) {
        if (print_json(path, f, &sb, budget, full, st, hm, by_method, layers_only) != 0)
            goto out;
    } else {
        print_text(path, f, on_disk, full, budget, st, hm, by_method, layers_only);
    }
    rc = KF_EXIT_OK;
out:
    free(k);
    free(v);
    free(beta);
    free(u);
    free(pos);
    free(st);
    free(raw);
    free(hm);
    kvf_close(f);
    return rc;
}
