/* cli.h — shared helpers of the kvfold command line: messages, argument parsing, loading. */
#ifndef KF_CLI_H
#define KF_CLI_H

#include <stdint.h>

#include "compactor/model.h"
#include "formats/error.h"

enum { KF_EXIT_OK = 0, KF_EXIT_FAIL = 1, KF_EXIT_USAGE = 2 };

/* "kvfold <cmd>: message" on stderr. */
void cli_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints the usage error and a pointer to --help; returns KF_EXIT_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Parses "1,2,3" (commas and/or whitespace). Returns 0, or -1 with a message in err. */
int cli_parse_ids(const char *text, int32_t **ids, int *n, char *err, size_t err_len);
/* Parses a positive integer option value; returns 0 or -1. */
int cli_parse_int(const char *text, long long lo, long long hi, long long *out);

/* Creates the CPU backend and loads the model; prints the error and returns NULL on failure. */
kf_model *cli_load_model(const char *cmd, const char *dir, kf_backend **backend);

double cli_now(void); /* monotonic seconds */

#endif
