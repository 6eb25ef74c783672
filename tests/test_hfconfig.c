#include "test_util.h"
static void test_placeholder(void) { CU_ASSERT(1); }
static CU_TestInfo tests[] = {{"placeholder", test_placeholder}, CU_TEST_INFO_NULL};
static CU_SuiteInfo suites[] = {{"test_hfconfig", NULL, NULL, NULL, NULL, tests}, CU_SUITE_INFO_NULL};
int main(void) { return kf_test_main(suites); }
