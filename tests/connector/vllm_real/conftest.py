"""Set-up for the real-scheduler suite: vLLM from KVFOLD_VLLM_PATH (directories put first on
sys.path: an unpacked source snapshot and pydantic 2; run.py makes them) or the installed
package, kvfold from connector/ with its C extension from the build (KVFOLD_EXT_DIR), and the
stand-in suite's modules (harness, util, test_connector, test_async) importable, with
harness.Engine meaning RealEngine. The stand-in's conftest (tests/connector/conftest.py) is not
loaded: run with --confcutdir pointing here (run.py does).
"""
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONNECTOR_TESTS = os.path.dirname(HERE)
REPO = os.path.dirname(os.path.dirname(CONNECTOR_TESTS))
SRC = os.path.join(REPO, "connector", "kvfold")
EXT_DIR = os.environ.get("KVFOLD_EXT_DIR") or os.path.join(REPO, "build", "python", "kvfold")
DATA = os.environ.get("KF_TEST_DATA") or os.path.join(REPO, "tests", "data")

sys.path[:0] = [HERE, CONNECTOR_TESTS]
import vllm_import  # noqa: E402

paths = [p for p in os.environ.get("KVFOLD_VLLM_PATH", "").split(os.pathsep) if p]
for p in reversed(paths):
    sys.path.insert(0, p)
vllm_import.prepare()
import vllm  # noqa: E402,F401
import vllm.v1.core.sched.scheduler  # noqa: E402,F401

vllm_import.one_process_tp_group()
VLLM_DIR = os.path.dirname(os.path.abspath(vllm.__file__))


def _load_kvfold():
    spec = importlib.util.spec_from_file_location("kvfold", os.path.join(SRC, "__init__.py"),
                                                  submodule_search_locations=[SRC, EXT_DIR])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvfold"] = mod
    spec.loader.exec_module(mod)


_load_kvfold()

import engine  # noqa: E402
import harness  # noqa: E402

engine.RealEngine.vllm_dir = VLLM_DIR
harness.Engine = engine.RealEngine  # the stand-in suite's scenarios, on the real scheduler


def pytest_report_header(config):
    lines = [f"vLLM: {VLLM_DIR} (version {vllm.__version__})", "replaced to import vLLM's scheduler here:"]
    return lines + ["  - " + line for line in vllm_import.report()]
