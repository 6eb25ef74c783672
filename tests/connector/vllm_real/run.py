"""Runs the real-scheduler suite (ctest pytest_connector_vllm_real).

    run.py --source SOURCE --unpack-dir DIR [pytest args...]

SOURCE (the CMake cache variable KVFOLD_VLLM_SOURCE): vLLM's Python source, as a directory
holding an unpacked `vllm/` package, or tarballs (.tar.xz/.tar.gz/.tar) of it and of pydantic 2
for this Python (vLLM's config classes need pydantic 2; Debian 12 has 1), given as files or as a
directory holding them. Tarballs are unpacked once into DIR (the build tree). With SOURCE empty,
an installed `vllm` package is used. With neither, the suite does not run: exit 77 (ctest
SKIP_RETURN_CODE: "Not Run") with how to provide vLLM.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
NOT_RUN = 77
HOW_TO = """vllm_real: not run: no vLLM to test against.
  Either install vLLM for this Python ({python}), or configure with its source snapshot:
    cmake -S . -B build -DKVFOLD_VLLM_SOURCE=/path/to/dir
  where the directory holds vLLM's Python source unpacked (a vllm/ package) or as a tarball
  (vllm-*.tar.xz), plus pydantic 2 for this Python as a tarball or unpacked beside it
  (tools/setup.sh --vllm-source DIR does the same)."""


def tarballs(source: str) -> List[str]:
    ends = (".tar.xz", ".tar.gz", ".tgz", ".tar")
    if os.path.isfile(source):
        return [source]
    return sorted(os.path.join(source, f) for f in os.listdir(source) if f.endswith(ends))


def find_vllm(root: str) -> Optional[str]:
    """The directory holding vllm/__init__.py under root (at most two levels down)."""
    for dirpath, dirnames, _ in os.walk(root):
        if os.path.isfile(os.path.join(dirpath, "vllm", "__init__.py")):
            return dirpath
        if dirpath[len(root):].count(os.sep) >= 2:
            dirnames[:] = []
    return None


def unpack(sources: List[str], dest: str) -> str:
    """Unpacks the tarballs into dest once (again when any changed); returns dest."""
    stamp = os.path.join(dest, ".unpacked")
    want = "\n".join(f"{os.path.abspath(s)} {os.path.getsize(s)} {os.stat(s).st_mtime_ns}" for s in sources)
    if os.path.exists(stamp) and open(stamp).read() == want:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for s in sources:
        with tarfile.open(s) as t:
            for m in t.getmembers():  # nothing may land, or link, outside dest
                inside = [os.path.join(dest, m.name)]
                if m.issym():
                    inside.append(os.path.join(dest, os.path.dirname(m.name), m.linkname))
                elif m.islnk():
                    inside.append(os.path.join(dest, m.linkname))
                root = os.path.realpath(dest) + os.sep
                if not all(os.path.abspath(p).startswith(root) for p in inside) or m.isdev():
                    raise SystemExit(f"vllm_real: {s}: member {m.name} would land outside {dest}")
            t.extractall(dest)
    with open(stamp, "w") as f:
        f.write(want)
    return dest


def vllm_path(source: str, unpack_dir: str) -> List[str]:
    """Directories to put first on sys.path; [] for the installed vllm; None when there is none."""
    if not source:
        return [] if importlib.util.find_spec("vllm") is not None else None
    for p in source.split(os.pathsep):
        if not os.path.exists(p):
            raise SystemExit(f"vllm_real: KVFOLD_VLLM_SOURCE {p}: no such file or directory")
    dirs, archives = [], []
    for p in source.split(os.pathsep):
        found = find_vllm(p) if os.path.isdir(p) else None
        if found:
            dirs.append(found)
        archives += [] if found else tarballs(p)
    if archives:
        site = unpack(archives, unpack_dir)
        dirs += [site] + [os.path.join(site, d) for d in sorted(os.listdir(site)) if find_vllm(os.path.join(site, d))]
    if not any(find_vllm(d) == d for d in dirs):
        raise SystemExit(f"vllm_real: KVFOLD_VLLM_SOURCE {source}: holds no vllm/ package (unpacked or as a tarball)")
    return dirs


def main(argv: List[str]) -> int:
    source, unpack_dir, rest = "", os.path.join(os.getcwd(), "vllm_real"), []
    it = iter(argv)
    for a in it:
        if a == "--source":
            source = next(it)
        elif a == "--unpack-dir":
            unpack_dir = next(it)
        else:
            rest.append(a)
    path = vllm_path(source, unpack_dir)
    if path is None:
        print(HOW_TO.format(python=sys.executable))
        return NOT_RUN
    env = dict(os.environ, KVFOLD_VLLM_PATH=os.pathsep.join(path), VLLM_LOGGING_LEVEL="WARNING")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--confcutdir", HERE, "--rootdir", HERE, *rest]
    if not any(os.path.exists(a.split("::")[0]) for a in rest if not a.startswith("-")):
        cmd.append(HERE)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
