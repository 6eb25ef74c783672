/* kvfold verify — integrity of a kvf cache file and, with the document, how close its answers are. */
#include <getopt.h>
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

static const char kHelp[] =
    "Usage: kvfold verify FILE.kvf --model DIR [--doc FILE [--question TEXT]...]\n"
    "\n"
    "Checks a cache file: its structure, every chunk's checksum, every value (finite K/V and beta,\n"
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
    "Options:\n"
    "  --model DIR          the model\n"
    "  --doc FILE           the document: text, a JSON list of ids, or a manifest line\n"
    "  --question TEXT      a question (repeatable)\n"
    "  --max-tokens N       most tokens of the full context's answer (default 16; fewer where the\n"
    "                       model's positions end: a question that leaves no room after the\n"
    "                       document's D tokens is a usage error, exit 2)\n"
    "  --stop TEXT          the answer ends once it contains TEXT (e.g. $'\\n'); EOS always ends it\n"
    "  --max-kl X           exit 1 when a question's mean KL exceeds X\n"
    "  -h, --help           show this help\n"
    "\n"
    "A file under a content-addressed name (<document digest>.<method>-<budget>.<recipe>.kvf, as\n"
    "kvfold compact writes) must hold what its name says: its header's document digest, method,\n"
    "budget and recipe; a file copied over another's name fails.\n"
    "\n"
    "Exit status: 0 when every check passed, 1 when one failed, 2 for usage errors.\n";

int cmd_verify(int argc, char **argv) {
    static const struct option opts[] = {
        {"help", no_argument, 0, 'h'},           {"model", required_argument, 0, 'm'},
        {"doc", required_argument, 0, 'd'},      {"question", required_argument, 0, 'Q'},
        {"max-tokens", required_argument, 0, 'n'}, {"stop", required_argument, 0, 's'},
        {"max-kl", required_argument, 0, 'k'},   {0, 0, 0, 0}};
    const char *model_dir = NULL, *doc_path = NULL, *stop = NULL;
    const char **questions = calloc((size_t)argc + 1, sizeof *questions);
    int n_q = 0;
    long long max_tokens = 16;
    double max_kl = INFINITY;
    optind = 1;
    for (int c; (c = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (c) {
        case 'h': fputs(kHelp, stdout); free(questions); return KF_EXIT_OK;
        case 'm': model_dir = optarg; break;
        case 'd': doc_path = optarg; break;
        case 'Q': questions[n_q++] = optarg; break;
        case 's': stop = optarg; break;
        case 'n':
            if (cli_parse_int(optarg, 1, 1 << 20, &max_tokens)) {
                free(questions);
                return cli_usage_error(CMD, "--max-tokens must be a positive count, not '%s'", optarg);
            }
            break;
        case 'k': {
            char *end;
            max_kl = strtod(optarg, &end);
            if (end == optarg || *end || !(max_kl >= 0)) {
                free(questions);
                return cli_usage_error(CMD, "--max-kl must be a number >= 0, not '%s'", optarg);
            }
            break;
        }
        default: free(questions); return cli_usage_error(CMD, "unknown option");
        }
    }
    if (!model_dir || optind != argc - 1) {
        free(questions);
        return cli_usage_error(CMD, "give one FILE.kvf and --model DIR");
    }
    if (n_q > 0 && !doc_path) { /* the KL check needs the full context: no silent skip with exit 0 */
        free(questions);
        return cli_usage_error(CMD, "--question needs the document (--doc FILE)");
    }
    const char *path = argv[optind];
    kf_backend *b;
    kf_model *m = cli_load_model(CMD, model_dir, &b);
    if (!m) {
        free(questions);
        return KF_EXIT_FAIL;
    }
    const kf_hfconfig *cfg = kf_model_config(m);
    const int V = cfg->vocab_size;
    doc_text text;
    doc_text_init(&text, model_dir, V);
    int rc = KF_EXIT_FAIL;
    kf_compacted c = {0};
    kvf_header hdr;
    kf_engine ec = {0}, ef = {0};
    doc_chat dc = {0};
    int32_t *doc = NULL, *q = NULL, *ans = NULL, *mine = NULL;
    float *lp = NULL, *lq = NULL;
    int n_doc = 0;
    char err[1024];
    kf_error e = {0};
    /* every checksum, then the model */
    if (cache_load(CMD, path, m, 1, &c, &hdr) || cache_check_tokenizer(CMD, &text, path, &hdr))
        goto done;
    if (hdr.chat_template_digest[0]) { /* a chat cache: its document and questions through its template */
        if (doc_chat_for_cache(&dc, &text, &hdr, err, sizeof err)) {
            cli_error(CMD, "%s: %s", path, err);
            goto done;
        }
        text.chat = &dc;
    }
    printf("%s: checksums ok, model %s ok (%d layers x %d kv heads x %d), %s %s budget %g, C %lld of D %lld\n",
           KF_ESC(path), hdr.model_fingerprint, hdr.n_layers, hdr.kv_heads, hdr.head_dim, kvf_method_name(hdr.method),
           kvf_dtype_name(hdr.dtype), hdr.budget, (long long)hdr.n_tokens, (long long)hdr.n_doc_tokens);
    if (doc_path) {
        char digest[KVF_DIGEST_LEN + 1];
        if (cache_doc_read(CMD, &text, doc_path, path, &hdr, &doc, &n_doc, digest))
            goto done;
        printf("document: %s matches (digest %s, %d tokens)\n", KF_ESC(doc_path), digest, n_doc);
    }
    rc = KF_EXIT_OK;
    if (n_q == 0)
        goto done;
    int32_t eos[8];
    const int n_eos = model_eos_ids(m, &text, eos);
    stop_text st = {&text, stop};
    ans = malloc(sizeof(int32_t) * (size_t)max_tokens);
    mine = malloc(sizeof(int32_t) * (size_t)max_tokens);
    lp = malloc(sizeof(float) * (size_t)max_tokens * V);
    lq = malloc(sizeof(float) * (size_t)max_tokens * V);
    kf_prompt d = {doc, n_doc};
    if (!ans || !mine || !lp || !lq || kf_engine_from_compacted(&ec, m, &c, 4096 + max_tokens, &e) != KF_OK ||
        kf_engine_from_document(&ef, m, &d, 4096 + max_tokens, &e) != KF_OK) {
        cli_error(CMD, "%s", e.msg[0] ? e.msg : "out of memory");
        rc = KF_EXIT_FAIL;
        goto done;
    }
    for (int i = 0; i < n_q; i++) {
        int nq = 0, n_ans = 0, n_mine = 0;
        free(q);
        q = NULL;
        if (doc_tokenize(&text, questions[i], strlen(questions[i]), 0, &q, &nq, err, sizeof err)) {
            cli_error(CMD, "question %d: %s", i + 1, err);
            rc = KF_EXIT_FAIL;
            break;
        }
        int32_t *w = NULL;
        if (text.chat && doc_chat_question(&dc, q, nq, &w, &nq)) {
            cli_error(CMD, "out of memory");
            rc = KF_EXIT_FAIL;
            break;
        }
        if (text.chat) {
            free(q);
            q = w;
        }
        /* the full context puts the question at D: it and one answer token must fit the positions */
        const int64_t max_pos = cfg->max_position_embeddings, room = max_pos - n_doc - nq;
        if (max_pos > 0 && room < 1) {
            rc = cli_usage_error(CMD, "question %d: %d document tokens + %d question tokens leave no room within the "
                                      "model's %lld positions (max_position_embeddings)",
                                 i + 1, n_doc, nq, (long long)max_pos);
            break;
        }
        if (nq > 4096) { /* the engines' room */
            cli_error(CMD, "question %d: longer than 4096 tokens", i + 1);
            rc = KF_EXIT_FAIL;
            break;
        }
        const int n_gen = max_pos > 0 && room < max_tokens ? (int)room : (int)max_tokens;
        kf_prompt qp = {q, nq};
        if (kf_engine_greedy(&ef, m, &qp, n_gen, eos, n_eos, stop_on_text, &st, ans, &n_ans, &e) != KF_OK ||
            kf_engine_greedy(&ec, m, &qp, n_gen, eos, n_eos, stop_on_text, &st, mine, &n_mine, &e) != KF_OK) {
            cli_error(CMD, "%s", e.msg);
            rc = KF_EXIT_FAIL;
            break;
        }
        double kl = 0, kl1 = 0;
        if (n_ans > 0) {
            kf_prompt ap = {ans, n_ans};
            if (kf_engine_logprobs(&ef, m, &qp, &ap, lp, &e) != KF_OK || kf_engine_logprobs(&ec, m, &qp, &ap, lq, &e) != KF_OK) {
                cli_error(CMD, "%s", e.msg);
                rc = KF_EXIT_FAIL;
                break;
            }
            kl = kf_mean_kl(lp, lq, n_ans, V);
            kl1 = kf_mean_kl(lp, lq, 1, V);
        }
        const int same = n_ans == n_mine && memcmp(ans, mine, sizeof(int32_t) * n_ans) == 0;
        char *a = doc_decode(&text, ans, n_ans);
        printf("question %d: KL(full || cache) %.5f mean over %d answer tokens, %.5f first token; full answer %s%s%s, "
               "cache's greedy answer %s\n",
               i + 1, kl, n_ans, kl1, a ? "\"" : "", a ? a : "(not decodable)", a ? "\"" : "",
               same ? "the same" : "differs");
        free(a);
        if (kl > max_kl) {
            cli_error(CMD, "question %d: KL %.5f exceeds --max-kl %g", i + 1, kl, max_kl);
            rc = KF_EXIT_FAIL;
        }
    }
done:
    kf_engine_free(&ec);
    kf_engine_free(&ef);
    kf_compacted_free(&c);
    free(doc);
    free(q);
    free(ans);
    free(mine);
    free(lp);
    free(lq);
    free(questions);
    doc_chat_free(&dc);
    doc_text_free(&text);
    kf_model_free(m);
    b->destroy(b);
    return rc;
}
