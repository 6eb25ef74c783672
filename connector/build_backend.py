"""PEP 517 backend for `pip install .`: setuptools' own, reading connector/setup.py.

The repository's top level is fixed (docs/design.md) and holds pyproject.toml but no setup.py, so this
in-tree backend (pyproject.toml: backend-path = ["connector"]) points setuptools at the script
that builds the C extension. Everything else is setuptools.build_meta unchanged.
"""
from setuptools import build_meta as _setuptools


class _Backend(_setuptools._BuildMetaBackend):
    def run_setup(self, setup_script="connector/setup.py"):
        super().run_setup(setup_script)


_backend = _Backend()
get_requires_for_build_wheel = _backend.get_requires_for_build_wheel
get_requires_for_build_sdist = _backend.get_requires_for_build_sdist
prepare_metadata_for_build_wheel = _backend.prepare_metadata_for_build_wheel
build_wheel = _backend.build_wheel
build_sdist = _backend.build_sdist
