"""Every scheduler scenario of the stand-in suite (test_connector.py, test_async.py, test_e2e.py,
test_requests.py, test_config.py in tests/connector), run on vLLM's real scheduler: conftest.py made harness.Engine the
RealEngine before those modules were imported, so the same test functions drive it."""
import pytest

import test_async
import test_config
import test_connector
import test_e2e
import test_requests

# Not scheduler scenarios (prompt building, layout detection, the C copy and loader), or about
# the stand-in itself: they run in the stand-in suite only.
NOT_SCENARIOS = {"test_import_is_cheap", "test_prompt_placeholders", "test_prompt_id_range_from_model_dir",
                 "test_detect_layout_by_shape", "test_stub_follows_vllm", "test_stand_in_refuses_unknown_load_reports",
                 "test_head_major_decode_copies_the_same_blocks", "test_frames_agree",
                 "test_prompt_checks_question_ids", "test_cache_key_needs_the_payload_digest",
                 # the stand-in's context-parallel ranks (vLLM's need a process group per rank)
                 "test_context_parallel_ranks_write_their_tokens"}

for _mod in (test_connector, test_async, test_e2e, test_requests, test_config):
    for _name, _value in vars(_mod).items():
        if _name.startswith("test_") and _name not in NOT_SCENARIOS and not _name.startswith("test_c_"):
            globals()[_name] = _value
        elif not _name.startswith("test_") and hasattr(_value, "_pytestfixturefunction"):
            globals()[_name] = _value  # fixtures (root, gate, setup)


@pytest.mark.parametrize("policy", ["recompute"])  # this vLLM always has the setting (its default: "fail")
def test_refuses_to_start_unless_failure_policy_is_fail(root, policy):
    test_connector.test_refuses_to_start_unless_failure_policy_is_fail(root, policy)
