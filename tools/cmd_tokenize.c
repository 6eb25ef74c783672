/* kvfold tokenize — text to token ids and back with a model's tokenizer.json. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/tokenizer.h"
#include "tools/cli.h"
#include "tools/commands.h"

#define CMD "tokenize"

typedef struct {
    const char *dir;
    int decode, add_special, skip_special;
} tokenize_opts;

#define T(field) OFF(tokenize_opts, field)
static const cli_opt kRows[] = {
    {"model", 0, OPT_STR, "DIR", T(dir), .help = "model directory with tokenizer.json (or the tokenizer.json itself)"},
    {"text", 0, OPT_FLAG, NULL, T(decode), .ival = -1, .help = "encode text to ids (the default)"},
    {"ids", 0, OPT_FLAG, NULL, T(decode), .help = "decode ids to text"},
    {"add-special", 0, OPT_FLAG, NULL, T(add_special),
     .help = "apply the post-processor's template (e.g. a BOS token) when encoding"},
    {"skip-special", 0, OPT_FLAG, NULL, T(skip_special), .help = "leave special added tokens out when decoding"},
    {0}};

const cli_command cli_tokenize_command = {
    .name = CMD,
    .usage = "kvfold tokenize --model DIR [--text | --ids] [options] < input\n",
    .about = "Reads standard input. With --text (the default) it encodes the bytes as they are (a final\n"
             "newline is text too: use printf, not echo) and prints the ids comma-separated on one line.\n"
             "With --ids it reads ids separated by commas and/or white space and prints the decoded text.\n",
    .groups = (const cli_group[]){{NULL, kRows, 0}, {0}},
    .exit_status = "  0  encoded or decoded\n"
                   "  1  the tokenizer cannot be loaded, or the input cannot be read or written\n"
                   "  2  usage errors, including ids that cannot be parsed\n",
    .example = "  printf 'Hello world' | kvfold tokenize --model Qwen3-0.6B\n",
};

int cmd_tokenize(int argc, char **argv) {
    tokenize_opts o = {0};
    int first;
    const int prc = cli_opts_parse(&cli_tokenize_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    if (first < argc)
        return cli_usage_error(CMD, "unexpected argument '%s'", argv[first]);
    if (!o.dir)
        return cli_usage_error(CMD, "--model DIR is required");
    const char *dir = o.dir;
    const bool decode = o.decode > 0;
    const unsigned enc_flags = o.add_special ? KF_TOK_ADD_SPECIAL : 0, dec_flags = o.skip_special ? KF_TOK_SKIP_SPECIAL : 0;

    kf_error err = {0};
    kf_tokenizer *tok = NULL;
    if (kf_tokenizer_open(&tok, dir, &err) != KF_OK) {
        cli_error(CMD, "%s", err.msg);
        return KF_EXIT_FAIL;
    }
    size_t len = 0;
    char *input = cli_read_all(stdin, &len);
    if (!input) {
        cli_error(CMD, "cannot read standard input");
        kf_tokenizer_close(tok);
        return KF_EXIT_FAIL;
    }
    int rc = KF_EXIT_OK;
    if (!decode) {
        kf_token_ids ids = {0};
        if (kf_tokenizer_encode(tok, input, len, enc_flags, &ids, &err) != KF_OK) {
            cli_error(CMD, "%s", err.msg);
            rc = KF_EXIT_FAIL;
        } else {
            for (size_t i = 0; i < ids.n; i++)
                printf(i ? ",%d" : "%d", (int)ids.ids[i]);
            putchar('\n');
        }
        kf_token_ids_free(&ids);
    } else {
        int32_t *ids = NULL;
        int n = 0;
        char msg[256];
        if (memchr(input, 0, len) || cli_parse_ids(input, &ids, &n, msg, sizeof msg) != 0) {
            rc = cli_usage_error(CMD, "%s", memchr(input, 0, len) ? "NUL byte in the ids" : msg);
        } else {
            char *text = NULL;
            size_t tlen = 0;
            if (kf_tokenizer_decode(tok, ids, (size_t)n, dec_flags, &text, &tlen, &err) != KF_OK) {
                cli_error(CMD, "%s", err.msg);
                rc = KF_EXIT_FAIL;
            } else {
                fwrite(text, 1, tlen, stdout);
            }
            free(text);
        }
        free(ids);
    }
    free(input);
    kf_tokenizer_close(tok);
    if (fflush(stdout) != 0) {
        cli_error(CMD, "cannot write standard output");
        rc = KF_EXIT_FAIL;
    }
    return rc;
}
