"""A stand-in for vLLM in kvfold's connector tests: only the modules, classes and signatures the
connector and the test harness use, at vLLM's real module paths, written from the conformance
review (docs/connector.md), not copied.

Two profiles, chosen by KVFOLD_VLLM_PROFILE (ctest runs the suite under both):
  "0.25"  v0.17-v0.25: 5-D KV caches (FlashAttention kv-first to v0.22, blocks-first after;
          FlashInfer/Triton/FlexAttention blocks-first; CPU (2, blocks, heads, bs, D))
  "0.26"  v0.26+: every standard backend's cache is (blocks, heads, bs, 2 * head_dim)
          and the connector base class has the later defaulted members
"""
import os

PROFILE = os.environ.get("KVFOLD_VLLM_PROFILE", "0.25")
if PROFILE not in ("0.25", "0.26"):
    raise ImportError(f"KVFOLD_VLLM_PROFILE={PROFILE!r}: the stand-in vllm knows profiles 0.25 and 0.26")
__version__ = PROFILE + ".0"
