/* chat.h — a model's chat template, rendered as Hugging Face's apply_chat_template renders it.
 *
 * The template is tokenizer_config.json's "chat_template" (a string, or a list of {"name",
 * "template"} of which "default" is taken), else the file chat_template.jinja beside it. The
 * template's variables, as apply_chat_template sets them (formats/jinja.h renders):
 *
 *   messages               the conversation: [{"role": ..., "content": ...}, ...]
 *   tools, documents       null unless the conversation object gives them
 *   add_generation_prompt  the caller's choice
 *   bos_token eos_token unk_token sep_token pad_token cls_token mask_token
 *                          tokenizer_config.json's, where set: a string or {"content": "..."}
 *   additional_special_tokens   likewise (a list)
 *   any other member of the conversation object (e.g. "enable_thinking": false), last
 *
 * The conversation is JSON: a list of messages, or an object with "messages" and the other
 * variables.
 */
#ifndef KF_CHAT_H
#define KF_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "kernels/base/error.h"

typedef struct kf_chat kf_chat;

/* Opens the chat template of `path`: a model directory or its tokenizer_config.json. A model
 * without one is KF_ERR_NOTFOUND; a template outside the subset of formats/jinja.h is
 * KF_ERR_UNSUPPORTED with its line and column. */
kf_status kf_chat_open(kf_chat **out, const char *path, kf_error *err);
void kf_chat_close(kf_chat *chat);

/* XXH3-128 of the template's text: 32 lowercase hex digits. */
const char *kf_chat_digest(const kf_chat *chat);

/* Renders a conversation (JSON, len bytes) into a malloc'ed string (*out, *out_len bytes). */
kf_status kf_chat_render(const kf_chat *chat, const char *conversation, size_t len, bool add_generation_prompt,
                         char **out, size_t *out_len, kf_error *err);

#endif
