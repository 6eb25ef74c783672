"""Builds kvfold._kvfold (see pyproject.toml): the C extension from the project's own sources.

pip runs this from the repository root through connector/build_backend.py (the top level of the
repository holds no setup.py), so the paths below are relative to the root.

Compiler and linker flags of hdf5-serial, libxxhash, jansson, libpcre2-8 and libutf8proc (the
tokenizer) come from pkg-config; nothing is downloaded.
"""
import re
import shlex
import subprocess
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent.parent  # the repository root


def pkg_config(*args: str) -> list:
    try:
        out = subprocess.run(["pkg-config", *args], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"kvfold: pkg-config {' '.join(args)} failed ({e}); "
                         "install pkg-config, libhdf5-dev, libxxhash-dev, libjansson-dev, libpcre2-dev and libutf8proc-dev") from e
    return shlex.split(out)


def version() -> str:
    m = re.search(r"project\(kvfold VERSION ([0-9.]+)", (HERE / "CMakeLists.txt").read_text())
    return m.group(1) if m else "0.0.0"


PKGS = ["hdf5-serial", "libxxhash", "jansson", "libpcre2-8", "libutf8proc"]
cflags = pkg_config("--cflags", *PKGS)
libs = pkg_config("--libs", *PKGS)

ext = Extension(
    "kvfold._kvfold",
    sources=[
        "connector/ext/kvfold_ext.c",
        "connector/ext/blockcopy.c",
        "connector/ext/tokenizer_ext.c",
        "kernels/base/error.c",
        "kernels/base/dtype.c",
        "kernels/base/convert.c",
        "kernels/base/method.c",
        "formats/escape.c",
        "formats/kvf.c",
        "formats/kvf_read.c",
        "formats/kvf_read_header.c",
        "formats/kvf_check.c",
        "formats/kvf_write.c",
        "formats/tokenizer.c",
        "formats/tokenizer_encode.c",
        "formats/tokenizer_bpe.c",
        "formats/tokenizer_hash.c",
        "formats/tokenizer_pretok.c",
    ],
    include_dirs=["."] + [f[2:] for f in cflags if f.startswith("-I")],
    library_dirs=[f[2:] for f in libs if f.startswith("-L")],
    libraries=[f[2:] for f in libs if f.startswith("-l")] + ["m"],
    define_macros=[("_GNU_SOURCE", None), ("KVFOLD_VERSION", f'"{version()}"')],
    extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden"]
    + [f for f in cflags if not f.startswith("-I")],
    extra_link_args=["-pthread"],
)

# build-py/, not build/: build/ is the CMake build directory by the project's convention.
setup(ext_modules=[ext], options={"build": {"build_base": "build-py"}})
