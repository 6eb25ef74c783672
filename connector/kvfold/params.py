"""kv_transfer_params["kvfold"] of one request, checked before the connector does any work.

A client sends these values, so each is checked for its type and range: integers as ints (not
bools, floats or strings) within bounds, strings within a length. The connector then builds only
as many placeholder ids as the prompt holds (a claim of 10^9 placeholders on a 20-token prompt
costs nothing). parse_params raises ValueError with a message naming the entry and the
cause, never anything else; messages show values through show(), which stays short whatever the
value (a huge list, string or int).
"""
from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

from .prompt import PARAMS_KEY, PLACEHOLDER_SCHEME

MAX_NAME = 4096  # bytes of a cache name (PATH_MAX)
MAX_KEY = 1024   # characters of a cache key (a few hundred in practice)
MAX_TOKENS = 2 ** 31 - 1  # slots of a kvf file (its n_doc_tokens bound)
ENTRIES = ("cache", "n_tokens", "key", "id_range", "scheme")

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60


@dataclass(frozen=True)
class Params:
    cache: str     # the kvf file's name (relative to cache_root, or absolute)
    n_tokens: int  # C: the placeholders at the head of the prompt
    key: str       # cache_key of the file the prompt was built for
    id_range: int  # the placeholder ids lie in [0, id_range)


def show(v: Any) -> str:
    """A short description of any value, for messages."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an int of {v.bit_length()} bits"  # repr of a huge int is slow, or refused
    try:
        return f"{_repr.repr(v)} ({type(v).__name__})"
    except Exception:  # a repr that fails: its type is enough
        return f"a {type(v).__name__}"


def _int(spec: dict, name: str, lo: int, hi: int, why: str) -> int:
    v = spec[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"'{name}' must be an int, not {show(v)}")
    if not lo <= v <= hi:
        raise ValueError(f"'{name}' = {show(v)} is outside [{lo}, {hi}] ({why})")
    return int(v)


def _str(spec: dict, name: str, limit: int) -> str:
    v = spec[name]
    if not isinstance(v, str) or not v:
        raise ValueError(f"'{name}' must be a non-empty string, not {show(v)}")
    if len(v) > limit or "\x00" in v:
        raise ValueError(f"'{name}' is {'longer than ' + str(limit) if len(v) > limit else 'a string with a NUL'}"
                         " (not one kvfold.prompt builds)")
    return v


def parse_params(spec: Any, vocab: int) -> Params:
    """The checked parameters of a request served by a model of vocab ids; ValueError naming the
    first bad entry. The caller compares n_tokens with the prompt's length before it builds ids."""
    where = f"kv_transfer_params['{PARAMS_KEY}']"
    try:
        if not isinstance(spec, dict):
            raise ValueError(f"must be an object, not {show(spec)}")
        unknown = [k for k in spec if k not in ENTRIES]
        if unknown:
            raise ValueError(f"unknown entries {show(unknown)} (known: {', '.join(ENTRIES)})")
        missing = [k for k in ENTRIES if k not in spec]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (build the request with kvfold.prompt)")
        if spec["scheme"] != PLACEHOLDER_SCHEME:
            raise ValueError(f"'scheme' is {show(spec['scheme'])}: this kvfold serves "
                             f"'{PLACEHOLDER_SCHEME}' (rebuild the prompt with this kvfold's kvfold.prompt)")
        n = _int(spec, "n_tokens", 1, MAX_TOKENS, "the slots of a kvf file")
        id_range = _int(spec, "id_range", 2, vocab, f"the model's {vocab} token ids")
        return Params(_str(spec, "cache", MAX_NAME), n, _str(spec, "key", MAX_KEY), id_range)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
