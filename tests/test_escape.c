/* test_escape.c — kf_escape (formats/escape.h) against hand-written expectations: every kind of
 * byte that could act on a terminal or forge a log line, and what must pass unchanged. */
#include <string.h>

#include "formats/escape.h"
#include "formats/kvf.h"
#include "test_util.h"

static void expect(const char *in, const char *want) {
    char out[256];
    kf_escape(in, out, sizeof out);
    CU_ASSERT_STRING_EQUAL(out, want);
    if (strcmp(out, want) != 0)
        fprintf(stderr, "\n    escape: got '%s', want '%s'", out, want);
}

static void test_controls_and_line_breaks(void) {
    expect("a\x1b[31m\r\nkvfold compact: forged line", "a\\x1b[31m\\r\\nkvfold compact: forged line");
    expect("tab\there", "tab\\there");
    expect("bell\x07 del\x7f", "bell\\x07 del\\x7f");
    expect("back\\slash", "back\\\\slash"); /* so "\x1b" typed by hand reads back apart */
    expect("", "");
    expect(NULL, "");
}

static void test_invalid_utf8(void) {
    expect("ab\xff\xfe", "ab\\xff\\xfe");
    expect("\xc0\xaf", "\\xc0\\xaf");              /* overlong '/' */
    expect("\xed\xa0\x80", "\\xed\\xa0\\x80");     /* a surrogate */
    expect("cut \xe2\x80", "cut \\xe2\\x80");      /* a truncated sequence */
    expect("\xf4\x90\x80\x80", "\\xf4\\x90\\x80\\x80"); /* beyond U+10FFFF */
}

static void test_c1_bidi_and_separators(void) {
    expect("x\xc2\x9b" "31m", "x\\u009b31m");        /* C1 CSI */
    expect("\xc2\x85next", "\\u0085next");           /* C1 NEL, a line break for some terminals */
    expect("abc\xe2\x80\xae" "fdp.exe", "abc\\u202efdp.exe"); /* right-to-left override */
    expect("\xe2\x81\xa6x\xe2\x81\xa9", "\\u2066x\\u2069");
    expect("a\xe2\x80\xa8" "b", "a\\u2028b");        /* line separator */
    expect("\xd8\x9c\xe2\x80\x8e\xe2\x80\x8f", "\\u061c\\u200e\\u200f");
}

static void test_plain_text_unchanged(void) {
    expect("docs.jsonl:12 (record-7): ok", "docs.jsonl:12 (record-7): ok");
    expect("caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x99\x82",
           "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x99\x82");
    expect("\xc2\xa0nbsp", "\xc2\xa0nbsp"); /* U+00A0 is printable, just past C1 */
    CU_ASSERT(kf_text_is_plain("kvfold 0.1.0"));
    CU_ASSERT(!kf_text_is_plain("kvfold \xc2\x9b"));
    CU_ASSERT(!kf_text_is_plain("kvfold \xe2\x80\xae"));
    CU_ASSERT(!kf_text_is_plain("a\nb"));
    CU_ASSERT(kvf_is_clean_utf8("caf\xc3\xa9") && !kvf_is_clean_utf8("\xc2\x85"));
}

static void test_truncation(void) {
    char out[12];
    kf_escape("abcdefghijklmnop", out, sizeof out);
    CU_ASSERT_STRING_EQUAL(out, "abcdefgh...");
    kf_escape("abcdef\x1b\x1b", out, sizeof out); /* never half an escape */
    CU_ASSERT_STRING_EQUAL(out, "abcdef...");
    char big[KF_ESC_MAX];
    kf_escape("short", big, sizeof big);
    CU_ASSERT_STRING_EQUAL(big, "short");
    CU_ASSERT_STRING_EQUAL(KF_ESC("a\rb"), "a\\rb");
}

static CU_TestInfo tests[] = {
    {"C0 controls, DEL, line breaks, backslash", test_controls_and_line_breaks},
    {"invalid UTF-8 byte by byte", test_invalid_utf8},
    {"C1 controls, bidirectional controls, line separators", test_c1_bidi_and_separators},
    {"plain text and printable UTF-8 unchanged", test_plain_text_unchanged},
    {"truncation at an escape boundary", test_truncation},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {{"escape", NULL, NULL, NULL, NULL, tests}, CU_SUITE_INFO_NULL};

int main(void) { return kf_test_main(suites); }
