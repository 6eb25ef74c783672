/* kvfold ask — answer questions from a kvf cache file through the paged engine. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/engine.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/doc_chat.h"
#include "tools/doc_input.h"

#define CMD "ask"

typedef struct {
    const char *model_dir, *stop, *doc_path, *qids_s;
    long long max_tokens;
    int compare, format, quiet, chat; /* format: 0 text, 1 json */
} ask_opts;

#define A(field) OFF(ask_opts, field)
static const cli_opt kRows[] = {
    {"model", 0, OPT_STR, "DIR", A(model_dir), .help = "the model the cache was written for"},
    {"question-ids", 0, OPT_STR, "LIST", A(qids_s), .help = "a question as token ids (comma separated), in addition to QUESTIONs"},
    {"chat", 0, OPT_FLAG, NULL, A(chat),
     .help = "the cache was made with --chat (kvfold compact): each QUESTION (or --question-ids) is the content of "
             "a user turn after the document's, its ids put between the ids the file records (the end of the "
             "document's turn and the next turn's header; the end of the question's turn and the generation "
             "prompt). The model's template must be the file's (digest). A chat cache without --chat, --chat "
             "on a cache made from bare text, or --chat with a model that has no chat template, is refused "
             "(exit 2)"},
    {"max-tokens", 0, OPT_LLONG, "N", A(max_tokens), .lo = 1, .hi = 1 << 20, .must = "must be a positive count",
     .def = "32",
     .help = "most tokens per answer; decoding stops earlier at EOS and at the model's last position "
             "(max_position_embeddings); a question that leaves no room there after the cache's C tokens "
             "(the document's D with --compare) is a usage error (exit 2)"},
    {"stop", 0, OPT_STR, "TEXT", A(stop), .help = "also stop once the answer contains TEXT (e.g. $'\\n')"},
    {"doc", 0, OPT_STR, "FILE", A(doc_path),
     .help = "the document the cache was built from (text, a JSON list of ids, or a manifest line; with --chat, "
             "through the chat template as compact --chat reads it); checked against the cache's document digest"},
    {"compare", 0, OPT_FLAG, NULL, A(compare),
     .help = "with --doc: also answer from the full document and report agreement (exit status 0 either way)"},
    {"format", 0, OPT_CHOICE, "text|json", A(format), .choices = "text|json", .def = "text",
     .help = "text, or json: one JSON object per question: question, question_ids (the ids after the cache: with "
             "--chat, the template's pieces around the question), answer, answer_ids, and with --compare "
             "full_answer, full_answer_ids, agree"},
    {"json", 0, OPT_ALIAS, .target = "format", .fixed = "json"},
    {"quiet", 'q', OPT_FLAG, NULL, A(quiet), .help = "no cache summary on stderr"},
    {0}};

const cli_command cli_ask_command = {
    .name = CMD,
    .usage = "kvfold ask FILE.kvf --model DIR [options] QUESTION...\n",
    .about = "Loads the compacted cache of FILE into the paged engine (after checking that it was written\n"
             "for this model) and answers each QUESTION greedily on top of it: the question's tokens sit at\n"
             "positions C, C+1, ... as in a serving engine after a prefix of C tokens. Each question starts\n"
             "from the cache alone (the previous question's KV is rewound). Prints each answer's text.\n",
    .groups = (const cli_group[]){{NULL, kRows, 0}, {0}},
    .notes = "The file's tokenizer (tokenizer_digest) must be the model's tokenizer.json.\n",
    .exit_status = "  0  every question answered (with --compare, whether or not the answers agree)\n"
                   "  1  the cache, the model or the document cannot be used (the message names the cause)\n"
                   "  2  usage errors, including a question that leaves no room for an answer\n",
    .example = "  kvfold ask doc.kvf --model records-qwen3 $'Q: Alice?\\nA:'   (the records model's questions)\n",
};

static void print_str(const char *label, const char *s) {
    json_t *j = json_string(s ? s : "");
    char *q = j ? json_dumps(j, JSON_ENCODE_ANY) : NULL;
    printf("%-9s %s\n", label, q ? q : "?");
    free(q);
    json_decref(j);
}

/* Positions left for the answer of a question of nq tokens after a context of ctx tokens (the
 * cache's C, or the document's D when the full context answers too); -1 when the question itself
 * runs past the model's positions (reported: a usage error). */
static int answer_room(const kf_hfconfig *cfg, int64_t ctx, int i, int nq, long long max_tokens) {
    const int64_t max_pos = cfg->max_position_embeddings;
    if (max_pos <= 0)
        return (int)max_tokens;
    if (ctx + nq >= max_pos) { /* at least one answer token must fit */
        cli_usage_error(CMD,
                        "question %d: %lld context tokens + %d question tokens leave no room within the model's %lld "
                        "positions (max_position_embeddings)",
                        i + 1, (long long)ctx, nq, (long long)max_pos);
        return -1;
    }
    return (int)(max_pos - ctx - nq < max_tokens ? max_pos - ctx - nq : max_tokens);
}

static json_t *ids_json(const int32_t *ids, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(a, json_integer(ids[i]));
    return a;
}

/* --chat against the file's record: a chat cache is asked with --chat, a bare-text one without; with
 * --chat, the model's template (the file's) opened into dc and set for --doc. The exit status. */
static int ask_chat(const char *path, const kvf_header *h, int chat, doc_text *text, doc_chat *dc) {
    char err[1024];
    if (chat && !h->chat_template_digest[0])
        return cli_usage_error(CMD, "%s was compacted from bare text, not through a chat template: ask without --chat",
                               path);
    if (!chat && h->chat_template_digest[0])
        return cli_usage_error(CMD,
                               "%s was compacted through a chat template (%s): ask with --chat, which puts the "
                               "question in its user turn",
                               path, h->chat_template_digest);
    if (!chat)
        return KF_EXIT_OK;
    const int rc = doc_chat_for_cache(dc, text, h, err, sizeof err);
    if (rc == DOC_CHAT_NO_TEMPLATE) /* as compact --chat says it */
        return cli_usage_error(CMD, "--chat: %s: %s", text->model_dir, err);
    if (rc) {
        cli_error(CMD, "%s: %s", path, err);
        return KF_EXIT_FAIL;
    }
    text->chat = dc;
    return KF_EXIT_OK;
}

/* One ask: the model, the cache and the questions. */
typedef struct {
    const ask_opts *o;
    const char *path;     /* the cache file */
    kf_model *m;
    const kf_hfconfig *cfg;
    doc_text text;
    doc_chat dc;
    kf_compacted c;
    kvf_header hdr;
    kf_engine ec, ef;     /* on the cache; on the full document (--compare) */
    int32_t *doc;         /* [n_doc] the document's ids (--doc) */
    int n_doc;
    int n_q, longest;     /* questions; the longest's tokens */
    int32_t **qs;         /* [n_q] -> [qn[i]] each question's ids as the engine sees them */
    int *qn;              /* [n_q] */
    char **disp;          /* [n_q] the questions' text, without the template */
    int32_t *out;         /* [2 * max_tokens] the cache's answer, then the full context's */
} ask_run;

/* Question i's ids from its text (or --question-ids, the last), in the vocabulary, wrapped in the
 * template's pieces with --chat; the exit status. */
static int read_question(ask_run *r, int i, const char *text_q) {
    char err[1024];
    if (!text_q ? cli_parse_ids(r->o->qids_s, &r->qs[i], &r->qn[i], err, sizeof err)
                : doc_tokenize(&r->text, text_q, strlen(text_q), 0, &r->qs[i], &r->qn[i], err, sizeof err)) {
        if (!text_q) /* a malformed --question-ids ("1,,2") is a usage error */
            return cli_usage_error(CMD, "--question-ids: %s", err);
        cli_error(CMD, "question %d: %s", i + 1, err);
        return KF_EXIT_FAIL;
    }
    for (int j = 0; j < r->qn[i]; j++)
        if (r->qs[i][j] >= r->cfg->vocab_size) {
            cli_error(CMD, "question %d: token id %d is outside the vocabulary", i + 1, r->qs[i][j]);
            return KF_EXIT_FAIL;
        }
    r->disp[i] = doc_decode(&r->text, r->qs[i], r->qn[i]);
    if (r->o->chat) {
        int32_t *w = NULL;
        if (doc_chat_question(&r->dc, r->qs[i], r->qn[i], &w, &r->qn[i])) {
            cli_error(CMD, "out of memory");
            return KF_EXIT_FAIL;
        }
        free(r->qs[i]);
        r->qs[i] = w;
    }
    r->longest = r->qn[i] > r->longest ? r->qn[i] : r->longest;
    return KF_EXIT_OK;
}

/* The cache (checked for this model, tokenizer and --chat), the questions, the document (--doc) and
 * the engines; the exit status. */
static int ask_prepare(ask_run *r, char **text_qs, int n_text_q) {
    const ask_opts *o = r->o;
    if (cache_load(CMD, r->path, r->m, 0, &r->c, &r->hdr) || cache_check_tokenizer(CMD, &r->text, r->path, &r->hdr))
        return KF_EXIT_FAIL;
    int rc = ask_chat(r->path, &r->hdr, o->chat, &r->text, &r->dc);
    for (int i = 0; i < r->n_q && rc == KF_EXIT_OK; i++)
        rc = read_question(r, i, i < n_text_q ? text_qs[i] : NULL);
    char digest[KVF_DIGEST_LEN + 1];
    if (rc == KF_EXIT_OK && o->doc_path &&
        cache_doc_read(CMD, &r->text, o->doc_path, r->path, &r->hdr, &r->doc, &r->n_doc, digest))
        return KF_EXIT_FAIL;
    const int64_t ctx = o->compare ? r->hdr.n_doc_tokens : r->c.C;
    for (int i = 0; i < r->n_q && rc == KF_EXIT_OK; i++) /* every question within the positions */
        if (answer_room(r->cfg, ctx, i, r->qn[i], o->max_tokens) < 0)
            rc = KF_EXIT_USAGE;
    if (rc != KF_EXIT_OK)
        return rc;
    if (!o->quiet)
        fprintf(stderr, "cache: %lld of %lld document tokens (%.2fx smaller), %s, budget %g, %s\n",
                (long long)r->c.C, (long long)r->c.D, (double)r->c.D / (double)r->c.C, kf_method_name(r->hdr.method),
                r->hdr.budget, kf_dtype_name(r->hdr.dtype));
    kf_error e = {0};
    if (kf_engine_from_compacted(&r->ec, r->m, &r->c, r->longest + (int)o->max_tokens, &e) != KF_OK) {
        cli_error(CMD, "%s", e.msg);
        return KF_EXIT_FAIL;
    }
    kf_prompt d = {r->doc, r->n_doc};
    if (o->compare && kf_engine_from_document(&r->ef, r->m, &d, r->longest + (int)o->max_tokens, &e) != KF_OK) {
        cli_error(CMD, "%s: %s", o->doc_path, e.msg);
        return KF_EXIT_FAIL;
    }
    return KF_EXIT_OK;
}

/* Question i's answer (and the full context's, full non-NULL) as text or one JSON line. */
static void print_answer(ask_run *r, int i, const int32_t *out, int n_out, const int32_t *full, int n_full,
                         int same) {
    const char *qtext = r->disp[i];
    char *ans = doc_decode(&r->text, out, n_out);
    char *fans = full ? doc_decode(&r->text, full, n_full) : NULL;
    if (r->o->format == 1) {
        json_t *o = json_pack("{s:s, s:o, s:s, s:o}", "question", qtext ? qtext : "", "question_ids",
                              ids_json(r->qs[i], r->qn[i]), "answer", ans ? ans : "", "answer_ids", ids_json(out, n_out));
        if (full) {
            json_object_set_new(o, "full_answer", json_string(fans ? fans : ""));
            json_object_set_new(o, "full_answer_ids", ids_json(full, n_full));
            json_object_set_new(o, "agree", json_boolean(same));
        }
        char *s = json_dumps(o, JSON_COMPACT);
        puts(s ? s : "{}");
        free(s);
        json_decref(o);
    } else if (full) {
        print_str("question:", qtext);
        print_str("cache:", ans);
        print_str("full:", fans);
        printf("agree:    %s\n", same ? "yes" : "no");
    } else {
        fputs(ans ? ans : "", stdout);
        if (!ans || !*ans || ans[strlen(ans) - 1] != '\n')
            putchar('\n');
    }
    free(ans);
    free(fans);
}

/* Every question answered greedily from the cache (and the full context with --compare), each from
 * the cache alone; the exit status. */
static int ask_answer(ask_run *r) {
    const ask_opts *o = r->o;
    int32_t eos[8];
    const int n_eos = model_eos_ids(r->m, &r->text, eos);
    stop_text st = {&r->text, o->stop};
    kf_error e = {0};
    int agree = 0;
    for (int i = 0; i < r->n_q; i++) {
        kf_prompt q = {r->qs[i], r->qn[i]};
        int n_out = 0, n_full = 0;
        const int room = answer_room(r->cfg, o->compare ? r->hdr.n_doc_tokens : r->c.C, i, r->qn[i], o->max_tokens);
        int32_t *full = r->out + o->max_tokens;
        if (kf_engine_greedy(&r->ec, r->m, &q, room, eos, n_eos, stop_on_text, &st, r->out, &n_out, &e) != KF_OK ||
            (o->compare &&
             kf_engine_greedy(&r->ef, r->m, &q, room, eos, n_eos, stop_on_text, &st, full, &n_full, &e) != KF_OK)) {
            cli_error(CMD, "%s", e.msg);
            return KF_EXIT_FAIL;
        }
        const int same = n_out == n_full && memcmp(r->out, full, sizeof(int32_t) * n_out) == 0;
        agree += same;
        print_answer(r, i, r->out, n_out, o->compare ? full : NULL, n_full, same);
    }
    if (o->compare && o->format != 1)
        printf("agreement: %d/%d greedy answers equal the full context's\n", agree, r->n_q);
    return KF_EXIT_OK;
}

static void ask_free(ask_run *r) {
    kf_engine_free(&r->ec);
    kf_engine_free(&r->ef);
    kf_compacted_free(&r->c);
    for (int i = 0; r->qs && i < r->n_q; i++)
        free(r->qs[i]);
    for (int i = 0; r->disp && i < r->n_q; i++)
        free(r->disp[i]);
    free(r->disp);
    doc_chat_free(&r->dc);
    free(r->qs);
    free(r->qn);
    free(r->doc);
    free(r->out);
    doc_text_free(&r->text);
}

int cmd_ask(int argc, char **argv) {
    ask_opts o = {.max_tokens = 32};
    int first;
    const int prc = cli_opts_parse(&cli_ask_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    if (!o.model_dir)
        return cli_usage_error(CMD, "--model DIR is required");
    if (first >= argc)
        return cli_usage_error(CMD, "give the cache FILE.kvf");
    ask_run r = {.o = &o, .path = argv[first++]};
    const int n_text_q = argc - first;
    r.n_q = n_text_q + (o.qids_s != NULL);
    if (r.n_q == 0)
        return cli_usage_error(CMD, "give a QUESTION (or --question-ids)");
    if (o.compare && !o.doc_path)
        return cli_usage_error(CMD, "--compare needs the document (--doc FILE)");
    kf_backend *b;
    if (!(r.m = cli_load_model(CMD, o.model_dir, &b)))
        return KF_EXIT_FAIL;
    r.cfg = kf_model_config(r.m);
    doc_text_init(&r.text, o.model_dir, r.cfg->vocab_size);
    r.out = malloc(sizeof(int32_t) * (size_t)o.max_tokens * 2);
    r.qs = calloc((size_t)r.n_q, sizeof *r.qs);
    r.qn = calloc((size_t)r.n_q, sizeof *r.qn);
    r.disp = calloc((size_t)r.n_q, sizeof *r.disp);
    int rc;
    if (!r.out || !r.qs || !r.qn || !r.disp) {
        cli_error(CMD, "out of memory");
        rc = KF_EXIT_FAIL;
    } else if ((rc = ask_prepare(&r, argv + first, n_text_q)) == KF_EXIT_OK)
        rc = ask_answer(&r);
    ask_free(&r);
    kf_model_free(r.m);
    b->destroy(b);
    return rc;
}
