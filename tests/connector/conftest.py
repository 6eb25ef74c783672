"""Set-up for the connector suite: the kvfold package from connector/ with its C extension from
the build (KVFOLD_EXT_DIR, default build/python/kvfold), and the stand-in vllm (stub/) unless a
real vLLM is installed... the stub always wins here, so the suite tests what it documents.

Run: ctest -R pytest_connector (both stand-in profiles), or
  KVFOLD_VLLM_PROFILE=0.26 KVFOLD_EXT_DIR=build/python/kvfold KVFOLD_CONNTEST_LIB=build/tests/libkf_conntest.so \
      /usr/bin/python3 -m pytest -q tests/connector
KVFOLD_VLLM_PROFILE picks the stand-in vllm's profile: 0.25 (v0.17-v0.25, 5-D layouts; the
default) or 0.26 (v0.26+, packed layout); see stub/vllm/__init__.py.
"""
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SRC = os.path.join(REPO, "connector", "kvfold")
EXT_DIR = os.environ.get("KVFOLD_EXT_DIR") or os.path.join(REPO, "build", "python", "kvfold")
DATA = os.environ.get("KF_TEST_DATA") or os.path.join(REPO, "tests", "data")

# vllm_real/ runs the same scenarios on vLLM's real scheduler, in its own pytest run (its run.py)
collect_ignore = ["vllm_real"]

sys.path.insert(0, os.path.join(HERE, "stub"))
sys.path.insert(0, HERE)


def load_kvfold():
    """Import kvfold from the sources, with the extension module searched in EXT_DIR too."""
    if "kvfold" in sys.modules:
        return sys.modules["kvfold"]
    spec = importlib.util.spec_from_file_location("kvfold", os.path.join(SRC, "__init__.py"),
                                                  submodule_search_locations=[SRC, EXT_DIR])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvfold"] = mod
    spec.loader.exec_module(mod)
    return mod


load_kvfold()
