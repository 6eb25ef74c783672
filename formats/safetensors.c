#include "formats/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The header's dtype strings and the dtypes they stand for (sizes: kf_dtype_size). */
static const struct {
    const char *name;
    kf_dtype dt;
} kDtypes[] = {
    {"BOOL", KF_DTYPE_BOOL}, {"U8", KF_DTYPE_U8},   {"I8", KF_DTYPE_I8},     {"I16", KF_DTYPE_I16},
    {"U16", KF_DTYPE_U16},   {"F16", KF_DTYPE_F16}, {"BF16", KF_DTYPE_BF16}, {"I32", KF_DTYPE_I32},
    {"U32", KF_DTYPE_U32},   {"F32", KF_DTYPE_F32}, {"I64", KF_DTYPE_I64},   {"U64", KF_DTYPE_U64},
    {"F64", KF_DTYPE_F64},
};
#define N_DTYPES (sizeof kDtypes / sizeof kDtypes[0])

const char *kf_st_dtype_name(kf_dtype dt) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (kDtypes[i].dt == dt)
            return kDtypes[i].name;
    return "?";
}

static int parse_dtype(const char *s, kf_dtype *out) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (strcmp(kDtypes[i].name, s) == 0) {
            *out = kDtypes[i].dt;
            return 1;
        }
    return 0;
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const kf_st_tensor *)a)->name, ((const kf_st_tensor *)b)->name);
}

typedef struct {
    uint64_t begin, end;
    const char *name;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Maps the file at path read-only into f. */
static kf_status map_file(kf_st_file *f, const char *path, kf_error *err) {
    memset(f, 0, sizeof *f);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kf_fail(err, KF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kf_fail(err, KF_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kf_fail(err, KF_ERR_IO, "%s: not a regular file", path);
    }
    f->size = (size_t)st.st_size;
    if (f->size < 8) {
        close(fd);
        return kf_fail(err, KF_ERR_FORMAT,
                       "%s: truncated safetensors file (%zu bytes; the 8-byte header length is missing)",
                       path, f->size);
    }
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        return kf_fail(err, KF_ERR_IO, "%s: cannot mmap: %s", path, strerror(e));
    }
    f->path = strdup(path);
    if (!f->path) {
        munmap(f->map, f->size);
        f->map = NULL;
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
    }
    return KF_OK;
}

/* Parses and validates the header of set->files[fi]; appends its tensors to set. */
static kf_status parse_header(kf_st_set *set, int fi, kf_error *err) {
    kf_st_file *f = &set->files[fi];
    const unsigned char *p = f->map;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | p[i];
    f->header_len = n;
    if (n > KF_ST_MAX_HEADER)
        return kf_fail(err, KF_ERR_FORMAT,
                       "%s: header length %llu is absurd (limit %u bytes); not a safetensors file?",
                       f->path, (unsigned long long)n, KF_ST_MAX_HEADER);
    if (n > f->size - 8)
        return kf_fail(err, KF_ERR_FORMAT,
                       "%s: header length %llu runs past the end of the file (%zu bytes): truncated?",
                       f->path, (unsigned long long)n, f->size);
    if (n < 2)
        return kf_fail(err, KF_ERR_FORMAT, "%s: header of %llu bytes cannot be a JSON object", f->path,
                       (unsigned long long)n);
    const uint64_t data_size = f->size - 8 - n;
    const unsigned char *data = p + 8 + n;

    json_error_t jerr;
    json_t *root = json_loadb((const char *)p + 8, (size_t)n, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return kf_fail(err, KF_ERR_FORMAT, "%s: header is not valid JSON (line %d, column %d: %s)",
                       f->path, jerr.line, jerr.column, jerr.text);
    kf_status rc = KF_OK;
    span *spans = NULL;
    size_t n_spans = 0;
    if (!json_is_object(root)) {
        rc = kf_fail(err, KF_ERR_FORMAT, "%s: header is JSON but not an object", f->path);
        goto done;
    }
    size_t cap = json_object_size(root);
    spans = calloc(cap ? cap : 1, sizeof *spans);
    kf_st_tensor *grown = realloc(set->tensors, (set->n_tensors + cap + 1) * sizeof *set->tensors);
    if (!spans || !grown) {
        if (grown)
            set->tensors = grown;
        rc = kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", f->path);
        goto done;
    }
    set->tensors = grown;

    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(val)) {
                rc = kf_fail(err, KF_ERR_FORMAT, "%s: __metadata__ is not an object", f->path);
                goto done;
            }
            continue;
        }
        if (!json_is_object(val)) {
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: tensor '%s': entry is not an object", f->path, key);
            goto done;
        }
        json_t *jd = json_object_get(val, "dtype");
        json_t *js = json_object_get(val, "shape");
        json_t *jo = json_object_get(val, "data_offsets");
        if (!json_is_string(jd) || !json_is_array(js) || !json_is_array(jo)) {
            rc = kf_fail(err, KF_ERR_FORMAT,
                         "%s: tensor '%s': needs string 'dtype', array 'shape' and array 'data_offsets'",
                         f->path, key);
            goto done;
        }
        kf_st_tensor t = {0};
        if (!parse_dtype(json_string_value(jd), &t.dtype)) {
            rc = kf_fail(err, KF_ERR_UNSUPPORTED, "%s: tensor '%s': unknown dtype '%s'", f->path, key,
                         json_string_value(jd));
            goto done;
        }
        size_t ndim = json_array_size(js);
        if (ndim > KF_ST_MAX_DIMS) {
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: tensor '%s': %zu dimensions (at most %d)", f->path, key,
                         ndim, KF_ST_MAX_DIMS);
            goto done;
        }
        t.ndim = (int)ndim;
        uint64_t numel = 1;
        int overflow = 0;
        for (size_t d = 0; d < ndim; d++) {
            json_t *jv = json_array_get(js, d);
            if (!json_is_integer(jv) || json_integer_value(jv) < 0) {
                rc = kf_fail(err, KF_ERR_FORMAT, "%s: tensor '%s': shape[%zu] is not a non-negative integer",
                             f->path, key, d);
                goto done;
            }
            uint64_t dim = (uint64_t)json_integer_value(jv);
            t.shape[d] = (int64_t)dim;
            if (dim && numel > UINT64_MAX / dim)
                overflow = 1;
            numel *= dim;
        }
        size_t esize = kf_dtype_size(t.dtype);
        if (overflow || numel > UINT64_MAX / esize) {
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: tensor '%s': shape overflows 64 bits", f->path, key);
            goto done;
        }
        if (json_array_size(jo) != 2 || !json_is_integer(json_array_get(jo, 0)) ||
            !json_is_integer(json_array_get(jo, 1)) || json_integer_value(json_array_get(jo, 0)) < 0 ||
            json_integer_value(json_array_get(jo, 1)) < 0) {
            rc = kf_fail(err, KF_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets must be two non-negative integers", f->path, key);
            goto done;
        }
        uint64_t begin = (uint64_t)json_integer_value(json_array_get(jo, 0));
        uint64_t end = (uint64_t)json_integer_value(json_array_get(jo, 1));
        if (begin > end || end > data_size) {
            rc = kf_fail(err, KF_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets [%llu, %llu] outside the data section (%llu bytes)",
                         f->path, key, (unsigned long long)begin, (unsigned long long)end,
                         (unsigned long long)data_size);
            goto done;
        }
        if (numel * esize != end - begin) {
            rc = kf_fail(err, KF_ERR_FORMAT,
                         "%s: tensor '%s': %s shape holds %llu bytes but data_offsets span %llu bytes",
                         f->path, key, kf_st_dtype_name(t.dtype), (unsigned long long)(numel * esize),
                         (unsigned long long)(end - begin));
            goto done;
        }
        t.numel = (int64_t)numel;
        t.nbytes = (size_t)(end - begin);
        t.data = data + begin;
        t.file = fi;
        t.name = strdup(key);
        if (!t.name) {
            rc = kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", f->path);
            goto done;
        }
        spans[n_spans++] = (span){begin, end, t.name};
        set->tensors[set->n_tensors++] = t;
    }
    qsort(spans, n_spans, sizeof *spans, cmp_span);
    /* Compare each non-empty span with the previous non-empty one: an empty span sorted
     * between two overlapping tensors must not hide the overlap. */
    const span *prev = NULL;
    for (size_t i = 0; i < n_spans; i++) {
        if (spans[i].begin == spans[i].end)
            continue;
        if (prev && spans[i].begin < prev->end) {
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap in the data section", f->path,
                         prev->name, spans[i].name);
            goto done;
        }
        prev = &spans[i];
    }
done:
    free(spans);
    json_decref(root);
    return rc;
}

static kf_status finish_set(kf_st_set *set, kf_error *err) {
    if (set->n_tensors == 0) /* tensors may be NULL (an empty weight_map): qsort(NULL, 0) is UB */
        return KF_OK;
    qsort(set->tensors, set->n_tensors, sizeof *set->tensors, cmp_tensor_name);
    for (size_t i = 1; i < set->n_tensors; i++)
        if (strcmp(set->tensors[i].name, set->tensors[i - 1].name) == 0)
            return kf_fail(err, KF_ERR_FORMAT, "tensor '%s' appears in both %s and %s", set->tensors[i].name,
                           set->files[set->tensors[i - 1].file].path, set->files[set->tensors[i].file].path);
    return KF_OK;
}

static kf_status add_file(kf_st_set *set, const char *path, kf_error *err) {
    kf_st_file *files = realloc(set->files, (size_t)(set->n_files + 1) * sizeof *files);
    if (!files)
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
    set->files = files;
    KF_TRY(map_file(&set->files[set->n_files], path, err));
    set->n_files++;
    return parse_header(set, set->n_files - 1, err);
}

kf_status kf_st_open_file(kf_st_set *set, const char *path, kf_error *err) {
    memset(set, 0, sizeof *set);
    kf_status rc = add_file(set, path, err);
    if (rc == KF_OK)
        rc = finish_set(set, err);
    if (rc != KF_OK)
        kf_st_close(set);
    return rc;
}

char *kf_st_dir_file(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static kf_status open_index(kf_st_set *set, const char *dir, const char *index_path, kf_error *err) {
    json_error_t jerr;
    json_t *root = json_load_file(index_path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return kf_fail(err, KF_ERR_FORMAT, "%s: not valid JSON (line %d: %s)", index_path, jerr.line,
                       jerr.text);
    kf_status rc = KF_OK;
    json_t *map = json_object_get(root, "weight_map");
    if (!json_is_object(map)) {
        rc = kf_fail(err, KF_ERR_FORMAT, "%s: missing object 'weight_map'", index_path);
        goto done;
    }
    const char *name;
    json_t *val;
    /* Open every distinct shard once, in the order first seen. */
    json_object_foreach(map, name, val) {
        if (!json_is_string(val)) {
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: weight_map['%s'] is not a file name", index_path, name);
            goto done;
        }
        const char *shard = json_string_value(val);
        if (!*shard || strchr(shard, '/') || strcmp(shard, "..") == 0) {
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: shard name '%s' must be a plain file name", index_path, shard);
            goto done;
        }
        char *path = kf_st_dir_file(dir, shard);
        if (!path) {
            rc = kf_fail(err, KF_ERR_NOMEM, "out of memory");
            goto done;
        }
        int seen = 0;
        for (int i = 0; i < set->n_files && !seen; i++)
            seen = strcmp(set->files[i].path, path) == 0;
        if (!seen)
            rc = add_file(set, path, err);
        free(path);
        if (rc != KF_OK)
            goto done;
    }
    rc = finish_set(set, err);
    if (rc != KF_OK)
        goto done;
    json_object_foreach(map, name, val) {
        const kf_st_tensor *t = kf_st_find(set, name);
        const char *want = json_string_value(val);
        const char *have = t ? strrchr(set->files[t->file].path, '/') + 1 : NULL;
        if (!t || strcmp(have, want) != 0) {
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: tensor '%s' is mapped to %s but is not there", index_path,
                         name, want);
            goto done;
        }
    }
done:
    json_decref(root);
    return rc;
}

kf_status kf_st_open_dir(kf_st_set *set, const char *dir, kf_error *err) {
    memset(set, 0, sizeof *set);
    char *single = kf_st_dir_file(dir, "model.safetensors");
    char *index = kf_st_dir_file(dir, "model.safetensors.index.json");
    kf_status rc;
    if (!single || !index)
        rc = kf_fail(err, KF_ERR_NOMEM, "out of memory");
    else if (access(index, F_OK) == 0)
        rc = open_index(set, dir, index, err);
    else if (access(single, F_OK) == 0) {
        rc = add_file(set, single, err);
        if (rc == KF_OK)
            rc = finish_set(set, err);
    } else
        rc = kf_fail(err, KF_ERR_NOTFOUND, "%s: no model.safetensors or model.safetensors.index.json", dir);
    free(single);
    free(index);
    if (rc != KF_OK)
        kf_st_close(set);
    return rc;
}

void kf_st_release_pages(const kf_st_set *set, const kf_st_tensor *t) {
    const kf_st_file *f = &set->files[t->file];
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t begin = (size_t)((const char *)t->data - (const char *)f->map) / page * page;
    const size_t end = (size_t)((const char *)t->data - (const char *)f->map) + t->nbytes;
    if (t->nbytes > 0 && end <= f->size)
        madvise((char *)f->map + begin, end - begin, MADV_DONTNEED); /* advice: a failure changes nothing */
}

void kf_st_close(kf_st_set *set) {
    for (size_t i = 0; i < set->n_tensors; i++)
        free(set->tensors[i].name);
    free(set->tensors);
    for (int i = 0; i < set->n_files; i++) {
        if (set->files[i].map)
            munmap(set->files[i].map, set->files[i].size);
        free(set->files[i].path);
    }
    free(set->files);
    memset(set, 0, sizeof *set);
}

const kf_st_tensor *kf_st_find(const kf_st_set *set, const char *name) {
    if (set->n_tensors == 0) /* tensors may be NULL: bsearch(NULL, 0) is UB */
        return NULL;
    kf_st_tensor key = {.name = (char *)name};
    return bsearch(&key, set->tensors, set->n_tensors, sizeof key, cmp_tensor_name);
}

/* Non-finite means an all-ones exponent: (bits & exp) == exp; NaN when the mantissa is nonzero too.
 * Blocks of 1,024 elements are OR-reduced without branches (vectorizable), and only a block with a
 * hit is searched element by element: the scan costs about one read of the weights. */
#define NONFINITE_SCAN(T, EXP, MANT)                                                        \
    do {                                                                                    \
        const unsigned char *p = t->data;                                                   \
        for (int64_t b0 = 0; b0 < t->numel; b0 += 1024) {                                   \
            const int64_t b1 = t->numel - b0 < 1024 ? t->numel : b0 + 1024;                 \
            int hit = 0;                                                                    \
            for (int64_t i = b0; i < b1; i++) {                                             \
                T u;                                                                        \
                memcpy(&u, p + (size_t)i * sizeof u, sizeof u);                             \
                hit |= (u & (EXP)) == (EXP);                                                \
            }                                                                               \
            for (int64_t i = b0; hit && i < b1; i++) {                                      \
                T u;                                                                        \
                memcpy(&u, p + (size_t)i * sizeof u, sizeof u);                             \
                if ((u & (EXP)) == (EXP)) {                                                 \
                    *is_nan = (u & (MANT)) != 0;                                            \
                    return i;                                                               \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    } while (0)

int64_t kf_st_first_nonfinite(const kf_st_tensor *t, int *is_nan) {
    int dummy;
    if (!is_nan)
        is_nan = &dummy;
    *is_nan = 0;
    switch (t->dtype) {
    case KF_DTYPE_BF16: NONFINITE_SCAN(uint16_t, 0x7f80u, 0x007fu); break;
    case KF_DTYPE_F16: NONFINITE_SCAN(uint16_t, 0x7c00u, 0x03ffu); break;
    case KF_DTYPE_F32: NONFINITE_SCAN(uint32_t, 0x7f800000u, 0x007fffffu); break;
    case KF_DTYPE_F64: NONFINITE_SCAN(uint64_t, 0x7ff0000000000000ull, 0x000fffffffffffffull); break;
    default: break;
    }
    return -1;
}
