/* commands.h — every subcommand of the kvfold CLI: int cmd_x(int argc, char **argv),
 * where argv[0] is the subcommand's name. Returns the process exit status. */
#ifndef KF_COMMANDS_H
#define KF_COMMANDS_H

#include "tools/options.h"

/* The option tables of the commands built from them (tools/options.h), for the tests. */
extern const cli_command cli_compact_command, cli_eval_command, cli_bench_compact_command, cli_logits_command,
    cli_model_info_command, cli_tokenize_command, cli_chat_template_command, cli_inspect_command, cli_ask_command,
    cli_verify_command, cli_bench_command, cli_bench_prefill_command, cli_bench_attention_command,
    cli_bench_quoka_command, cli_bench_kvf_command, cli_bench_tokenize_command;

int cmd_model_info(int argc, char **argv);
int cmd_logits(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_bench_prefill(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_chat_template(int argc, char **argv);
int cmd_bench_tokenize(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_bench_compact(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_bench_kvf(int argc, char **argv);
int cmd_bench_attention(int argc, char **argv);
int cmd_bench_quoka(int argc, char **argv);
int cmd_compact(int argc, char **argv);
int cmd_verify(int argc, char **argv);
int cmd_ask(int argc, char **argv);

#endif
