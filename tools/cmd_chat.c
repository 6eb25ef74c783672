/* kvfold chat-template — a conversation through the model's chat template (formats/chat.h). */
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/chat.h"
#include "formats/tokenizer.h"
#include "tools/cli.h"

static const char kHelp[] =
    "Usage: kvfold chat-template --model DIR [options] < conversation.json\n"
    "\n"
    "Renders a conversation with the model's chat template (tokenizer_config.json's \"chat_template\"\n"
    "or chat_template.jinja) exactly as Hugging Face's apply_chat_template does, and prints the text\n"
    "as it is (no newline added). The conversation is JSON on standard input: a list of messages\n"
    "[{\"role\": \"user\", \"content\": \"...\"}, ...], or an object with \"messages\" and other template\n"
    "variables, e.g. {\"messages\": [...], \"tools\": [...], \"enable_thinking\": false}. The special\n"
    "tokens of tokenizer_config.json (bos_token, eos_token, ...) are variables too.\n"
    "\n"
    "Options:\n"
    "  --model DIR            model directory (tokenizer_config.json; tokenizer.json for --ids)\n"
    "  --generation-prompt    end with the assistant's header (add_generation_prompt=True)\n"
    "  --ids                  print the token ids instead, comma-separated on one line (no BOS added\n"
    "                         by the tokenizer: the template writes its own)\n"
    "  --digest               print the template's digest (XXH3-128) and nothing else\n"
    "  -h, --help             show this help\n";

static int print_ids(const char *dir, const char *text, size_t len) {
    kf_error err = {0};
    kf_tokenizer *tok = NULL;
    kf_token_ids ids = {0};
    if (kf_tokenizer_open(&tok, dir, &err) != KF_OK || kf_tokenizer_encode(tok, text, len, 0, &ids, &err) != KF_OK) {
        cli_error("chat-template", "%s", err.msg);
        kf_tokenizer_close(tok);
        return KF_EXIT_FAIL;
    }
    for (size_t i = 0; i < ids.n; i++)
        printf(i ? ",%d" : "%d", (int)ids.ids[i]);
    putchar('\n');
    kf_token_ids_free(&ids);
    kf_tokenizer_close(tok);
    return KF_EXIT_OK;
}

int cmd_chat_template(int argc, char **argv) {
    static const struct option opts[] = {
        {"help", no_argument, 0, 'h'},          {"model", required_argument, 0, 'm'},
        {"generation-prompt", no_argument, 0, 'g'}, {"ids", no_argument, 0, 'i'},
        {"digest", no_argument, 0, 'd'},        {0, 0, 0, 0}};
    const char *dir = NULL;
    bool gen = false, ids = false, digest = false;
    optind = 1;
    opterr = 0;
    for (int c; (c = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (c) {
        case 'h': fputs(kHelp, stdout); return KF_EXIT_OK;
        case 'm': dir = optarg; break;
        case 'g': gen = true; break;
        case 'i': ids = true; break;
        case 'd': digest = true; break;
        default: return cli_usage_error("chat-template", "unknown option '%s'", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return cli_usage_error("chat-template", "unexpected argument '%s'", argv[optind]);
    if (!dir)
        return cli_usage_error("chat-template", "--model DIR is required");
    kf_error err = {0};
    kf_chat *chat = NULL;
    if (kf_chat_open(&chat, dir, &err) != KF_OK) {
        cli_error("chat-template", "%s", err.msg);
        return KF_EXIT_FAIL;
    }
    if (digest) {
        printf("%s\n", kf_chat_digest(chat));
        kf_chat_close(chat);
        return KF_EXIT_OK;
    }
    size_t len = 0, out_len = 0;
    char *input = cli_read_all(stdin, &len), *out = NULL;
    int rc = KF_EXIT_OK;
    if (!input) {
        cli_error("chat-template", "cannot read standard input");
        rc = KF_EXIT_FAIL;
    } else if (kf_chat_render(chat, input, len, gen, &out, &out_len, &err) != KF_OK) {
        cli_error("chat-template", "standard input: %s", err.msg);
        rc = KF_EXIT_FAIL;
    } else if (ids)
        rc = print_ids(dir, out, out_len);
    else
        fwrite(out, 1, out_len, stdout);
    free(out);
    free(input);
    kf_chat_close(chat);
    if (fflush(stdout) != 0) {
        cli_error("chat-template", "cannot write standard output");
        rc = KF_EXIT_FAIL;
    }
    return rc;
}
