"""Prompts for a compacted cache: C placeholder token ids, then the question.

vLLM numbers the question's tokens C, C+1, ... after a loaded prefix of C slots, so the prompt
reserves exactly C positions. The placeholder ids are never embedded (the connector fills their KV
slots), but vLLM hashes them for its prefix cache: two documents must never share them, or a
second document would silently reuse the first one's KV. They are therefore a pseudo-random
sequence drawn from the cache's identity, and the request also carries a per-cache `cache_salt`.
The identity is the content: cache_key holds the file's payload digest (every K/V byte, bias,
fold direction and position, which the compaction recipe determines), so two files of one
document made with different recipes never share a placeholder id sequence or a salt.

A chat cache (`kvfold compact --chat`) holds the document as the first user turn of the model's chat
template and records the ids around it: what a question's ids begin with (the end of the
document's turn, the next turn's header) and what follows its text (the end of that turn, the
generation prompt). prompt(path, question="...") puts the question between them, so a client never
assembles template pieces; the question's text goes in as the template writes a user turn's
content (unchanged by Qwen3's template; Llama 3's trims it, so give it trimmed).
"""
from __future__ import annotations

import hashlib
import json
import numbers
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from . import _kvfold

PLACEHOLDER_SCHEME = "digest-v2"  # v2: the key holds the payload digest (v1 keys left the recipe out)
PARAMS_KEY = "kvfold"  # the entry of kv_transfer_params this connector reads
_HEX32 = re.compile(r"[0-9a-f]{32}")


def cache_key(header: Mapping[str, Any]) -> str:
    """The identity of a cache: what the placeholder ids and the salt are derived from. Its
    payload digest makes it the file's content; the other fields keep it readable."""
    payload = header.get("payload_digest")
    if not isinstance(payload, str) or not _HEX32.fullmatch(payload):
        raise ValueError(f"cache header without a payload digest ({payload!r}): a kvf file older than version 2 "
                         "cannot be served; recompact the document with this kvfold")
    return "{}/{}.{}-{!r}:lambda={!r}:C={}:{}:payload={}".format(
        header["model_fingerprint"], header["document_digest"], header["method"], float(header["budget"]),
        float(header["lambda"]), int(header["n_tokens"]), header["dtype"], payload)


def placeholder_ids(key: str, n_tokens: int, id_range: int) -> List[int]:
    """n_tokens ids in [0, id_range), drawn from SHAKE-256 of the cache key (deterministic across
    processes and machines). Any 16 consecutive ids of two different caches coincide with
    probability id_range**-16, so their prefix-cache blocks never collide."""
    if n_tokens < 0 or id_range < 2:
        raise ValueError(f"placeholder_ids: bad n_tokens {n_tokens} or id_range {id_range}")
    raw = hashlib.shake_256(f"{PLACEHOLDER_SCHEME}:{key}".encode()).digest(8 * n_tokens)
    return [int.from_bytes(raw[8 * i:8 * i + 8], "little") % id_range for i in range(n_tokens)]


SALT_PREFIX = "kvfold-"  # the connector fails any request under such a salt that it does not load


def cache_salt(key: str) -> str:
    return SALT_PREFIX + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def model_id_range(model_dir: str) -> int:
    """Ids every part of vLLM accepts for this model: below both the model's vocab_size and the
    tokenizer's size (vLLM refuses prompt ids the tokenizer does not know; Qwen3's tokenizer is
    smaller than its embedding)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    n = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 0)
    tok = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(tok):
        with open(tok) as f:
            t = json.load(f)
        ids = list(t.get("model", {}).get("vocab", {}).values()) + [a["id"] for a in t.get("added_tokens", [])]
        if ids:
            n = min(n, max(ids) + 1) if n else max(ids) + 1
    if n < 2:
        raise ValueError(f"{model_dir}: no vocab_size in config.json")
    return n


@dataclass
class Prompt:
    prompt_token_ids: List[int]
    kv_transfer_params: Dict[str, Any]
    cache_salt: str
    n_placeholders: int
    header: Dict[str, Any] = field(repr=False, default_factory=dict)

    def tokens_prompt(self) -> Dict[str, Any]:
        """A vllm TokensPrompt (a plain dict) for LLM.generate."""
        return {"prompt_token_ids": self.prompt_token_ids, "cache_salt": self.cache_salt}

    def completions_body(self, **extra: Any) -> Dict[str, Any]:
        """The JSON body of a /v1/completions request (add "model", "max_tokens", ...)."""
        return {"prompt": self.prompt_token_ids, "cache_salt": self.cache_salt,
                "kv_transfer_params": self.kv_transfer_params, **extra}


def token_id_error(ids: Sequence[Any], vocab: int, what: str = "question id") -> Optional[str]:
    """Why ids are not token ids of a vocabulary of `vocab` ids (None when they are): each must be
    an int (not a bool or a float) in [0, vocab)."""
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab):
        return None  # the common case, at C speed (a prompt of 10^5 ids costs about a millisecond)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):  # numpy ints are Integral too
            return f"{what} {i} is {str(t)[:40]!r} ({type(t).__name__}), not an int"
        if not 0 <= t < vocab:
            return f"{what} {i} is {str(t)[:40]}, outside the vocabulary [0, {vocab})"
    return None


def tokenizer_digest(model_dir: str) -> str:
    """The digest kvfold records of DIR/tokenizer.json (XXH3-128, 32 hex digits), "" without one."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        return _kvfold.bytes_digest(f.read())


def check_tokenizer(header: Mapping[str, Any], model_dir: str, cache_path: str) -> None:
    """Refuses a cache whose tokenizer is not the model's (a file or model without one passes)."""
    theirs, mine = header.get("tokenizer_digest") or "", tokenizer_digest(model_dir)
    if theirs and mine and theirs != mine:
        raise ValueError(f"{cache_path}: made with another tokenizer (tokenizer_digest {theirs}) than the model's "
                         f"{os.path.join(model_dir, 'tokenizer.json')} ({mine}): its token ids mean other text here")


def model_tokenizer(model_dir: str) -> Callable[[str], List[int]]:
    """text -> ids by DIR/tokenizer.json through kvfold's own tokenizer (the C extension's, the one
    `kvfold compact` and `kvfold tokenize` use), without special tokens: no tokenizer package needed."""
    path = os.path.join(model_dir, "tokenizer.json")
    try:
        tok = _kvfold.Tokenizer(path)
    except _kvfold.KvfError as e:
        raise ValueError(f"prompt: the tokenizer of model= cannot be read: {e}") from e
    return lambda text: tok.encode(text, add_special=False)


def _record_ids(s: str) -> List[int]:
    return [int(x) for x in s.split(",")] if s else []


def _chat_question(header: Mapping[str, Any], cache_path: str, question: Union[str, Sequence[int]],
                   model: Optional[str], tokenizer: Optional[Callable[[str], Sequence[int]]]) -> List[int]:
    """The ids after a chat cache: its recorded question prefix, the question, its recorded suffix."""
    if not header.get("chat_template_digest"):
        raise ValueError(f"{cache_path}: compacted from bare text, not through a chat template: give question_ids "
                         "(what follows the document), not question=")
    if isinstance(question, str):
        if tokenizer is None:
            if model is None:
                raise ValueError("prompt: a question's text needs tokenizer= or model= (its tokenizer.json)")
            tokenizer = model_tokenizer(model)
        ids = list(tokenizer(question))
    else:
        ids = list(question)
    if not ids:
        raise ValueError("prompt: the question is empty")
    return (_record_ids(header["chat_question_prefix_ids"]) + ids +
            _record_ids(header["chat_question_suffix_ids"]))


def prompt(cache_path: str, question_ids: Optional[Sequence[int]] = None, *, question: Union[str, Sequence[int],
           None] = None, model: Optional[str] = None, id_range: Optional[int] = None,
           cache_root: Optional[str] = None, vocab: Optional[int] = None,
           tokenizer: Optional[Callable[[str], Sequence[int]]] = None) -> Prompt:
    """Prompt token ids, kv_transfer_params and cache_salt for a question on a compacted cache.

    cache_path: the kvf file; it is named in kv_transfer_params relative to cache_root (the
    connector's kv_connector_extra_config["cache_root"]) when it lies inside it.
    question_ids: for a cache of bare text, what follows the document, >= 1 id.
    question: for a chat cache (kvfold compact --chat), the content of the user turn after the
    document's: a text (tokenized without special tokens by tokenizer=, a callable text -> ids, or
    else model='s tokenizer.json through kvfold's own tokenizer, _kvfold.Tokenizer) or its ids; the prompt puts it
    between the ids the file records (end of the document's turn and the next turn's header; end
    of the question's turn and the generation prompt). A chat cache given question_ids, or a
    bare-text cache given question=, is refused.
    model (the Hugging Face directory vLLM serves) or id_range: bounds the placeholder ids; with
    model=, the file's tokenizer digest must be the model's tokenizer.json's.
    vocab: bounds the question ids, each an int in [0, vocab) (default: id_range, which from
    model= is every id the model and its tokenizer know).
    """
    if (question_ids is None) == (question is None):
        raise ValueError("prompt: give question_ids (a bare-text cache) or question= (a chat cache), one of them")
    header = _kvfold.read_header(cache_path)
    if model is not None:
        check_tokenizer(header, model, cache_path)
    if question is not None:
        question_ids = _chat_question(header, cache_path, question, model, tokenizer)
    elif header.get("chat_template_digest"):
        raise ValueError(f"{cache_path}: compacted through a chat template ({header['chat_template_digest']}): give "
                         "question= (the user turn's content), which puts it between the template's pieces")
    question_ids = list(question_ids)
    if not question_ids:
        raise ValueError("prompt: the question must hold at least one token (vLLM computes the last one)")
    if id_range is None:
        if model is None:
            raise ValueError("prompt: give model= (the served model's directory) or id_range=")
        id_range = model_id_range(model)
    for what, n in (("id_range", id_range), ("vocab", vocab)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 2):
            raise ValueError(f"prompt: {what} must be an int >= 2, not {n!r}")
    why = token_id_error(question_ids, vocab if vocab is not None else id_range)
    if why:
        raise ValueError(f"prompt: {why}")
    question_ids = [int(t) for t in question_ids]
    if header["method"] == "am" or header["rope_frame"] != "compacted":
        raise ValueError(f"{cache_path}: method {header['method']} / rope_frame {header['rope_frame']} cannot be "
                         "served by a paged engine (compact with method fold, drop or keep)")
    key = cache_key(header)
    n = int(header["n_tokens"])
    name = os.path.abspath(cache_path)
    if cache_root:
        rel = os.path.relpath(name, os.path.abspath(cache_root))
        if not rel.startswith(".." + os.sep) and rel != "..":
            name = rel
    params = {PARAMS_KEY: {"cache": name, "n_tokens": n, "key": key, "id_range": int(id_range),
                           "scheme": PLACEHOLDER_SCHEME}}
    return Prompt(placeholder_ids(key, n, int(id_range)) + question_ids, params, cache_salt(key), n, header)
