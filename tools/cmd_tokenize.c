/* kvfold tokenize — text to token ids and back with a model's tokenizer.json. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/tokenizer.h"
#include "tools/cli.h"

static const char kHelp[] =
    "Usage: kvfold tokenize --model DIR [--text | --ids] [options] < input\n"
    "\n"
    "Reads standard input. With --text (the default) it encodes the bytes as they are (a final\n"
    "newline is text too: use printf, not echo) and prints the ids comma-separated on one line.\n"
    "With --ids it reads ids separated by commas and/or white space and prints the decoded text.\n"
    "\n"
    "Options:\n"
    "  --model DIR      model directory with tokenizer.json (or the tokenizer.json itself)\n"
    "  --text           encode text to ids (default)\n"
    "  --ids            decode ids to text\n"
    "  --add-special    apply the post-processor's template (e.g. a BOS token) when encoding\n"
    "  --skip-special   leave special added tokens out when decoding\n"
    "  -h, --help       show this help\n";

int cmd_tokenize(int argc, char **argv) {
    static const struct option opts[] = {
        {"help", no_argument, 0, 'h'},         {"model", required_argument, 0, 'm'},
        {"text", no_argument, 0, 't'},         {"ids", no_argument, 0, 'i'},
        {"add-special", no_argument, 0, 'a'},  {"skip-special", no_argument, 0, 's'},
        {0, 0, 0, 0}};
    const char *dir = NULL;
    bool decode = false;
    unsigned enc_flags = 0, dec_flags = 0;
    optind = 1;
    opterr = 0;
    for (int c; (c = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (c) {
        case 'h': fputs(kHelp, stdout); return KF_EXIT_OK;
        case 'm': dir = optarg; break;
        case 't': decode = false; break;
        case 'i': decode = true; break;
        case 'a': enc_flags |= KF_TOK_ADD_SPECIAL; break;
        case 's': dec_flags |= KF_TOK_SKIP_SPECIAL; break;
        default: return cli_usage_error("tokenize", "unknown option '%s'", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return cli_usage_error("tokenize", "unexpected argument '%s'", argv[optind]);
    if (!dir)
        return cli_usage_error("tokenize", "--model DIR is required");

    kf_error err = {0};
    kf_tokenizer *tok = NULL;
    if (kf_tokenizer_open(&tok, dir, &err) != KF_OK) {
        cli_error("tokenize", "%s", err.msg);
        return KF_EXIT_FAIL;
    }
    size_t len = 0;
    char *input = cli_read_all(stdin, &len);
    if (!input) {
        cli_error("tokenize", "cannot read standard input");
        kf_tokenizer_close(tok);
        return KF_EXIT_FAIL;
    }
    int rc = KF_EXIT_OK;
    if (!decode) {
        kf_token_ids ids = {0};
        if (kf_tokenizer_encode(tok, input, len, enc_flags, &ids, &err) != KF_OK) {
            cli_error("tokenize", "%s", err.msg);
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
            rc = cli_usage_error("tokenize", "%s", memchr(input, 0, len) ? "NUL byte in the ids" : msg);
        } else {
            char *text = NULL;
            size_t tlen = 0;
            if (kf_tokenizer_decode(tok, ids, (size_t)n, dec_flags, &text, &tlen, &err) != KF_OK) {
                cli_error("tokenize", "%s", err.msg);
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
        cli_error("tokenize", "cannot write standard output");
        rc = KF_EXIT_FAIL;
    }
    return rc;
}
