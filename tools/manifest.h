/* manifest.h — one line of a `kvfold compact --manifest` file (JSONL) into a document.
 *
 * A line is a JSON object with "ids" (token ids) or "text" (tokenized with the model's template,
 * e.g. a BOS), and optionally "id" (a string or an integer: a name for messages), "probes" (a list of
 * prompts, each a text or a list of ids) and "repeat_instruction_ids" or "repeat_instruction".
 * Every id is checked against the vocabulary; empty documents and prompts are refused.
 */
#ifndef KF_MANIFEST_H
#define KF_MANIFEST_H

#include <stddef.h>
#include <stdint.h>

#include "compactor/compact.h"
#include "tools/doc_input.h"

typedef struct {
    char name[128];    /* "id", or "" */
    int32_t *ids;      /* [n], n >= 1 */
    int n;
    int32_t *instr;    /* [n_instr] the line's repeat instruction, or NULL */
    int n_instr;
    kf_prompt *probes; /* [n_probes], each with its own malloc'ed ids (n >= 1), or NULL */
    int n_probes;
} manifest_doc;

/* Parses one line (NUL-terminated) into d. 0, or -1 with the reason in err; on failure d holds only
 * the name (when the line had one) and nothing to free. */
int manifest_parse_line(doc_text *t, const char *line, manifest_doc *d, char *err, size_t err_len);
void manifest_doc_free(manifest_doc *d);

#endif
