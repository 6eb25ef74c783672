/* fuzz_jinja — libFuzzer target for the chat-template engine (formats/jinja.h).
 *
 *   cmake --build build-fuzz --target fuzz_jinja    (configured as for fuzz_tokenizer)
 *   tests/fuzz_seeds.py build-fuzz/seeds
 *   build-fuzz/tests/fuzz_jinja -max_total_time=20 -max_len=8192 CORPUS build-fuzz/seeds/jinja
 *
 * The input is a template; it is parsed and, when accepted, rendered with a fixed conversation
 * (system, user, assistant with reasoning and a tool call, tool, user) under small limits. Besides
 * "no crash, no sanitizer report, no leak, no hang": a refusal names the template and a known
 * status; an accepted render is valid UTF-8 of the length reported, within the output limit.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/jinja.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char context[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
    " {\"role\": \"user\", \"content\": \"Hi \\u00e9 \\ud83d\\ude00 <tool_response>x</tool_response>\"},"
    " {\"role\": \"assistant\", \"content\": \"<think>\\nhm\\n</think>\\n\\nHello\", \"reasoning_content\": null,"
    "  \"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"a\": [1, 2.5, true, null]}}}]},"
    " {\"role\": \"tool\", \"content\": \"42\"}, {\"role\": \"user\", \"content\": \"\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}],"
    " \"add_generation_prompt\": true, \"enable_thinking\": false, \"bos_token\": \"<s>\", \"n\": 3}";

static void fail(const char *what, const char *detail) {
    fprintf(stderr, "fuzz_jinja: %s: %s\n", what, detail);
    abort();
}

static bool valid_utf8(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        const unsigned char c = (unsigned char)s[i];
        const size_t k = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        if (k == 0 || i + k > n)
            return false;
        for (size_t j = 1; j < k; j++)
            if (((unsigned char)s[i + j] & 0xC0) != 0x80)
                return false;
        i += k;
    }
    return true;
}

static void check_refusal(kf_status st, const kf_error *err) {
    if (strncmp(err->msg, "template", 8) != 0)
        fail("a refusal that does not name the template", err->msg);
    if (st != err->code || st < KF_ERR_IO || st > KF_ERR_MISMATCH)
        fail("a refusal with a bad status", err->msg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kf_jinja *t = NULL;
    kf_error err = {0};
    kf_status st = kf_jinja_parse((const char *)data, size, &t, &err);
    if (st != KF_OK) {
        check_refusal(st, &err);
        if (t)
            fail("a refused parse that returned a template", err.msg);
        return 0;
    }
    const kf_jinja_limits lim = {.max_steps = 200000, .max_memory = (size_t)64 << 20, .max_output = (size_t)1 << 20};
    char *out = NULL;
    size_t len = 0;
    memset(&err, 0, sizeof err);
    st = kf_jinja_render(t, context, sizeof context - 1, &lim, &out, &len, &err);
    if (st != KF_OK) {
        check_refusal(st, &err);
        if (out)
            fail("a refused render that returned output", err.msg);
    } else {
        if (!out || out[len] != 0 || len > lim.max_output)
            fail("an output not NUL-terminated or over the limit", "");
        if (!valid_utf8(out, len))
            fail("an output that is not valid UTF-8", "");
    }
    free(out);
    kf_jinja_free(t);
    return 0;
}
