/* The vocabulary under kernels and formats (kernels/base/): dtypes, methods and the 16-bit float
 * conversions, against the spellings the files hold and against references computed in double
 * precision (not by the bit manipulations under test). */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "formats/kvf.h"
#include "formats/safetensors.h"
#include "kernels/base/convert.h"
#include "kernels/base/dtype.h"
#include "kernels/base/method.h"
#include "kernels/cpu/cpu_kernels.h"
#include "test_util.h"

/* ---- dtypes and methods ---- */

static const struct {
    kf_dtype dt;
    const char *name, *st; /* the canonical name, the safetensors header's spelling */
    size_t size;
} kDtypes[] = {
    {KF_DTYPE_F32, "float32", "F32", 4}, {KF_DTYPE_BF16, "bfloat16", "BF16", 2}, {KF_DTYPE_F16, "float16", "F16", 2},
    {KF_DTYPE_F64, "float64", "F64", 8}, {KF_DTYPE_I8, "int8", "I8", 1},         {KF_DTYPE_U8, "uint8", "U8", 1},
    {KF_DTYPE_I16, "int16", "I16", 2},   {KF_DTYPE_U16, "uint16", "U16", 2},     {KF_DTYPE_I32, "int32", "I32", 4},
    {KF_DTYPE_U32, "uint32", "U32", 4},  {KF_DTYPE_I64, "int64", "I64", 8},      {KF_DTYPE_U64, "uint64", "U64", 8},
    {KF_DTYPE_BOOL, "bool", "BOOL", 1},
};
#define N_DTYPES (int)(sizeof kDtypes / sizeof kDtypes[0])

static void test_dtype_names_sizes(void) {
    CU_ASSERT_EQUAL(N_DTYPES, KF_DTYPE_COUNT);
    for (int i = 0; i < N_DTYPES; i++) {
        kf_dtype back = (kf_dtype)-1;
        CU_ASSERT_EQUAL(kf_dtype_size(kDtypes[i].dt), kDtypes[i].size);
        CU_ASSERT_STRING_EQUAL(kf_dtype_name(kDtypes[i].dt), kDtypes[i].name);
        CU_ASSERT_STRING_EQUAL(kf_st_dtype_name(kDtypes[i].dt), kDtypes[i].st);
        CU_ASSERT(kf_dtype_parse(kDtypes[i].name, &back) == 0 && back == kDtypes[i].dt);
    }
    /* the numbers recipe digests hash (the arena's dtype), and 0 = fp32 for zeroed structs */
    CU_ASSERT(KF_DTYPE_F32 == 0 && KF_DTYPE_BF16 == 1 && KF_DTYPE_F16 == 2);
    static const struct {
        const char *s;
        kf_dtype dt;
    } shorts[] = {{"bf16", KF_DTYPE_BF16}, {"f16", KF_DTYPE_F16},  {"fp16", KF_DTYPE_F16},
                  {"f32", KF_DTYPE_F32},   {"fp32", KF_DTYPE_F32}, {"f64", KF_DTYPE_F64}};
    for (size_t i = 0; i < sizeof shorts / sizeof shorts[0]; i++) {
        kf_dtype back = (kf_dtype)-1;
        CU_ASSERT(kf_dtype_parse(shorts[i].s, &back) == 0 && back == shorts[i].dt);
    }
    kf_dtype keep = KF_DTYPE_I8;
    CU_ASSERT(kf_dtype_parse("BF16", &keep) != 0 && keep == KF_DTYPE_I8); /* safetensors' spelling is its own */
    CU_ASSERT(kf_dtype_parse("", &keep) != 0 && kf_dtype_parse("float8", &keep) != 0 && keep == KF_DTYPE_I8);
    CU_ASSERT_EQUAL(kf_dtype_size((kf_dtype)KF_DTYPE_COUNT), 0);
    CU_ASSERT_STRING_EQUAL(kf_dtype_name((kf_dtype)-1), "?");
    CU_ASSERT_STRING_EQUAL(kf_st_dtype_name((kf_dtype)99), "?");
}

/* The kvf file's dtype attribute: exactly three values, each standing for its dtype. */
static void test_dtype_kvf_spellings(void) {
    static const struct {
        kf_dtype dt;
        const char *attr;
    } want[] = {{KF_DTYPE_BF16, "bfloat16"}, {KF_DTYPE_F16, "float16"}, {KF_DTYPE_F32, "float32"}};
    for (int i = 0; i < 3; i++) {
        kf_dtype back = KF_DTYPE_I8;
        CU_ASSERT_PTR_NOT_NULL_FATAL(kvf_dtype_attr(want[i].dt));
        CU_ASSERT_STRING_EQUAL(kvf_dtype_attr(want[i].dt), want[i].attr);
        CU_ASSERT(kvf_dtype_parse(want[i].attr, &back) == 0 && back == want[i].dt);
    }
    int stored = 0;
    for (int i = 0; i < N_DTYPES; i++)
        stored += kvf_dtype_attr(kDtypes[i].dt) != NULL;
    CU_ASSERT_EQUAL(stored, 3);
    kf_dtype keep = KF_DTYPE_I8;
    CU_ASSERT(kvf_dtype_parse("float64", &keep) != 0 && kvf_dtype_parse("int8", &keep) != 0 && keep == KF_DTYPE_I8);
    CU_ASSERT(kvf_dtype_parse("fp16", &keep) == 0 && keep == KF_DTYPE_F16);
}

/* A method's name is the kvf method attribute and a cache file name's part; its number is the
 * file's head_method byte (formats/kvf.h: 0 keep, 1 drop, 2 am, 3 fold). */
static void test_method_names(void) {
    static const char *const names[] = {"keep", "drop", "am", "fold"};
    CU_ASSERT_EQUAL(KF_METHOD_COUNT, 4);
    CU_ASSERT(KF_METHOD_KEEP == 0 && KF_METHOD_DROP == 1 && KF_METHOD_AM == 2 && KF_METHOD_FOLD == 3);
    for (int i = 0; i < 4; i++) {
        kf_method back = (kf_method)-1;
        CU_ASSERT_STRING_EQUAL(kf_method_name((kf_method)i), names[i]);
        CU_ASSERT_PTR_NOT_NULL_FATAL(kvf_method_attr((kf_method)i));
        CU_ASSERT_STRING_EQUAL(kvf_method_attr((kf_method)i), names[i]);
        CU_ASSERT(kf_method_parse(names[i], &back) == 0 && back == (kf_method)i);
    }
    kf_method keep = KF_METHOD_AM;
    CU_ASSERT(kf_method_parse("FOLD", &keep) != 0 && kf_method_parse("", &keep) != 0 && keep == KF_METHOD_AM);
    CU_ASSERT_STRING_EQUAL(kf_method_name((kf_method)4), "?");
    CU_ASSERT_PTR_NULL(kvf_method_attr((kf_method)4));
}

/* ---- conversions ---- */

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The value of a binary16 / bfloat16 pattern from its fields, in double. */
static double ref_half_value(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return h & 0x8000 ? -v : v;
}

static double ref_bf16_value(uint16_t h) {
    const int e = (h >> 7) & 255, m = h & 127;
    const double v = e == 0 ? ldexp(m, -133) : e == 255 ? (m ? NAN : INFINITY) : ldexp(128 + m, e - 134);
    return h & 0x8000 ? -v : v;
}

/* x rounded to a float of `bits` significand bits (the leading one included) whose exponent is at
 * least emin, ties to even (nearbyint in the default rounding mode); in double. */
static double ref_round(double x, int bits, int emin) {
    int k;
    frexp(fabs(x), &k); /* |x| = f 2^k, f in [0.5, 1): exponent k - 1 */
    const int e = k - 1 < emin ? emin : k - 1;
    const double ulp = ldexp(1, e - (bits - 1));
    return nearbyint(x / ulp) * ulp;
}

/* Reference narrowing of a finite float to binary16, as a value (±inf on overflow). */
static double ref_to_half(float x) {
    const double r = ref_round(x, 11, -14);
    return fabs(r) >= 65536 ? copysign(INFINITY, x) : r;
}

static double ref_to_bf16(float x) {
    if (isinf(x))
        return x;
    const double r = ref_round(x, 8, -126);
    return fabs(r) >= ldexp(1, 128) ? copysign(INFINITY, x) : r;
}

/* The same value and the same sign (zeros: -0 and +0 differ). */
static int same(double a, double b) {
    return a == b && signbit(a) == signbit(b);
}

static void test_widen_exhaustive(void) {
    int bad_h = 0, bad_b = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        const uint16_t h = (uint16_t)i;
        const double rh = ref_half_value(h), rb = ref_bf16_value(h);
        const float fh = kf_f16_to_f32(h), fb = kf_bf16_to_f32(h);
        if (isnan(rh)) /* NaN: a NaN of the same sign and payload (quiet or not, as it was) */
            bad_h +=
                !isnan(fh) || !!signbit(fh) != (h >> 15) || (f32_bits(fh) & 0x7fffff) != (uint32_t)(h & 1023) << 13;
        else
            bad_h += !same(fh, rh);
        if (isnan(rb))
            bad_b += !isnan(fb) || f32_bits(fb) != (uint32_t)h << 16;
        else
            bad_b += !same(fb, rb);
    }
    CU_ASSERT_EQUAL(bad_h, 0);
    CU_ASSERT_EQUAL(bad_b, 0);
}

/* One float through both narrowings against the references; NaN stays a quiet NaN of its sign. */
static int narrow_bad(float x) {
    const uint16_t h = kf_f32_to_f16(x), b = kf_f32_to_bf16(x);
    const int sign = f32_bits(x) >> 31;
    if (isnan(x))
        return (h & 0x7e00) != 0x7e00 || (h >> 15) != sign || (b & 0x7fc0) != 0x7fc0 || (b >> 15) != sign;
    return !same(ref_half_value(h), ref_to_half(x)) + !same(ref_bf16_value(b), ref_to_bf16(x));
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd32(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}

/* Every 16-bit value, the midpoints between neighbours (the ties) and the floats just beside
 * them, then 2^24 random float patterns over the whole range (NaNs and subnormals included). */
static void test_narrow(void) {
    int bad = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        const double vals[2] = {ref_half_value((uint16_t)i), ref_bf16_value((uint16_t)i)};
        const double next[2] = {ref_half_value((uint16_t)(i + 1)), ref_bf16_value((uint16_t)(i + 1))};
        for (int k = 0; k < 2; k++) {
            if (!isfinite(vals[k]))
                continue;
            const float v = (float)vals[k];
            bad += narrow_bad(v) + narrow_bad(nextafterf(v, INFINITY)) + narrow_bad(nextafterf(v, -INFINITY));
            if ((i & 0x7fff) != 0x7fff && isfinite(next[k]) && signbit(next[k]) == signbit(vals[k])) {
                const float mid = (float)((vals[k] + next[k]) / 2); /* exact: 12 or 9 significant bits */
                bad += narrow_bad(mid) + narrow_bad(nextafterf(mid, INFINITY)) + narrow_bad(nextafterf(mid, -INFINITY));
            }
        }
    }
    for (int i = 0; i < (1 << 24); i++)
        bad += narrow_bad(bits_f32(rnd32()));
    const float special[] = {0.0f,       -0.0f,           INFINITY,    -INFINITY,  65504.0f,
                             65519.996f, 65520.0f,        0x1p-25f,    0x1.8p-25f, 0x1p-24f,
                             0x1p-149f,  0x1.fffffep127f, 0x1.ffp127f, NAN,        -NAN};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++)
        bad += narrow_bad(special[i]);
    CU_ASSERT_EQUAL(bad, 0);
    /* the values pinned, in case both a conversion and its reference drift */
    CU_ASSERT_EQUAL(kf_f32_to_f16(1.0f + 0x1p-11f), 0x3c00); /* tie to even */
    CU_ASSERT_EQUAL(kf_f32_to_f16(1.0f + 0x3p-11f), 0x3c02); /* tie to even, upwards */
    CU_ASSERT_EQUAL(kf_f32_to_f16(65520.0f), 0x7c00);        /* overflow */
    CU_ASSERT_EQUAL(kf_f32_to_f16(0x1.8p-25f), 0x0001);      /* above the tie: the smallest subnormal */
    CU_ASSERT_EQUAL(kf_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80); /* tie to even */
    CU_ASSERT_EQUAL(kf_f32_to_bf16(-3.0f), 0xc040);
    CU_ASSERT_EQUAL(kf_f32_to_f16(bits_f32(0x7f800001u)), 0x7e00); /* signalling NaN made quiet */
}

/* The arena's row conversions (branch-free, vectorized) and the array conversions (unaligned
 * buffers) are the scalar ones, element for element. */
static void test_rows_match_scalars(void) {
    enum { N = 4096 };
    static float x[N], back[N], wide[N + 1];
    static uint16_t row[N];
    static unsigned char raw[4 * N + 1]; /* raw + 1: unaligned */
    static const kf_dtype dts[] = {KF_DTYPE_BF16, KF_DTYPE_F16, KF_DTYPE_F32};
    int bad = 0;
    for (int rep = 0; rep < 64; rep++) {
        for (int i = 0; i < N; i++)
            x[i] = bits_f32(rnd32());
        x[0] = NAN;
        x[1] = -0.0f;
        kf_f32_to_bf16_n(row, x, N);
        kf_bf16_to_f32_n(back, row, N);
        for (int i = 0; i < N; i++) {
            bad += row[i] != kf_f32_to_bf16(x[i]);
            bad += f32_bits(back[i]) != f32_bits(kf_bf16_to_f32(row[i]));
        }
        for (int k = 0; k < 3; k++) {
            kf_convert_from_f32(raw + 1, dts[k], x, N);
            kf_convert_to_f32(wide + 1, raw + 1, dts[k], N);
            for (int i = 0; i < N; i++) {
                uint16_t s;
                uint32_t w;
                memcpy(&s, raw + 1 + 2 * i, 2);
                memcpy(&w, raw + 1 + 4 * i, 4);
                const uint16_t want = dts[k] == KF_DTYPE_BF16 ? kf_f32_to_bf16(x[i]) : kf_f32_to_f16(x[i]);
                const float wback = dts[k] == KF_DTYPE_BF16 ? kf_bf16_to_f32(want) : kf_f16_to_f32(want);
                if (dts[k] == KF_DTYPE_F32)
                    bad += w != f32_bits(x[i]) || f32_bits(wide[1 + i]) != f32_bits(x[i]);
                else
                    bad += s != want || f32_bits(wide[1 + i]) != f32_bits(wback);
            }
        }
    }
    CU_ASSERT_EQUAL(bad, 0);
}

static CU_TestInfo tests[] = {
    {"dtypes: names, sizes, parse round trips, safetensors' spellings", test_dtype_names_sizes},
    {"dtypes: the kvf dtype attribute's three values", test_dtype_kvf_spellings},
    {"methods: names, numbers, the kvf method attribute", test_method_names},
    {"bf16 and f16 widening: all 65,536 patterns against their fields", test_widen_exhaustive},
    {"bf16 and f16 narrowing: every value, tie and neighbour, 2^24 random floats", test_narrow},
    {"row and file conversions equal the scalar ones", test_rows_match_scalars},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {{"vocabulary", NULL, NULL, NULL, NULL, tests}, CU_SUITE_INFO_NULL};

int main(void) { return kf_test_main(suites); }
