/* doc_chat.h — a document, its repeat instruction and its questions through the model's chat
 * template (formats/chat.h): the pieces of token ids a chat cache is made of and served with.
 *
 * The document is the content of the first user turn; the repeat instruction the content of a
 * second user turn, after which the repeat is the assistant's turn (Attention Matching's chat
 * repeat prompt); a probe or question is the content of a second user turn followed by the
 * generation prompt. The pieces come from rendering conversations whose contents are sentinels
 * and cutting the text at them:
 *
 *   [user: DOC, user: Q] + generation prompt  = A  DOC  H  Q  T
 *   [user: DOC, user: I, assistant: R]        = A  DOC  B1 I  B2 R  ...
 *
 * prefix = ids(A), question = ids(H) + ids(Q's text) + ids(T), instruction = ids(B1) + ids(I) +
 * ids(B2). The document's own text is what the template makes of it: the conversation is rendered
 * again with the real document, which must come out as A X H Q T; X (the document as the template
 * writes it, e.g. trimmed) is tokenized.
 *
 * Boundary tokenization: each piece is tokenized on its own, without the tokenizer's template (no
 * BOS added: the chat template writes its own). Hugging Face tokenizes the whole rendered string
 * at once; the two agree wherever a cut lies next to an added token (<|im_start|>, <|eot_id|>) or
 * where the pre-tokenizer splits anyway. They can differ where a cut falls inside a run the
 * pre-tokenizer would keep together, e.g. a document that begins with whitespace after the
 * header's "\n" (Qwen's "\s*[\r\n]+" joins "\n\n" into one pre-token, the pieces give two). The
 * cache holds exactly the ids recorded in the file, whatever a whole-string tokenization gives.
 */
#ifndef KF_DOC_CHAT_H
#define KF_DOC_CHAT_H

#include <stdint.h>

#include "formats/chat.h"
#include "formats/kvf.h"
#include "tools/doc_input.h"

typedef struct doc_chat {
    kf_chat *chat;
    char digest[KVF_DIGEST_LEN + 1]; /* the template's */
    char *a, *h, *t, *b1, *b2;       /* the template's text pieces (above) */
    int32_t *prefix, *qhead, *qtail, *ihead, *itail; /* their ids */
    int n_prefix, n_qhead, n_qtail, n_ihead, n_itail;
} doc_chat;

/* The template of t's model directory, cut into its pieces and tokenized with t. A model without
 * a chat template fails with DOC_CHAT_NO_TEMPLATE (the caller's usage error), one whose renders do
 * not cut as above with -1; the cause in err. */
#define DOC_CHAT_NO_TEMPLATE (-2)
int doc_chat_open(doc_chat *c, doc_text *t, char *err, size_t err_len);
void doc_chat_free(doc_chat *c);

/* The document's text (the first user turn's content) to the ids of the cache's context:
 * prefix + ids(X). */
int doc_chat_document(doc_chat *c, doc_text *t, const char *text, size_t len, int32_t **ids, int *n, char *err,
                      size_t err_len);
/* ids given as a document's (a manifest's "ids"): prefix + ids, into a new array. */
int doc_chat_document_ids(const doc_chat *c, const int32_t *ids, int n, int32_t **out, int *n_out);
/* A user turn's content after the document, as ids: question (probe) or repeat instruction. */
int doc_chat_question(const doc_chat *c, const int32_t *ids, int n, int32_t **out, int *n_out);
int doc_chat_instruction(const doc_chat *c, const int32_t *ids, int n, int32_t **out, int *n_out);

/* The model's template for serving the chat cache whose header is h: its digest must be the
 * file's (else -1, err naming both); the question's pieces are then the file's record. A model
 * without a template is DOC_CHAT_NO_TEMPLATE, as from doc_chat_open. */
int doc_chat_for_cache(doc_chat *c, doc_text *t, const kvf_header *h, char *err, size_t err_len);

/* The chat record of a file (formats/kvf.h) from c. */
void doc_chat_record(const doc_chat *c, kvf_header *h);

/* ids joined by commas into out [cap]; -1 when they do not fit. */
int doc_ids_join(const int32_t *ids, int n, char *out, size_t cap);

#endif
