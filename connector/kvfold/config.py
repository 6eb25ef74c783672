"""The connector's kv_connector_extra_config, checked when vLLM constructs the connector.

Every key is checked for its type and value at start, each failure naming the key, so that a
mistyped setting stops the server at once instead of failing every request later. Unknown keys
are refused too (a misspelt "pool_byte" would otherwise silently leave the default in force); the
message lists the known ones.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional

from .blocks import LAYOUT_ALIASES
from .params import show

DEFAULT_POOL_BYTES = 4 << 30
_FINGERPRINT = re.compile(r"[0-9a-f]{32}")  # kvf.h: 32 lowercase hex digits
_CHOICES = {"on_invalid": ("fail", "ignore"), "copy_backend": ("auto", "torch"), "load_mode": ("sync", "async")}
_INTS = {"pool_bytes": (0, 1 << 62), "load_parts": (1, 4096), "load_threads": (1, 64)}  # key -> [lo, hi]
KEYS = ("cache_root", "model_fingerprint", "kv_layout", *_CHOICES, *_INTS)


@dataclass(frozen=True)
class Config:
    cache_root: Optional[str] = None
    model_fingerprint: Optional[str] = None  # None: read from the model directory, if there
    kv_layout: Optional[str] = None
    on_invalid: str = "fail"
    copy_backend: str = "auto"
    load_mode: str = "sync"
    pool_bytes: int = DEFAULT_POOL_BYTES
    load_parts: int = 4
    load_threads: int = 2


def _bad(key: str, v: Any, want: str) -> ValueError:
    return ValueError(f"kvfold: kv_connector_extra_config '{key}' is {show(v)}; it must be {want}")


def parse_config(extra: Dict[str, Any], env: Optional[Dict[str, str]] = None) -> Config:
    """The checked config; ValueError naming the first bad key. env: os.environ by default (for
    $KVFOLD_CACHE_ROOT)."""
    env = os.environ if env is None else env
    unknown = sorted(str(k) for k in extra if k not in KEYS)
    if unknown:
        raise ValueError(f"kvfold: unknown kv_connector_extra_config keys {unknown} (known: {', '.join(KEYS)})")
    out: Dict[str, Any] = {}
    for key, v in extra.items():
        if key in _INTS:
            lo, hi = _INTS[key]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise _bad(key, v, f"an int in [{lo}, {hi}]")
        elif key in _CHOICES:
            if not isinstance(v, str) or v not in _CHOICES[key]:
                raise _bad(key, v, " or ".join(repr(c) for c in _CHOICES[key]))
        elif key == "model_fingerprint":
            if not isinstance(v, str) or not _FINGERPRINT.fullmatch(v):
                raise _bad(key, v, "the model's fingerprint: a string of 32 lowercase hex digits, as `kvfold "
                                   "model-info` prints it")
        elif key == "kv_layout":
            if not isinstance(v, str) or v.lower() not in LAYOUT_ALIASES:
                raise _bad(key, v, f"one of {', '.join(sorted(LAYOUT_ALIASES))}")
        elif key == "cache_root":
            if not isinstance(v, str) or not v or "\x00" in v:
                raise _bad(key, v, "a directory name (a non-empty string)")
        out[key] = v
    if "cache_root" not in out and env.get("KVFOLD_CACHE_ROOT"):
        out["cache_root"] = env["KVFOLD_CACHE_ROOT"]
    return Config(**out)
