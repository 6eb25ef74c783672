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
#include <stdio.h>

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

/* One line of a manifest (or of --probes-from) read whole, or refused without losing the lines
 * after it: a line that is too long, holds a NUL byte or cannot be allocated is read to its end
 * and reported as such, and the next call reads the next line. */
enum { LINE_OK, LINE_EOF, LINE_TOO_LONG, LINE_NUL, LINE_NOMEM };
#define MANIFEST_MAX_LINE_DEFAULT (64LL << 20) /* bytes: a document of millions of tokens */
/* Reads the next line (without its '\n') into *buf [*cap] (grown as needed, up to max + 1 bytes),
 * NUL-terminated, its length in *len (for LINE_NUL: the offset of the NUL; for LINE_TOO_LONG and
 * LINE_NOMEM: the bytes seen). LINE_EOF at the end of the input or on a read error (ferror). */
int manifest_read_line(FILE *f, size_t max, char **buf, size_t *cap, size_t *len);
/* "longer than N bytes", "holds a NUL byte at byte N", "out of memory for a line of N bytes". */
void manifest_line_error(int why, size_t len, size_t max, char *err, size_t err_len);

/* Parses one line (NUL-terminated) into d. 0, or -1 with the reason in err; on failure d holds only
 * the name (when the line had one) and nothing to free. */
int manifest_parse_line(doc_text *t, const char *line, manifest_doc *d, char *err, size_t err_len);
void manifest_doc_free(manifest_doc *d);

#endif
