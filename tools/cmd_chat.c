/* kvfold chat-template — a conversation through the model's chat template (formats/chat.h). */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/chat.h"
#include "formats/tokenizer.h"
#include "tools/cli.h"
#include "tools/commands.h"

#define CMD "chat-template"

typedef struct {
    const char *dir;
    int gen, ids, digest;
} chat_opts;

#define H(field) OFF(chat_opts, field)
static const cli_opt kRows[] = {
    {"model", 0, OPT_STR, "DIR", H(dir), .help = "model directory (tokenizer_config.json; tokenizer.json for --ids)"},
    {"generation-prompt", 0, OPT_FLAG, NULL, H(gen), .help = "end with the assistant's header (add_generation_prompt=True)"},
    {"ids", 0, OPT_FLAG, NULL, H(ids),
     .help = "print the token ids instead, comma-separated on one line (no BOS added by the tokenizer: the "
             "template writes its own)"},
    {"digest", 0, OPT_FLAG, NULL, H(digest), .help = "print the template's digest (XXH3-128) and nothing else"},
    {0}};

const cli_command cli_chat_template_command = {
    .name = CMD,
    .usage = "kvfold chat-template --model DIR [options] < conversation.json\n",
    .about = "Renders a conversation with the model's chat template (tokenizer_config.json's \"chat_template\"\n"
             "or chat_template.jinja) exactly as Hugging Face's apply_chat_template does, and prints the text\n"
             "as it is (no newline added). The conversation is JSON on standard input: a list of messages\n"
             "[{\"role\": \"user\", \"content\": \"...\"}, ...], or an object with \"messages\" and other template\n"
             "variables, e.g. {\"messages\": [...], \"tools\": [...], \"enable_thinking\": false}. The special\n"
             "tokens of tokenizer_config.json (bos_token, eos_token, ...) are variables too.\n",
    .groups = (const cli_group[]){{NULL, kRows, 0}, {0}},
    .exit_status = "  0  rendered\n"
                   "  1  no template, a template or conversation that cannot be rendered, or a read/write error\n"
                   "  2  usage errors\n",
    .example = "  echo '[{\"role\": \"user\", \"content\": \"Hi\"}]' | kvfold chat-template --model Qwen3-0.6B \\\n"
               "      --generation-prompt\n",
};

static int print_ids(const char *dir, const char *text, size_t len) {
    kf_error err = {0};
    kf_tokenizer *tok = NULL;
    kf_token_ids ids = {0};
    if (kf_tokenizer_open(&tok, dir, &err) != KF_OK || kf_tokenizer_encode(tok, text, len, 0, &ids, &err) != KF_OK) {
        cli_error(CMD, "%s", err.msg);
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
    chat_opts o = {0};
    int first;
    const int prc = cli_opts_parse(&cli_chat_template_command, argc, argv, &o, &first);
    if (prc != CLI_CONTINUE)
        return prc;
    if (first < argc)
        return cli_usage_error(CMD, "unexpected argument '%s'", argv[first]);
    if (!o.dir)
        return cli_usage_error(CMD, "--model DIR is required");
    const char *dir = o.dir;
    const bool gen = o.gen, ids = o.ids, digest = o.digest;
    kf_error err = {0};
    kf_chat *chat = NULL;
    if (kf_chat_open(&chat, dir, &err) != KF_OK) {
        cli_error(CMD, "%s", err.msg);
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
        cli_error(CMD, "cannot read standard input");
        rc = KF_EXIT_FAIL;
    } else if (kf_chat_render(chat, input, len, gen, &out, &out_len, &err) != KF_OK) {
        cli_error(CMD, "standard input: %s", err.msg);
        rc = KF_EXIT_FAIL;
    } else if (ids)
        rc = print_ids(dir, out, out_len);
    else
        fwrite(out, 1, out_len, stdout);
    free(out);
    free(input);
    kf_chat_close(chat);
    if (fflush(stdout) != 0) {
        cli_error(CMD, "cannot write standard output");
        rc = KF_EXIT_FAIL;
    }
    return rc;
}
