/* cli.h — shared helpers of the kvfold command line: messages, argument parsing, loading. */
#ifndef KF_CLI_H
#define KF_CLI_H

#include <stdint.h>
#include <stdio.h>

#include "compactor/model.h"
#include "compactor/quoka.h"
#include "kernels/base/error.h"

enum { KF_EXIT_OK = 0, KF_EXIT_FAIL = 1, KF_EXIT_USAGE = 2 };
/* A stage's result when the command goes on (the others are exit statuses). */
enum { CLI_CONTINUE = -1 };

/* NULL, or called before a message on stderr: clears a line drawn in place (tools/progress.c). */
extern void (*cli_before_message)(void);
/* "kvfold <cmd>: message" on stderr, the message escaped (formats/escape.h: control characters,
 * invalid UTF-8 and bidirectional controls made visible), so quoted ids and paths cannot forge lines. */
void cli_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints the usage error and a pointer to --help; returns KF_EXIT_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Parses "1,2,3" (ids separated by one comma and/or whitespace; an empty item such as "1,,2" or a
 * comma at either end is refused). Returns 0, or -1 with a message in err. */
int cli_parse_ids(const char *text, int32_t **ids, int *n, char *err, size_t err_len);
/* Parses a positive integer option value; returns 0 or -1. */
int cli_parse_int(const char *text, long long lo, long long hi, long long *out);

/* Creates the CPU backend and loads the model; prints the error and returns NULL on failure. */
kf_model *cli_load_model(const char *cmd, const char *dir, kf_backend **backend);
/* The same on a named device: NULL or "cpu", or "cuda" / "cuda:N" (builds with the CUDA backend;
 * elsewhere an error saying so). */
kf_model *cli_load_model_on(const char *cmd, const char *dir, const char *device, kf_backend **backend);

/* --weights (tools/compact_options.h): how cli_load_model stores the model's weights (kf_weights; one
 * choice for the process). */
kf_weights cli_weights(void);
int cli_weights_set(const char *arg); /* 0, or -1 when arg is not auto, bf16 or fp32 */

double cli_now(void); /* monotonic seconds */

/* The prefill options (--prefill, --quoka-*: tools/compact_options.h) write a kf_quoka_params. */
kf_quoka_params cli_prefill_defaults(void); /* dense, with QUOKA's defaults for when it is chosen */
/* NULL for dense, else p (for kf_forward_args.quoka). */
const kf_quoka_params *cli_prefill_params(const kf_quoka_params *p);

/* All of f (a pipe too) in a malloc'd, NUL-terminated buffer; *len its bytes (the NUL not
 * counted). NULL when out of memory or on a read error. */
char *cli_read_all(FILE *f, size_t *len);

#endif
