"""KVFoldConnector: vLLM's v1 KV connector that fills a request's first C KV slots from a kvf file.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVFoldConnector",
        "kv_connector_module_path": "kvfold.connector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"cache_root": "/caches"}}'

A request names its cache in kv_transfer_params["kvfold"] (kvfold.prompt builds it) and its prompt
is the cache's C placeholder ids followed by the question. Scheduler side: the request is
claimed (C tokens, minus the local prefix-cache hit) when the prompt and the file check out. When
a request names a cache that cannot be served (missing, corrupt or another model's file, a prompt
whose placeholders do not match), the connector still claims its leading placeholder tokens and
the worker reports their blocks through get_block_ids_with_load_errors, so vLLM (with its default
kv_load_failure_policy "fail") fails the request instead of attending to placeholder ids. Set
extra config "on_invalid": "ignore" to claim nothing instead (vLLM then computes the prompt as
given). A request without kvfold parameters is left alone: (0, False).

Worker side: the load is synchronous, in start_load_kv, from the block ids in the connector
metadata (never from attention metadata, which can be None); the per-layer hooks do nothing.
Decoded caches stay in a host retention pool (kvfold.pool).

kv_connector_extra_config:
  cache_root         directory of kvf files; relative names resolve under it and absolute ones must
                     lie inside it (set it on servers). Default: $KVFOLD_CACHE_ROOT, else any path.
  model_fingerprint  the served model's fingerprint (`kvfold model-info DIR`); default: read from
                     DIR/.kvfold-fingerprint when the compactor left one for these exact weights.
                     Without it, files are checked against the model's shape only (logged).
  pool_bytes         retention pool limit (default 4 GiB; 0 disables retention)
  on_invalid         "fail" (default) or "ignore"
  kv_layout          "flash_attn", "flashinfer"/"triton" or "cpu" when the shape is ambiguous
  copy_backend       "auto" (C for host tensors, torch otherwise) or "torch"
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                  KVConnectorRole)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"kvfold.connector runs inside vLLM, and importing vLLM's connector API failed: {e}") from e

from . import _kvfold
from .blocks import check_block_size, copy_to_blocks, detect_layout, dtype_name
from .pool import RetentionPool
from .prompt import PARAMS_KEY, PLACEHOLDER_SCHEME, cache_key, placeholder_ids

logger = logging.getLogger("kvfold.connector")

DEFAULT_POOL_BYTES = 4 << 30
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass
class LoadSpec:
    """One request's load for one step (plain types: the metadata is pickled to every TP rank)."""
    req_id: str
    path: Optional[str]     # None when the load must fail
    reason: Optional[str]   # why it fails
    key: str
    n_tokens: int           # C
    block_ids: List[int]    # all the request's blocks, in token order
    t0: int                 # tokens [t0, t1) come from the file (t0 = the local prefix-cache hit)
    t1: int


@dataclass
class KVFoldMetadata(KVConnectorMetadata):
    block_size: int
    loads: List[LoadSpec] = field(default_factory=list)


@dataclass
class _Decision:
    claim: int              # tokens claimed from position 0: C, or the placeholder run of a failing request
    path: Optional[str]
    reason: Optional[str]
    key: str
    n_tokens: int


def _extra(vllm_config: Any) -> Dict[str, Any]:
    cfg = getattr(vllm_config, "kv_transfer_config", None)
    return dict(getattr(cfg, "kv_connector_extra_config", None) or {})


def read_fingerprint_cache(model_dir: str) -> Optional[str]:
    """The fingerprint the compactor stored in model_dir/.kvfold-fingerprint, when every file it
    was computed from still has the recorded size and mtime (compactor/fingerprint.h)."""
    path = os.path.join(model_dir, ".kvfold-fingerprint")
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    if not lines or lines[0] != "kvfold-fingerprint 1":
        return None
    fp = None
    for line in lines[1:]:
        parts = line.split(" ")
        if parts[0] == "file" and len(parts) == 4:
            try:
                st = os.stat(os.path.join(model_dir, parts[1]))
            except OSError:
                return None
            if st.st_size != int(parts[2]) or st.st_mtime_ns != int(parts[3]):
                return None
        elif parts[0] == "fingerprint" and len(parts) == 2:
            fp = parts[1]
    return fp


class KVFoldConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = _extra(vllm_config)
        mc = vllm_config.model_config
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        self._block_size = self._manager_block_size(vllm_config, kv_cache_config)
        self._n_layers = int(mc.get_total_num_hidden_layers())
        self._kv_heads = int(mc.get_total_num_kv_heads())
        self._head_dim = int(mc.get_head_size())
        self._vocab = int(mc.get_vocab_size())
        self._cache_root = extra.get("cache_root") or os.environ.get("KVFOLD_CACHE_ROOT") or None
        self._on_invalid = str(extra.get("on_invalid", "fail"))
        if self._on_invalid not in ("fail", "ignore"):
            raise ValueError(f"kvfold: on_invalid must be 'fail' or 'ignore', not {self._on_invalid!r}")
        self._model_fp = extra.get("model_fingerprint") or (
            read_fingerprint_cache(mc.model) if isinstance(mc.model, str) and os.path.isdir(mc.model) else None)
        if not self._model_fp:
            logger.warning("kvfold: the model's fingerprint is unknown (set kv_connector_extra_config "
                           "'model_fingerprint' from `kvfold model-info`); cache files are checked against "
                           "the model's shape only")
        if self._cache_root is None and self._is_scheduler:
            logger.warning("kvfold: no cache_root: requests may name any readable kvf file")
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
        if policy != "fail" and self._on_invalid == "fail" and self._is_scheduler:
            logger.warning("kvfold: kv_load_failure_policy=%r: a failed load is recomputed from placeholder "
                           "ids; use 'fail'", policy)
        # scheduler state
        self._decisions: Dict[str, Optional[_Decision]] = {}
        self._pending: Dict[str, LoadSpec] = {}
        self._headers: Dict[Tuple[str, int, int, int], Dict[str, Any]] = {}
        # worker state
        self._kv_layout_override = extra.get("kv_layout")
        self._use_torch = extra.get("copy_backend", "auto") == "torch"
        self._pool = RetentionPool(int(extra.get("pool_bytes", DEFAULT_POOL_BYTES)))
        self._tensors: List[Any] = []
        self._layout = ""
        self._dtype = ""
        self._head_start = 0
        self._local_heads = 0
        self._load_errors: set = set()
        self.last_loads: List[Tuple[str, bool]] = []  # (req_id, pool hit) of the last step, for tests

    @staticmethod
    def _manager_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups:
            return int(groups[0].kv_cache_spec.block_size)
        return int(vllm_config.cache_config.block_size)

    # ---- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        d = self._decide(request)
        if d is None or d.claim <= 0:
            return 0, False
        return max(0, d.claim - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        d = self._decisions.get(request.request_id)
        if d is None:
            return
        block_ids = [int(b) for b in blocks.get_block_ids()[0]]
        self._pending[request.request_id] = LoadSpec(request.request_id, d.path, d.reason, d.key, d.n_tokens,
                                                     block_ids, d.claim - num_external_tokens, d.claim)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KVFoldMetadata(self._block_size, list(self._pending.values()))
        self._pending.clear()
        return meta

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self._decisions.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        return False, None

    def _decide(self, request: Any) -> Optional[_Decision]:
        """Side-effect free for vLLM: the same answer each time it asks about a request."""
        rid = request.request_id
        if rid in self._decisions:
            return self._decisions[rid]
        params = getattr(request, "kv_transfer_params", None)
        spec = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if spec is None:
            return None
        d = self._evaluate(request, spec)
        if d.reason:
            action = f"failing its first {d.claim} tokens" if d.claim else "claiming nothing"
            logger.warning("kvfold: request %s: %s (%s)", rid, d.reason, action)
        self._decisions[rid] = d
        return d

    def _evaluate(self, request: Any, spec: Any) -> _Decision:
        try:
            C, key, id_range = int(spec["n_tokens"]), str(spec["key"]), int(spec["id_range"])
            name = str(spec["cache"])
            scheme = spec.get("scheme", PLACEHOLDER_SCHEME)
        except (KeyError, TypeError, ValueError, AttributeError):
            return _Decision(0, None, f"malformed kv_transfer_params['{PARAMS_KEY}']: {spec!r}", "", 0)
        if scheme != PLACEHOLDER_SCHEME or C < 1 or not 2 <= id_range <= self._vocab:
            return _Decision(0, None, f"unsupported placeholders (scheme {scheme}, {C} ids below {id_range}, "
                                      f"vocab {self._vocab})", key, C)
        prompt = request.prompt_token_ids
        T = len(prompt)
        expected = placeholder_ids(key, C, id_range)
        run = 0
        while run < min(C, T) and prompt[run] == expected[run]:
            run += 1
        fail_claim = lambda n: n if self._on_invalid == "fail" else 0  # noqa: E731
        if run < C or T < C + 1:
            why = (f"prompt of {T} tokens starts with {run} of the cache's {C} placeholder ids" if run < C else
                   f"prompt holds only the {C} placeholder ids: nothing after them for vLLM to compute")
            return _Decision(fail_claim(min(run, T - 1)), None, why, key, C)
        try:
            path = self._resolve(name)
            h = self._header(path)
            self._check_header(h, path, key, C)
        except (OSError, ValueError, _kvfold.KvfError) as e:
            return _Decision(fail_claim(C), None, str(e), key, C)
        return _Decision(C, path, None, key, C)

    def _resolve(self, name: str) -> str:
        root = self._cache_root
        if not os.path.isabs(name):
            if not root:
                raise ValueError(f"{name}: a relative cache name needs kv_connector_extra_config 'cache_root'")
            name = os.path.join(root, name)
        path = os.path.realpath(name)
        if root:
            rroot = os.path.realpath(root)
            if os.path.commonpath([path, rroot]) != rroot:
                raise ValueError(f"{name}: outside cache_root {root}")
        return path

    def _header(self, path: str) -> Dict[str, Any]:
        st = os.stat(path)  # FileNotFoundError names the path
        k = (path, st.st_ino, st.st_size, st.st_mtime_ns)
        h = self._headers.get(k)
        if h is None:
            h = _kvfold.read_header(path)
            if len(self._headers) > 4096:
                self._headers.clear()
            self._headers[k] = h
        return h

    def _check_header(self, h: Dict[str, Any], path: str, key: str, C: int) -> None:
        if self._model_fp and h["model_fingerprint"] != self._model_fp:
            raise ValueError(f"{path}: written for model {h['model_fingerprint']}, not for the served model "
                             f"{self._model_fp}")
        if (h["n_layers"], h["kv_heads"], h["head_dim"]) != (self._n_layers, self._kv_heads, self._head_dim):
            raise ValueError(f"{path}: holds {h['n_layers']} layers x {h['kv_heads']} kv heads x head_dim "
                             f"{h['head_dim']}, the served model has {self._n_layers} x {self._kv_heads} x "
                             f"{self._head_dim}")
        if h["method"] == "am" or h["rope_frame"] != "compacted":
            raise ValueError(f"{path}: method {h['method']}, rope_frame {h['rope_frame']}: needs an attention "
                             "bias or position offset vLLM lacks (compact with method fold)")
        if int(h["n_tokens"]) != C:
            raise ValueError(f"{path}: holds {h['n_tokens']} slots, the request reserves {C}")
        if cache_key(h) != key:
            raise ValueError(f"{path}: is not the cache the prompt was built for (file {cache_key(h)}, "
                             f"prompt {key})")

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        by_index: Dict[int, Tuple[str, Any]] = {}
        seen = set()
        for pos, (name, t) in enumerate(kv_caches.items()):
            if isinstance(t, (list, tuple)):  # vLLM before 2026-03: one tensor per virtual engine
                t = t[0]
            m = _LAYER_RE.search(name)
            idx = int(m.group(1)) if m else pos
            if t.data_ptr() in seen:  # a layer sharing another layer's KV: written once, as its owner
                continue
            seen.add(t.data_ptr())
            by_index.setdefault(idx, (name, t))
        order = sorted(by_index)
        if order != list(range(self._n_layers)):
            raise ValueError(f"kvfold: KV caches of layers {order} registered; the connector needs every layer "
                             f"0..{self._n_layers - 1} on this worker (pipeline parallelism is not supported)")
        self._tensors = [by_index[i][1] for i in order]
        first = self._tensors[0]
        self._dtype = dtype_name(first.dtype)
        if self._dtype == "float32":
            raise ValueError("kvfold: float32 KV caches are not supported (bfloat16 or float16)")
        check_block_size(self._block_size)
        tp_rank, tp_size = _tp_rank_size()
        local_heads = max(1, self._kv_heads // tp_size)
        self._head_start = tp_rank * self._kv_heads // tp_size
        self._local_heads = local_heads
        layouts = set()
        for i, t in enumerate(self._tensors):
            if t.dtype != first.dtype or tuple(t.shape) != tuple(first.shape) or t.device != first.device:
                raise ValueError(f"kvfold: layer {by_index[i][0]}: {t.dtype} {tuple(t.shape)} on {t.device} "
                                 f"differs from layer 0")
            layouts.add(detect_layout(t.shape, self._block_size, local_heads, self._head_dim, t.device.type,
                                      self._kv_layout_override, by_index[i][0]))
        self._layout = layouts.pop()
        logger.info("kvfold: %d layers, layout %s, %s, heads %d..%d of %d, blocks of %d", len(self._tensors),
                    self._layout, self._dtype, self._head_start, self._head_start + local_heads - 1,
                    self._kv_heads, self._block_size)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.last_loads = []
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, KVFoldMetadata):
            return
        for spec in meta.loads:
            self._load(spec, meta.block_size)

    def _load(self, spec: LoadSpec, block_size: int) -> None:
        try:
            if spec.reason:
                raise ValueError(spec.reason)
            if not self._tensors:
                raise ValueError("no KV caches registered")
            path = spec.path
            entry, hit = self._pool.get(path, self._dtype, lambda: _kvfold.load(
                path, self._dtype, self._model_fp, self._n_layers, self._kv_heads, self._head_dim))
            h = entry.header
            if cache_key(h) != spec.key:
                raise ValueError(f"{path}: changed since the request was scheduled")
            copy_to_blocks(entry.data, self._dtype, h["n_layers"], h["n_tokens"], h["kv_heads"], h["head_dim"],
                           self._tensors, self._layout, spec.block_ids, block_size, spec.t0, spec.t1,
                           self._head_start, self._use_torch, self._local_heads)
            self.last_loads.append((spec.req_id, hit))
        except Exception as e:  # every failure becomes a load error: vLLM then fails the request
            if spec.t1 > spec.t0:
                self._load_errors.update(spec.block_ids[spec.t0 // block_size:(spec.t1 - 1) // block_size + 1])
            logger.error("kvfold: request %s: KV of tokens [%d, %d) not loaded: %s", spec.req_id, spec.t0,
                         spec.t1, e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # the load finished in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # a consumer: nothing is saved

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set) -> Tuple[Optional[set], Optional[set]]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def handle_preemptions(self, *args: Any, **kwargs: Any) -> None:
        return None  # loads are synchronous: nothing in flight to cancel

    def shutdown(self) -> None:
        self._pool.evict()
        self._tensors = []


def _tp_rank_size() -> Tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)
        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except (ImportError, AssertionError, AttributeError):  # no distributed state (tests, single process)
        return 0, 1
