/* chat.c — a model's chat template and its variables (see chat.h). */
#include "chat.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <xxhash.h>

#include "jinja.h"

struct kf_chat {
    kf_jinja *tmpl;
    json_t *special; /* {"bos_token": "...", ...}: the special tokens that are set */
    char digest[33];
    char source[640]; /* the file the template came from, for messages */
};

void kf_chat_close(kf_chat *chat) {
    if (!chat)
        return;
    kf_jinja_free(chat->tmpl);
    json_decref(chat->special);
    free(chat);
}

const char *kf_chat_digest(const kf_chat *chat) { return chat->digest; }

/* A special token's text: a string, or an added token's {"content": "..."}; NULL otherwise. */
static json_t *token_text(json_t *v) {
    if (json_is_string(v))
        return json_incref(v);
    json_t *c = json_object_get(v, "content");
    return json_is_string(c) ? json_incref(c) : NULL;
}

static json_t *special_tokens(json_t *config) {
    static const char *const names[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                        "pad_token", "cls_token", "mask_token", NULL};
    json_t *out = json_object();
    for (int i = 0; names[i]; i++) {
        json_t *t = token_text(json_object_get(config, names[i]));
        if (t)
            json_object_set_new(out, names[i], t);
    }
    json_t *extra = json_object_get(config, "additional_special_tokens");
    if (json_is_array(extra)) {
        json_t *list = json_array();
        size_t i;
        json_t *v;
        json_array_foreach(extra, i, v) {
            json_t *t = token_text(v);
            if (t)
                json_array_append_new(list, t);
        }
        json_object_set_new(out, "additional_special_tokens", list);
    }
    return out;
}

/* The template text of the config (owned by it), or NULL. */
static const char *config_template(json_t *config, size_t *len) {
    json_t *t = json_object_get(config, "chat_template");
    if (json_is_array(t)) { /* named templates: the default one */
        size_t i;
        json_t *v, *named = NULL;
        json_array_foreach(t, i, v) {
            if (json_is_string(json_object_get(v, "name")) && strcmp(json_string_value(json_object_get(v, "name")), "default") == 0)
                named = json_object_get(v, "template");
        }
        t = named;
    }
    if (!json_is_string(t))
        return NULL;
    *len = json_string_length(t);
    return json_string_value(t);
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n + 65536 + 1 > cap) {
            char *b = realloc(buf, cap = 2 * cap + 65536 + 1);
            if (!b) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = b;
        }
        const size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0)
            break;
    }
    const bool bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static kf_status parse_template(kf_chat *chat, const char *text, size_t len, kf_error *err) {
    XXH128_hash_t h = XXH3_128bits(text, len);
    snprintf(chat->digest, sizeof chat->digest, "%016llx%016llx", (unsigned long long)h.high64,
             (unsigned long long)h.low64);
    if (kf_jinja_parse(text, len, &chat->tmpl, err) != KF_OK)
        return kf_error_prefix(err, "%s: chat template", chat->source);
    return KF_OK;
}

kf_status kf_chat_open(kf_chat **out, const char *path, kf_error *err) {
    *out = NULL;
    char dir[512], config_path[600], jinja_path[600];
    struct stat st;
    const bool is_dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
    if (strlen(path) >= sizeof dir)
        return kf_fail(err, KF_ERR_INVALID, "%.64s...: path longer than %zu bytes", path, sizeof dir - 1);
    snprintf(dir, sizeof dir, "%s", path);
    if (!is_dir) { /* tokenizer_config.json itself: chat_template.jinja is looked for beside it */
        char *slash = strrchr(dir, '/');
        if (slash)
            *slash = 0;
        else
            snprintf(dir, sizeof dir, ".");
    }
    snprintf(config_path, sizeof config_path, is_dir ? "%s/tokenizer_config.json" : "%s", is_dir ? dir : path);
    snprintf(jinja_path, sizeof jinja_path, "%s/chat_template.jinja", dir);
    json_error_t je;
    json_t *config = json_load_file(config_path, JSON_DECODE_INT_AS_REAL, &je); /* model_max_length: 1e30 */
    if (!config || !json_is_object(config)) {
        json_decref(config);
        return kf_fail(err, config ? KF_ERR_FORMAT : KF_ERR_IO, "%s: %s", config_path,
                       config ? "not a JSON object" : je.text);
    }
    kf_chat *chat = calloc(1, sizeof *chat);
    if (!chat) {
        json_decref(config);
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", config_path);
    }
    chat->special = special_tokens(config);
    size_t len = 0;
    const char *text = config_template(config, &len);
    kf_status s;
    if (text) {
        snprintf(chat->source, sizeof chat->source, "%s", config_path);
        s = parse_template(chat, text, len, err);
    } else {
        char *file = read_file(jinja_path, &len);
        snprintf(chat->source, sizeof chat->source, "%s", jinja_path);
        s = file ? parse_template(chat, file, len, err)
                 : kf_fail(err, KF_ERR_NOTFOUND, "%s has no chat template (no \"chat_template\" and no %s)",
                           config_path, jinja_path);
        free(file);
    }
    json_decref(config);
    if (s != KF_OK) {
        kf_chat_close(chat);
        return s;
    }
    *out = chat;
    return KF_OK;
}

/* The template's variables for a conversation (see chat.h); NULL with err set. */
static json_t *context(const kf_chat *chat, const char *conversation, size_t len, bool add_generation_prompt,
                       kf_error *err) {
    json_error_t je;
    json_t *conv = json_loadb(conversation, len, JSON_ALLOW_NUL, &je);
    if (!conv || !(json_is_array(conv) || (json_is_object(conv) && json_is_array(json_object_get(conv, "messages"))))) {
        kf_fail(err, KF_ERR_INVALID, "the conversation is %s%s", conv ? "neither a list of messages nor an object with "
                                                                         "\"messages\""
                                                                       : "not valid JSON: ",
                conv ? "" : je.text);
        json_decref(conv);
        return NULL;
    }
    json_t *ctx = json_deep_copy(chat->special);
    json_object_set_new(ctx, "tools", json_null());
    json_object_set_new(ctx, "documents", json_null());
    if (json_is_array(conv))
        json_object_set(ctx, "messages", conv);
    else
        json_object_update(ctx, conv);
    json_object_set_new(ctx, "add_generation_prompt", json_boolean(add_generation_prompt));
    json_decref(conv);
    return ctx;
}

kf_status kf_chat_render(const kf_chat *chat, const char *conversation, size_t len, bool add_generation_prompt,
                         char **out, size_t *out_len, kf_error *err) {
    *out = NULL;
    json_t *ctx = context(chat, conversation, len, add_generation_prompt, err);
    if (!ctx)
        return err ? err->code : KF_ERR_INVALID;
    char *js = json_dumps(ctx, JSON_COMPACT);
    json_decref(ctx);
    if (!js)
        return kf_fail(err, KF_ERR_NOMEM, "out of memory");
    const kf_status s = kf_jinja_render(chat->tmpl, js, strlen(js), NULL, out, out_len, err);
    free(js);
    if (s != KF_OK)
        return kf_error_prefix(err, "%s: chat template", chat->source);
    return KF_OK;
}
