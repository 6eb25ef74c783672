/* compact_files.h — the files of `kvfold compact`'s documents: the documents as read, the file of
 * each (method, budget) variant (its recipe, path and identity), whether a valid one is already
 * there, the claim that lets several workers share a root (an flock on <file>.lock), and the write.
 * Messages go to stderr for the command; the plan and the compaction stay in tools/cmd_compact.c. */
#ifndef KF_TOOLS_COMPACT_FILES_H
#define KF_TOOLS_COMPACT_FILES_H

#include <limits.h>
#include <stdint.h>

#include "compactor/compact.h"
#include "formats/kvf.h"

enum { ST_TODO, ST_SKIPPED, ST_BUSY, ST_DONE, ST_FAILED };
#define MAX_VARIANTS 16

/* One output file of a document: one (method, budget) variant. */
typedef struct {
    char path[PATH_MAX];
    char recipe[KVF_DIGEST_LEN + 1]; /* kf_recipe_digest of this file's parameters */
    int state;                       /* ST_TODO (to compute; claimed in the compact pass), ST_SKIPPED, ... */
    int fd;                          /* the lock while claimed */
    int replaced;                    /* a file was there that could not stand for this one */
    int64_t C;
} job_file;

typedef struct {
    char source[PATH_MAX + 32]; /* "docs.jsonl:12" or the text file's path */
    char name[128];             /* "id" or the file name */
    char digest[KVF_DIGEST_LEN + 1]; /* kvf_document_digest of ids, from the identity pass */
    int32_t *ids;               /* [n] */
    int n;
    int32_t *instr;             /* [n_instr] this document's repeat instruction, or NULL: the default */
    int n_instr;
    kf_prompt *probes;          /* [n_probes] (ids owned) */
    int n_probes;
    job_file *files;            /* [n_variants], or NULL before the identity pass */
    int state;
} job_doc;


typedef struct {
    job_doc *docs;
    int n, cap;
    int n_failed_input; /* lines or files that never became documents */
} doc_list;

/* What names a document's files and goes into their headers. */
typedef struct {
    const char *root, *fp; /* cache root, model fingerprint */
    kf_dtype dtype;
    int64_t n_head_budgets;
} file_ids;

/* On a terminal the progress line is redrawn in place: compact_clear_line clears it first. */
extern int compact_tty;

/* Frees what d owns (its ids, instruction, probes and files). */
void job_doc_free(job_doc *d);

/* A zeroed document appended to l, or NULL when out of memory. */
job_doc *doc_list_add(doc_list *l);

/* Clears the terminal's progress line (nothing off a terminal). */
void compact_clear_line(void);

/* A document's message; its source, name and message (paths, ids) escaped. */
void doc_fail(const char *source, const char *name, const char *msg);

/* Each variant's recipe and path, and whether a valid file is already there; 0 when some file is
 * to compute, 1 when none is (d skipped), -1 when a path cannot be made (d failed, reported). */
int doc_files(job_doc *d, const kf_compact_params *dp, const kf_compact_variant *vars, int n_vars,
              const file_ids *ids);

/* Whether some file of d is in state (ST_*). */
int any_file(const job_doc *d, int n_vars, int state);

/* Claims every file still to compute: those another worker holds become ST_BUSY, those now valid
 * ST_SKIPPED; the number claimed (left ST_TODO with their lock), or -1 with err when a lock file
 * cannot be created (nothing left claimed). */
int claim_files(job_doc *d, const kf_compact_variant *vars, int n_vars, const file_ids *ids, char *err,
                size_t err_len);

struct doc_chat;
/* Writes the claimed files' caches cc (in variant order; st: their compaction's status), frees
 * them and releases every claim; the first failure. chat: NULL, or the template (tools/doc_chat.h)
 * whose record goes into every header. */
kf_status write_files(job_doc *d, int n_vars, kf_compacted *cc, kf_status st, const file_ids *ids,
                      const char *tokenizer_digest, const struct doc_chat *chat, kf_error *e);

/* The output root created if missing and checked writable before any work; 0, or -1 (reported). */
int compact_check_root(const char *root);

/* Removes killed writers' temporary files under dir (the model's directory of the root), each
 * reported unless quiet; a failure is a warning. */
void compact_clean_stale_temps(const char *dir, int quiet);

/* --method and --budget lists: every (method, budget) pair into v [MAX_VARIANTS], methods outer;
 * their count, or -1 (reported as a usage error). */
int compact_parse_variants(const char *methods_s, const char *budgets_s, kf_compact_variant *v);

#endif
