"""A stand-in for vLLM in kvfold's connector tests: only the modules, classes and signatures the
connector and the test harness use, at vLLM's real module paths (research/vllm-connector.md)."""
