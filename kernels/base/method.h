/* method.h — the compaction methods (the table in docs/design.md): what a file holds and a head was
 * compacted with.
 *
 * The numbers are on disk: a kvf file's head_method bytes are these values (formats/kvf.h), and
 * recipe digests hash them. The names are the command line's, the kvf file's method attribute and
 * a cache file's name.
 */
#ifndef KF_METHOD_H
#define KF_METHOD_H

typedef enum { KF_METHOD_KEEP = 0, KF_METHOD_DROP = 1, KF_METHOD_AM = 2, KF_METHOD_FOLD = 3 } kf_method;

#define KF_METHOD_COUNT 4

/* "keep", "drop", "am", "fold"; "?" outside. */
const char *kf_method_name(kf_method m);
/* 0 on success, -1 for an unknown name (out unchanged). */
int kf_method_parse(const char *name, kf_method *out);

#endif
