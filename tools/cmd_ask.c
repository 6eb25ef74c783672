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
             "prompt). The model's template must be the file's (digest). A chat cache without --chat, or --chat "
             "on a cache made from bare text, is refused (exit 2)"},
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
    if (doc_chat_for_cache(dc, text, h, err, sizeof err)) {
        cli_error(CMD, "%s: %s", path, err);
        return KF_EXIT_FAIL;
    }
    text->chat = dc;
    return KF_EXIT_OK;
}

int cmd_ask(int argc, char **argv) {
    ask_opts o = {.max_tokens = 32};
    int first;
    const int prc = cli_opts_parse(&cli_ask_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    const char *model_dir = o.model_dir, *stop = o.stop, *doc_path = o.doc_path, *qids_s = o.qids_s;
    const long long max_tokens = o.max_tokens;
    const int compare = o.compare, as_json = o.format == 1, quiet = o.quiet, chat = o.chat;
    if (!model_dir)
        return cli_usage_error(CMD, "--model DIR is required");
    if (first >= argc)
        return cli_usage_error(CMD, "give the cache FILE.kvf");
    const char *path = argv[first++];
    const int n_text_q = argc - first, n_q = n_text_q + (qids_s != NULL);
    if (n_q == 0)
        return cli_usage_error(CMD, "give a QUESTION (or --question-ids)");
    if (compare && !doc_path)
        return cli_usage_error(CMD, "--compare needs the document (--doc FILE)");

    kf_backend *b;
    kf_model *m = cli_load_model(CMD, model_dir, &b);
    if (!m)
        return KF_EXIT_FAIL;
    const kf_hfconfig *cfg = kf_model_config(m);
    doc_text text;
    doc_text_init(&text, model_dir, cfg->vocab_size);
    int rc = KF_EXIT_FAIL;
    kf_compacted c = {0};
    kvf_header hdr;
    kf_engine ec = {0}, ef = {0};
    doc_chat dc = {0};
    int32_t *doc = NULL, *out = malloc(sizeof(int32_t) * (size_t)max_tokens * 2);
    int n_doc = 0, agree = 0;
    int32_t **qs = calloc((size_t)n_q, sizeof *qs);
    int *qn = calloc((size_t)n_q, sizeof *qn);
    char **disp = calloc((size_t)n_q, sizeof *disp); /* [n_q] the questions' text */
    char err[1024];
    kf_error e = {0};
    if (!out || !qs || !qn || !disp) {
        cli_error(CMD, "out of memory");
        goto done;
    }
    if (cache_load(CMD, path, m, 0, &c, &hdr) || cache_check_tokenizer(CMD, &text, path, &hdr))
        goto done;
    if ((rc = ask_chat(path, &hdr, chat, &text, &dc)) != KF_EXIT_OK)
        goto done;
    rc = KF_EXIT_FAIL;
    int longest = 0;
    for (int i = 0; i < n_q; i++) {
        const int is_ids = i == n_text_q;
        if (is_ids ? cli_parse_ids(qids_s, &qs[i], &qn[i], err, sizeof err)
                   : doc_tokenize(&text, argv[first + i], strlen(argv[first + i]), 0, &qs[i], &qn[i], err, sizeof err)) {
            if (is_ids) /* a malformed --question-ids ("1,,2") is a usage error */
                rc = cli_usage_error(CMD, "--question-ids: %s", err);
            else
                cli_error(CMD, "question %d: %s", i + 1, err);
            goto done;
        }
        for (int j = 0; j < qn[i]; j++)
            if (qs[i][j] >= cfg->vocab_size) {
                cli_error(CMD, "question %d: token id %d is outside the vocabulary", i + 1, qs[i][j]);
                goto done;
            }
        disp[i] = doc_decode(&text, qs[i], qn[i]); /* the question as asked, without the template */
        int32_t *w = NULL;
        if (chat && doc_chat_question(&dc, qs[i], qn[i], &w, &qn[i])) {
            cli_error(CMD, "out of memory");
            goto done;
        }
        if (chat) {
            free(qs[i]);
            qs[i] = w;
        }
        longest = qn[i] > longest ? qn[i] : longest;
    }
    char digest[KVF_DIGEST_LEN + 1];
    if (doc_path && cache_doc_read(CMD, &text, doc_path, path, &hdr, &doc, &n_doc, digest))
        goto done;
    for (int i = 0; i < n_q; i++) /* every question within the positions before any answer */
        if (answer_room(cfg, compare ? hdr.n_doc_tokens : c.C, i, qn[i], max_tokens) < 0) {
            rc = KF_EXIT_USAGE;
            goto done;
        }
    if (!quiet)
        fprintf(stderr, "cache: %lld of %lld document tokens (%.2fx smaller), %s, budget %g, %s\n", (long long)c.C,
                (long long)c.D, (double)c.D / (double)c.C, kf_method_name(hdr.method), hdr.budget,
                kf_dtype_name(hdr.dtype));
    if (kf_engine_from_compacted(&ec, m, &c, longest + max_tokens, &e) != KF_OK) {
        cli_error(CMD, "%s", e.msg);
        goto done;
    }
    if (compare) {
        kf_prompt d = {doc, n_doc};
        if (kf_engine_from_document(&ef, m, &d, longest + max_tokens, &e) != KF_OK) {
            cli_error(CMD, "%s: %s", doc_path, e.msg);
            goto done;
        }
    }
    int32_t eos[8];
    const int n_eos = model_eos_ids(m, &text, eos);
    stop_text st = {&text, stop};
    rc = KF_EXIT_OK;
    for (int i = 0; i < n_q && rc == KF_OK; i++) {
        kf_prompt q = {qs[i], qn[i]};
        int n_out = 0, n_full = 0;
        const int room = answer_room(cfg, compare ? hdr.n_doc_tokens : c.C, i, qn[i], max_tokens);
        int32_t *full = out + max_tokens;
        if (kf_engine_greedy(&ec, m, &q, room, eos, n_eos, stop_on_text, &st, out, &n_out, &e) != KF_OK ||
            (compare &&
             kf_engine_greedy(&ef, m, &q, room, eos, n_eos, stop_on_text, &st, full, &n_full, &e) != KF_OK)) {
            cli_error(CMD, "%s", e.msg);
            rc = KF_EXIT_FAIL;
            break;
        }
        const int same = n_out == n_full && memcmp(out, full, sizeof(int32_t) * n_out) == 0;
        agree += same;
        const char *qtext = disp[i];
        char *ans = doc_decode(&text, out, n_out);
        char *fans = compare ? doc_decode(&text, full, n_full) : NULL;
        if (as_json) {
            json_t *o = json_pack("{s:s, s:o, s:s, s:o}", "question", qtext ? qtext : "", "question_ids",
                                  ids_json(qs[i], qn[i]), "answer", ans ? ans : "", "answer_ids", ids_json(out, n_out));
            if (compare) {
                json_object_set_new(o, "full_answer", json_string(fans ? fans : ""));
                json_object_set_new(o, "full_answer_ids", ids_json(full, n_full));
                json_object_set_new(o, "agree", json_boolean(same));
            }
            char *s = json_dumps(o, JSON_COMPACT);
            puts(s ? s : "{}");
            free(s);
            json_decref(o);
        } else if (compare) {
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
    if (compare && !as_json && rc == KF_EXIT_OK)
        printf("agreement: %d/%d greedy answers equal the full context's\n", agree, n_q);
done:
    kf_engine_free(&ec);
    kf_engine_free(&ef);
    kf_compacted_free(&c);
    for (int i = 0; qs && i < n_q; i++)
        free(qs[i]);
    for (int i = 0; disp && i < n_q; i++)
        free(disp[i]);
    free(disp);
    doc_chat_free(&dc);
    free(qs);
    free(qn);
    free(doc);
    free(out);
    doc_text_free(&text);
    kf_model_free(m);
    b->destroy(b);
    return rc;
}
