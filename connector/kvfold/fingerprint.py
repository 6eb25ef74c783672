"""The served model's fingerprint from the compactor's cache file, DIR/.kvfold-fingerprint
(compactor/fingerprint.h), used only while it still describes the weights that are served.

The file names the files the fingerprint was computed from: config.json, the index when there is
one, and the weight files kvfold's loader opened. It is used only when
  - those are exactly the files the loader (and vLLM) would choose now: the index's shards when
    model.safetensors.index.json exists, else model.safetensors and no other *.safetensors (vLLM
    would load them all); an index or shards added beside the weights change the choice;
  - each file has the recorded size, mtime, inode and ctime (a write that restores the mtime still
    moves the ctime; a file replaced by another has another inode).
Otherwise the fingerprint is unknown and the reason is returned, for the log.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Optional, Tuple

CACHE_FILE = ".kvfold-fingerprint"
FORMAT = "kvfold-fingerprint 2"
INDEX = "model.safetensors.index.json"


def loaded_files(model_dir: str) -> List[str]:
    """config.json, the index when there is one, and the weight files kvfold's loader opens (names
    in model_dir); ValueError when the directory holds no such choice or vLLM's would differ."""
    index = os.path.join(model_dir, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            data = json.load(f)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: no weight_map of file names")
        shards = list(dict.fromkeys(weight_map.values()))  # distinct, in the order first named
        return ["config.json", INDEX, *shards]
    found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    if found != ["model.safetensors"]:
        raise ValueError(f"{model_dir}: weight files {found[:4]} without {INDEX}: kvfold loads model.safetensors "
                         "only, vLLM every *.safetensors")
    return ["config.json", "model.safetensors"]


def _stat_key(path: str) -> Tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def read_fingerprint_cache(model_dir: str) -> Tuple[Optional[str], str]:
    """(fingerprint, "") when DIR/.kvfold-fingerprint still describes the weights served from
    model_dir, else (None, why not)."""
    path = os.path.join(model_dir, CACHE_FILE)
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path}: cannot be read ({e})"
    if not lines or lines[0] != FORMAT:
        return None, f"{path}: not a {FORMAT} file (written by another kvfold: compact again to refresh it)"
    fp, recorded = None, {}  # type: Optional[str], Dict[str, Tuple[int, ...]]
    try:
        for line in lines[1:]:
            parts = line.split(" ")
            if parts[0] == "file" and len(parts) == 6:
                recorded[parts[1]] = tuple(int(x) for x in parts[2:])
            elif parts[0] == "fingerprint" and len(parts) == 2:
                fp = parts[1]
        want = loaded_files(model_dir)
        if sorted(recorded) != sorted(want):
            return None, f"{path}: computed from {sorted(recorded)}, the loader now reads {sorted(want)}"
        for name, key in recorded.items():
            if _stat_key(os.path.join(model_dir, name)) != key:
                return None, f"{path}: {name} changed since the fingerprint was computed"
    except (OSError, ValueError) as e:
        return None, f"{path}: {e}"
    if not fp:
        return None, f"{path}: no fingerprint line"
    return fp, ""
