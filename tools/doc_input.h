/* doc_input.h — documents, prompts and probes as the job and ask/verify read them: text (through
 * the model's tokenizer.json, opened on first use) or token ids (JSON arrays or manifest lines). */
#ifndef KF_DOC_INPUT_H
#define KF_DOC_INPUT_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "compactor/compact.h"
#include "formats/kvf.h"
#include "formats/tokenizer.h"

struct doc_chat;

typedef struct {
    const char *model_dir;
    struct doc_chat *chat;           /* NULL, or documents are the first user turn of this chat
                                        template (tools/doc_chat.h): text through it, ids after
                                        its prefix */
    kf_tokenizer *tok;               /* opened on first use */
    int vocab;                       /* ids must be below this (the model's vocabulary) */
    char digest[KVF_DIGEST_LEN + 1]; /* XXH3-128 of tokenizer.json, once it has been used */
} doc_text;

void doc_text_init(doc_text *t, const char *model_dir, int vocab);
void doc_text_free(doc_text *t);

/* Text to ids (special: the tokenizer's template, e.g. a BOS, as for a document; with t->chat, a
 * document through the chat template instead). 0 or -1 with a message in err. */
int doc_tokenize(doc_text *t, const char *text, size_t len, int special, int32_t **ids, int *n, char *err,
                 size_t err_len);
/* A JSON array of ids (each checked against the vocabulary) or a string (tokenized without special
 * tokens). Empty is an error. */
int doc_json_prompt(doc_text *t, json_t *v, int32_t **ids, int *n, char *err, size_t err_len);

/* A document from a text file (kvfold compact FILE...): UTF-8 text tokenized with special tokens,
 * whatever it looks like (a text that parses as JSON is still text). */
int doc_read_text(doc_text *t, const char *path, int32_t **ids, int *n, char *err, size_t err_len);
/* A document from a file: a JSON array of ids, a JSON object with "ids" or "text" (a manifest
 * line), or else plain UTF-8 text (tokenized with special tokens). */
int doc_read_file(doc_text *t, const char *path, int32_t **ids, int *n, char *err, size_t err_len);

/* Ids read as a document's: with t->chat, replaced by the chat prefix + ids. 0, or -1 (err). */
int doc_as_document(doc_text *t, int32_t **ids, int *n, char *err, size_t err_len);

/* The digest of the model's tokenizer.json (opening it): "" when it has none. */
const char *doc_text_digest(doc_text *t);

/* Decoded text of ids (malloc'ed), or NULL when the tokenizer is missing. */
char *doc_decode(doc_text *t, const int32_t *ids, int n);

/* Opens a kvf file for model m: structure, its name against its header (kvf_check_name), every
 * checksum when verify, the model's fingerprint and
 * shape; then reads it whole into c. Prints the cause and returns -1 on failure. */
int cache_load(const char *cmd, const char *path, kf_model *m, int verify, kf_compacted *c, kvf_header *hdr);

/* The file's tokenizer against the model's (tokenizer.json's digest): -1 (printed, naming both
 * digests) when they differ; a file or model without one is not checked. */
int cache_check_tokenizer(const char *cmd, doc_text *t, const char *cache_path, const kvf_header *hdr);

/* The document the cache at cache_path (header hdr) was built from, read from doc_path
 * (doc_read_file) into ids [n]; its digest into digest. Prints the cause and returns -1 when the file
 * cannot be read or holds another document (digest or length). */
int cache_doc_read(const char *cmd, doc_text *t, const char *doc_path, const char *cache_path, const kvf_header *hdr,
                   int32_t **ids, int *n, char digest[KVF_DIGEST_LEN + 1]);

/* Decoding stops once the decoded text contains stop (when not NULL). */
typedef struct {
    doc_text *text;
    const char *stop;
} stop_text;
int stop_on_text(void *ctx, const int32_t *ids, int n);

/* EOS ids of the model (config.json and tokenizer_config.json); returns the count (<= 8). */
int model_eos_ids(kf_model *m, doc_text *t, int32_t *out);

#endif
