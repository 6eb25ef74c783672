/* tokenizer_internal.h — the pieces of formats/tokenizer*.c that talk to each other.
 * Not a public header: include formats/tokenizer.h instead.
 */
#ifndef KF_TOKENIZER_INTERNAL_H
#define KF_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/base/error.h"
#include "tokenizer.h"

/* ---- tokenizer_hash.c: a byte-string -> int32 map and a (int32, int32) -> (rank, id) map ---- */

typedef struct {
    uint64_t hash;
    uint32_t off; /* key bytes at pool[off] */
    uint32_t len;
    int32_t value;
    int32_t used;
} kf_bmap_slot;

typedef struct {
    kf_bmap_slot *slots; /* [cap], cap a power of two */
    size_t cap;
    size_t n;
    char *pool; /* [pool_len] key bytes */
    size_t pool_len, pool_cap;
} kf_bmap;

void kf_bmap_free(kf_bmap *m);
void kf_bmap_clear(kf_bmap *m);
/* Inserts or overwrites; returns false when out of memory. */
bool kf_bmap_put(kf_bmap *m, const void *key, size_t len, int32_t value);
/* Returns true and sets *value when found. */
bool kf_bmap_get(const kf_bmap *m, const void *key, size_t len, int32_t *value);

typedef struct {
    uint64_t key; /* left << 32 | right; UINT64_MAX = empty */
    int32_t rank;
    int32_t id; /* the merged token */
} kf_pmap_slot;

typedef struct {
    kf_pmap_slot *slots; /* [cap] */
    size_t cap;
    size_t n;
} kf_pmap;

void kf_pmap_free(kf_pmap *m);
bool kf_pmap_reserve(kf_pmap *m, size_t n);
/* Keeps the first insertion of a pair (the lower rank). */
void kf_pmap_put(kf_pmap *m, int32_t left, int32_t right, int32_t rank, int32_t id);
const kf_pmap_slot *kf_pmap_get(const kf_pmap *m, int32_t left, int32_t right);

uint64_t kf_hash_bytes(const void *p, size_t len);

/* ---- tokenizer_bpe.c: the BPE model ---- */

typedef struct {
    int32_t pos;   /* byte offset of the symbol in the word */
    int32_t len;   /* 0 once merged into its left neighbour */
    int32_t id;
    int32_t prev, next; /* symbol indices, -1 at the ends */
} kf_bpe_sym;

typedef struct {
    int32_t rank;
    int32_t left; /* symbol index */
    int32_t left_id, right_id;
} kf_bpe_cand;

typedef struct {
    kf_bmap vocab;         /* token bytes -> id (model vocabulary only) */
    kf_pmap merges;        /* (left id, right id) -> rank, merged id */
    int32_t byte_id[256];  /* id of each single byte, -1 when absent */
    int32_t unk_id;        /* -1 when none */
    bool ignore_merges;

    /* Scratch for one word. */
    kf_bpe_sym *syms;   /* [syms_cap] */
    size_t syms_cap;
    kf_bpe_cand *heap;  /* [heap_cap] */
    size_t heap_cap;

    /* Cache: pre-token bytes -> slice of cache_ids. */
    kf_bmap cache;          /* value = index into cache_refs */
    int32_t *cache_ids;     /* [cache_ids_len] */
    size_t cache_ids_len, cache_ids_cap;
    uint32_t *cache_refs;   /* [2 * n] start, count */
    size_t cache_refs_len, cache_refs_cap;
} kf_bpe;

void kf_bpe_free(kf_bpe *bpe);
/* Appends the ids of one pre-token (raw bytes). */
kf_status kf_bpe_encode_word(kf_bpe *bpe, const char *word, size_t len, kf_token_ids *out,
                             kf_error *err);

/* ---- tokenizer_pretok.c: normalizers and pre-tokenizers ---- */

typedef enum { KF_NORM_NFC, KF_NORM_NFD, KF_NORM_NFKC, KF_NORM_NFKD } kf_norm_kind;

typedef struct {
    kf_norm_kind *steps; /* [n] applied in order */
    size_t n;
} kf_normalizer;

/* Normalizes s into a malloc'ed string (*out, *out_len); returns KF_ERR_NOMEM or KF_ERR_INVALID. */
kf_status kf_normalize(const kf_normalizer *nz, const char *s, size_t len, char **out,
                       size_t *out_len, kf_error *err);

typedef enum { KF_PRE_SPLIT, KF_PRE_BYTELEVEL } kf_pre_kind;

typedef struct {
    kf_pre_kind kind;
    pcre2_code *re;          /* Split's pattern, or ByteLevel's GPT-2 pattern when use_regex */
    bool add_prefix_space;   /* ByteLevel */
} kf_pre_step;

typedef struct {
    kf_pre_step *steps; /* [n] */
    size_t n;
    pcre2_match_data *md;
} kf_pretokenizer;

/* A pre-token: bytes at buf[off .. off+len). */
typedef struct {
    size_t off, len;
} kf_piece;

typedef struct {
    char *buf; /* [buf_len] every piece's bytes */
    size_t buf_len, buf_cap;
    kf_piece *pieces; /* [n] */
    size_t n, cap;
    kf_piece *tmp; /* [tmp_cap] scratch for the next step */
    size_t tmp_n, tmp_cap;
} kf_pieces;

void kf_pieces_free(kf_pieces *p);

/* Compiles a tokenizer.json regex (Oniguruma dialect) for PCRE2, `what` names it in errors. */
kf_status kf_regex_compile(const char *pattern, size_t len, bool literal, pcre2_code **out,
                           const char *what, kf_error *err);

/* Splits text into pieces (replacing p's contents). */
kf_status kf_pretokenize(kf_pretokenizer *pt, const char *text, size_t len, kf_pieces *p,
                         kf_error *err);

void kf_pretokenizer_free(kf_pretokenizer *pt);

/* ---- tokenizer.c ---- */

/* Whether the code point has Unicode's White_Space property. */
bool kf_is_white_space(uint32_t cp);

/* The loaded tokenizer (tokenizer.c loads it, tokenizer_encode.c uses it). */
typedef struct {
    int32_t id;
    char *content; /* [len] as it appears in the text (normalized for "normalized" tokens) */
    size_t len;
    bool special, lstrip, rstrip, single_word, normalized;
} kf_added;

/* Added tokens of one kind (raw or normalized), bucketed by first byte, longest first. */
typedef struct {
    int32_t *order;         /* [n] indices into kf_tokenizer.added */
    size_t n;
    size_t first[257];      /* order[first[b] .. first[b+1]) start with byte b */
} kf_added_set;

struct kf_tokenizer {
    char *path; /* tokenizer.json, for messages */

    int32_t n_ids;
    int64_t *tok_off;   /* [n_ids] decoded bytes of each id at pool[off], -1 when the id is unused */
    uint32_t *tok_len;  /* [n_ids] */
    uint8_t *tok_flags; /* [n_ids] KF_TF_* */
    char *pool;
    size_t pool_len, pool_cap;
    kf_bmap spelling;   /* tokenizer.json spelling -> id (vocabulary and added tokens) */

    kf_added *added; /* [n_added] */
    size_t n_added;
    kf_added_set raw_set, norm_set;

    kf_normalizer norm;
    kf_pretokenizer pre;
    kf_bpe bpe;

    int32_t *tpl_prefix, *tpl_suffix; /* post-processor template around the sequence */
    size_t n_prefix, n_suffix;

    int32_t bos_id, eos_id;

    /* Encoder scratch. */
    kf_pieces pieces;
};

enum { KF_TF_ADDED = 1, KF_TF_SPECIAL = 2 };

/* Decodes one UTF-8 character at s [n]: its length, or minus the length of the maximal ill-formed
 * subpart (at least 1) when the bytes are not valid UTF-8. */
int kf_tok_utf8_next(const unsigned char *s, size_t n, uint32_t *cp);

#endif
