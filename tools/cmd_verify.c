/* kvfold verify — integrity of a kvf cache file and, with the document, how close its answers are. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/engine.h"
#include "formats/escape.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/doc_chat.h"
#include "tools/doc_input.h"

#define CMD "verify"

typedef struct {
    const char *model_dir, *doc_path, *stop;
    const char **questions; /* [n_q] (room for every argument) */
    int n_q;
    long long max_tokens;
    double max_kl;
} verify_opts;

/* --question, repeatable */
static int add_question(void *ctx, const cli_opt *o, const char *arg, char *err, size_t n) {
    (void)o, (void)err, (void)n;
    verify_opts *v = ctx;
    v->questions[v->n_q++] = arg;
    return 0;
}

#define V(field) OFF(verify_opts, field)
static const cli_opt kRows[] = {
    {"model", 0, OPT_STR, "DIR", V(model_dir), .help = "the model"},
    {"doc", 0, OPT_STR, "FILE", V(doc_path), .help = "the document: text, a JSON list of ids, or a manifest line"},
    {"question", 0, OPT_FN, "TEXT", 0, .set = add_question, .help = "a question (repeatable)"},
    {"max-tokens", 0, OPT_LLONG, "N", V(max_tokens), .lo = 1, .hi = 1 << 20, .must = "must be a positive count",
     .def = "16",
     .help = "most tokens of the full context's answer (fewer where the model's positions end: a question "
             "that leaves no room after the document's D tokens is a usage error, exit 2)"},
    {"stop", 0, OPT_STR, "TEXT", V(stop), .help = "the answer ends once it contains TEXT (e.g. $'\\n'); EOS always ends it"},
    {"max-kl", 0, OPT_REAL, "X", V(max_kl), .lo = 0, .hi = INFINITY, .must = "must be a number >= 0",
     .help = "exit 1 when a question's mean KL exceeds X"},
    {0}};

const cli_command cli_verify_command = {
    .name = CMD,
    .usage = "kvfold verify FILE.kvf --model DIR [--doc FILE [--question TEXT]...]\n",
    .about = "Checks a cache file: its structure, every chunk's checksum, every value (finite K/V and beta,\n"
             "positions in [0, D)) and every layer's digest, and that it was written for\n"
             "this model (fingerprint of config, tensor index and weights; layers, KV heads, head_dim).\n"
             "With --doc, also that the file is the cache of that document (digest and length).\n"
             "The file's tokenizer (tokenizer_digest) must be the model's tokenizer.json. A cache made with\n"
             "--chat (kvfold compact) is checked as it was made: the model's chat template must be the file's,\n"
             "--doc is read through it and each --question is a user turn's content (kvfold ask --chat).\n"
             "With --doc and --question, the answer distributions: the full document's greedy answer is\n"
             "teacher-forced on both the full context and the cache, and the mean KL(full || cache) over its\n"
             "tokens is reported (also for the first token alone), with whether the cache's own greedy\n"
             "answer is the same. A --question without --doc is a usage error.\n"
             "\n"
             "A file under a content-addressed name (<document digest>.<method>-<budget>.<recipe>.kvf, as\n"
             "kvfold compact writes) must hold what its name says: its header's document digest, method,\n"
             "budget and recipe; a file copied over another's name fails.\n",
    .groups = (const cli_group[]){{NULL, kRows, 0}, {0}},
    .exit_status = "  0  every check passed\n"
                   "  1  a check failed (the message names it)\n"
                   "  2  usage errors\n",
    .example = "  kvfold verify doc.kvf --model records-qwen3 --doc doc.txt --question $'Q: Alice?\\nA:' --max-kl 0.5\n",
};

/* What the questions are answered with: the model, both engines, the stop rule, the buffers
 * ans, mine [max_tokens] and lp, lq [max_tokens, V]. */
typedef struct {
    kf_model *m;
    doc_text *text;
    kf_engine *ec, *ef; /* the cache's, the full document's */
    const int32_t *eos;
    int n_eos;
    stop_text *st;
    int32_t *ans, *mine;
    float *lp, *lq;
    int n_doc;
    long long max_tokens;
    double max_kl;
} verify_engines;

/* One question: the full context's greedy answer teacher-forced on both, its KL reported. The exit
 * status it leaves (KF_EXIT_OK, or 1 / 2 reported); *stop when the other questions are not run. */
static int verify_question(const verify_engines *r, int i, const char *question, int *stop) {
    const kf_hfconfig *cfg = kf_model_config(r->m);
    const int V = cfg->vocab_size;
    int32_t *q = NULL;
    int nq = 0, n_ans = 0, n_mine = 0, rc = KF_EXIT_FAIL;
    char err[1024];
    kf_error e = {0};
    *stop = 1;
    if (doc_tokenize(r->text, question, strlen(question), 0, &q, &nq, err, sizeof err)) {
        cli_error(CMD, "question %d: %s", i + 1, err);
        return KF_EXIT_FAIL;
    }
    int32_t *w = NULL;
    if (r->text->chat) { /* a chat cache's question is a user turn's content */
        if (doc_chat_question(r->text->chat, q, nq, &w, &nq)) {
            cli_error(CMD, "out of memory");
            goto out;
        }
        free(q);
        q = w;
    }
    /* the full context puts the question at D: it and one answer token must fit the positions */
    const int64_t max_pos = cfg->max_position_embeddings, room = max_pos - r->n_doc - nq;
    if (max_pos > 0 && room < 1) {
        rc = cli_usage_error(CMD, "question %d: %d document tokens + %d question tokens leave no room within the "
                                  "model's %lld positions (max_position_embeddings)",
                             i + 1, r->n_doc, nq, (long long)max_pos);
        goto out;
    }
    if (nq > 4096) { /* the engines' room */
        cli_error(CMD, "question %d: longer than 4096 tokens", i + 1);
        goto out;
    }
    const int n_gen = max_pos > 0 && room < r->max_tokens ? (int)room : (int)r->max_tokens;
    kf_prompt qp = {q, nq};
    if (kf_engine_greedy(r->ef, r->m, &qp, n_gen, r->eos, r->n_eos, stop_on_text, r->st, r->ans, &n_ans, &e) != KF_OK ||
        kf_engine_greedy(r->ec, r->m, &qp, n_gen, r->eos, r->n_eos, stop_on_text, r->st, r->mine, &n_mine, &e) != KF_OK) {
        cli_error(CMD, "%s", e.msg);
        goto out;
    }
    double kl = 0, kl1 = 0;
    if (n_ans > 0) {
        kf_prompt ap = {r->ans, n_ans};
        if (kf_engine_logprobs(r->ef, r->m, &qp, &ap, r->lp, &e) != KF_OK ||
            kf_engine_logprobs(r->ec, r->m, &qp, &ap, r->lq, &e) != KF_OK) {
            cli_error(CMD, "%s", e.msg);
            goto out;
        }
        kl = kf_mean_kl(r->lp, r->lq, n_ans, V);
        kl1 = kf_mean_kl(r->lp, r->lq, 1, V);
    }
    const int same = n_ans == n_mine && memcmp(r->ans, r->mine, sizeof(int32_t) * n_ans) == 0;
    char *a = doc_decode(r->text, r->ans, n_ans);
    printf("question %d: KL(full || cache) %.5f mean over %d answer tokens, %.5f first token; full answer %s%s%s, "
           "cache's greedy answer %s\n",
           i + 1, kl, n_ans, kl1, a ? "\"" : "", a ? a : "(not decodable)", a ? "\"" : "",
           same ? "the same" : "differs");
    free(a);
    *stop = 0;
    rc = KF_EXIT_OK;
    if (kl > r->max_kl) {
        cli_error(CMD, "question %d: KL %.5f exceeds --max-kl %g", i + 1, kl, r->max_kl);
        rc = KF_EXIT_FAIL;
    }
out:
    free(q);
    return rc;
}

/* The file being verified: its cache, header, chat record and document. */
typedef struct {
    const char *path;
    kf_model *m;
    doc_text text;
    doc_chat dc;
    kf_compacted c;
    kvf_header hdr;
    int32_t *doc; /* [n_doc] the document's ids (--doc) */
    int n_doc;
} verify_file;

/* Every checksum, then the model and tokenizer, then the document (--doc), each reported; the exit
 * status. */
static int verify_cache(verify_file *f, const char *doc_path) {
    char err[1024];
    if (cache_load(CMD, f->path, f->m, 1, &f->c, &f->hdr) || cache_check_tokenizer(CMD, &f->text, f->path, &f->hdr))
        return KF_EXIT_FAIL;
    const kvf_header *h = &f->hdr;
    if (h->chat_template_digest[0]) { /* a chat cache: its document and questions through its template */
        if (doc_chat_for_cache(&f->dc, &f->text, h, err, sizeof err)) {
            cli_error(CMD, "%s: %s", f->path, err);
            return KF_EXIT_FAIL;
        }
        f->text.chat = &f->dc;
    }
    printf("%s: checksums ok, model %s ok (%d layers x %d kv heads x %d), %s %s budget %g, C %lld of D %lld\n",
           KF_ESC(f->path), h->model_fingerprint, h->n_layers, h->kv_heads, h->head_dim, kf_method_name(h->method),
           kf_dtype_name(h->dtype), h->budget, (long long)h->n_tokens, (long long)h->n_doc_tokens);
    if (doc_path) {
        char digest[KVF_DIGEST_LEN + 1];
        if (cache_doc_read(CMD, &f->text, doc_path, f->path, h, &f->doc, &f->n_doc, digest))
            return KF_EXIT_FAIL;
        printf("document: %s matches (digest %s, %d tokens)\n", KF_ESC(doc_path), digest, f->n_doc);
    }
    return KF_EXIT_OK;
}

/* Each --question on the cache and on the full document; the exit status. */
static int verify_questions(verify_file *f, const verify_opts *o) {
    const int V = kf_model_config(f->m)->vocab_size;
    const long long max_tokens = o->max_tokens;
    int32_t eos[8];
    const int n_eos = model_eos_ids(f->m, &f->text, eos);
    stop_text st = {&f->text, o->stop};
    kf_engine ec = {0}, ef = {0};
    kf_error e = {0};
    int32_t *ans = malloc(sizeof(int32_t) * (size_t)max_tokens), *mine = malloc(sizeof(int32_t) * (size_t)max_tokens);
    float *lp = malloc(sizeof(float) * (size_t)max_tokens * V), *lq = malloc(sizeof(float) * (size_t)max_tokens * V);
    kf_prompt d = {f->doc, f->n_doc};
    int rc = KF_EXIT_OK;
    if (!ans || !mine || !lp || !lq || kf_engine_from_compacted(&ec, f->m, &f->c, 4096 + max_tokens, &e) != KF_OK ||
        kf_engine_from_document(&ef, f->m, &d, 4096 + max_tokens, &e) != KF_OK) {
        cli_error(CMD, "%s", e.msg[0] ? e.msg : "out of memory");
        rc = KF_EXIT_FAIL;
    } else {
        const verify_engines r = {f->m, &f->text, &ec, &ef, eos, n_eos, &st, ans, mine, lp, lq, f->n_doc,
                                  max_tokens, o->max_kl};
        for (int i = 0; i < o->n_q; i++) {
            int stop_now = 0;
            const int qrc = verify_question(&r, i, o->questions[i], &stop_now);
            rc = qrc != KF_EXIT_OK ? qrc : rc;
            if (stop_now)
                break;
        }
    }
    kf_engine_free(&ec);
    kf_engine_free(&ef);
    free(ans), free(mine), free(lp), free(lq);
    return rc;
}

int cmd_verify(int argc, char **argv) {
    verify_opts o = {.questions = calloc((size_t)argc + 1, sizeof(const char *)), .max_tokens = 16,
                     .max_kl = INFINITY};
    if (!o.questions) {
        cli_error(CMD, "out of memory");
        return KF_EXIT_FAIL;
    }
    int first;
    int rc = cli_opts_parse(&cli_verify_command, argc, argv, &o, &first);
    if (rc == CLI_CONTINUE && (!o.model_dir || first != argc - 1))
        rc = cli_usage_error(CMD, "give one FILE.kvf and --model DIR");
    else if (rc == CLI_CONTINUE && o.n_q > 0 && !o.doc_path) /* the KL check needs the full context */
        rc = cli_usage_error(CMD, "--question needs the document (--doc FILE)");
    kf_backend *b;
    verify_file f = {.path = rc == CLI_CONTINUE ? argv[first] : NULL};
    if (rc == CLI_CONTINUE && !(f.m = cli_load_model(CMD, o.model_dir, &b)))
        rc = KF_EXIT_FAIL;
    if (rc != CLI_CONTINUE) {
        free(o.questions);
        return rc;
    }
    doc_text_init(&f.text, o.model_dir, kf_model_config(f.m)->vocab_size);
    rc = verify_cache(&f, o.doc_path);
    if (rc == KF_EXIT_OK && o.n_q > 0)
        rc = verify_questions(&f, &o);
    kf_compacted_free(&f.c);
    free(f.doc);
    free(o.questions);
    doc_chat_free(&f.dc);
    doc_text_free(&f.text);
    kf_model_free(f.m);
    b->destroy(b);
    return rc;
}
