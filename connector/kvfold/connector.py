"""KVFoldConnector: vLLM's v1 KV connector that fills a request's first C KV slots from a kvf file.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVFoldConnector",
        "kv_connector_module_path": "kvfold.connector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"cache_root": "/caches"}}'

A request names its cache in kv_transfer_params["kvfold"] (kvfold.prompt builds it) and its prompt
is the cache's C placeholder ids followed by the question. Scheduler side: the request is
claimed (C tokens, minus the local prefix-cache hit) when the prompt and the file check out. When
a request names a cache that cannot be served (missing, corrupt or another model's file, a prompt
whose placeholders do not match, a cache_salt not the cache's), the connector claims its leading
placeholder tokens (at least one token beyond the local prefix-cache hit) asynchronously and the
worker reports their blocks through get_block_ids_with_load_errors, so vLLM (whose
kv_load_failure_policy must be "fail": the connector refuses to start otherwise) fails the request
instead of attending to placeholder ids. An async claim keeps its blocks out of vLLM's prefix
cache until its load succeeds, so a failing request never shares a block with another request:
it fails alone. Set extra config "on_invalid": "ignore" to claim nothing instead (vLLM then
computes the prompt as given), except under a kvfold cache_salt ("kvfold-..."): those salts are
reserved for K/V loaded from files, so such a request fails even with kvfold parameters missing,
and never computes placeholder ids into the prefix cache under a cache's identity. Any other
request without kvfold parameters is left alone: (0, False). Every value a client sends is checked before any work (kvfold.params: types, bounds,
prompt token ids in the vocabulary), and no exception leaves a scheduler-side method: a request
the checks refuse fails alone, and an unforeseen fault is logged and answered as "nothing here".

Worker side: by default the load is synchronous, in start_load_kv, from the block ids in the
connector metadata (never from attention metadata, which can be None); the per-layer hooks do
nothing. With "load_mode": "async" a claim whose end C falls on a block boundary is answered
(C - local hit, True): vLLM parks the request in WAITING_FOR_REMOTE_KVS, a small thread pool reads
the file and fills the blocks while other requests run, and get_finished reports the request once
its load is done. A failed async load reports its blocks through get_block_ids_with_load_errors in
the same step as get_finished reports the request, so under kv_load_failure_policy "fail" vLLM
finishes it FINISHED_ERROR. A request aborted while loading is reported only once its thread has
stopped writing (vLLM keeps the blocks of a WAITING_FOR_REMOTE_KVS request until then). A claim
that ends mid-block loads synchronously even in async mode: older vLLM marks every allocated
block computed when an async load finishes, which would skip the question tokens in that block.
A cold load into host tensors runs in one pass (kvfold.loader.one_pass_load): layer by layer,
the chunks are read and checked, and the layer copied into the blocks while still in cache (the
next layer read meanwhile on a helper thread when a core is idle).
Decoded caches stay in a host retention pool (kvfold.pool). Layers that share another layer's KV tensor are written once, as that layer; layers beyond
the model's (EAGLE/MTP draft layers) get zeros in the loaded slots. Context parallelism (decode and
prefill CP) spreads each scheduler block over the CP ranks as vLLM's block table does; each rank
writes its tokens.

kv_connector_extra_config (kvfold.config checks every key at start, naming a bad one; unknown keys
are refused):
  cache_root         directory of kvf files; relative names resolve under it and absolute ones must
                     lie inside it (set it on servers). Default: $KVFOLD_CACHE_ROOT, else any path.
  model_fingerprint  the served model's fingerprint (`kvfold model-info DIR`); default: read from
                     DIR/.kvfold-fingerprint when the compactor left one for these exact weights.
                     Without it, files are checked against the model's shape only (logged).
  pool_bytes         retention pool limit (default 4 GiB; 0 disables retention)
  on_invalid         "fail" (default) or "ignore"
  kv_layout          the attention backend ("flash_attn", "flashinfer", "triton", "flex_attention",
                     "cpu") or a layout ("kv_first", "blocks_first", "cpu", "packed"): narrows
                     detection to that backend's layouts (kvfold.blocks)
  copy_backend       "auto" (C for host tensors, torch otherwise) or "torch"
  load_parts         device tensors: a cold load reads the file in this many layer ranges, copying
                     each into the blocks while the next is read (default 4; 1 reads, then copies);
                     host tensors load in one pass
  load_mode          "sync" (default) or "async" (see above)
  load_threads       loader threads of the async mode (default 2; loads share the retention pool,
                     so they read one at a time, but never on the engine's thread)
"""
from __future__ import annotations

import functools
import logging
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                  KVConnectorRole)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"kvfold.connector runs inside vLLM, and importing vLLM's connector API failed: {e}") from e

from . import _kvfold
from .blocks import check_block_size, copy_to_blocks, detect_layout, dtype_name, host_destination, zero_slots
from .config import parse_config
from .fingerprint import read_fingerprint_cache
from .loader import one_pass_load, pipelined_load
from .pool import RetentionPool
from .params import parse_params, show
from .prompt import (PARAMS_KEY, SALT_PREFIX, cache_key, cache_salt, placeholder_ids, token_id_error,
                     tokenizer_digest)

logger = logging.getLogger("kvfold.connector")

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
    elems: int = 0          # 2 * n_layers * C * kv_heads * head_dim of the file (its decoded size)
    asynchronous: bool = False  # loaded by the worker's thread pool, reported by get_finished
    payload: str = ""       # the file's payload digest when scheduled: a file replaced since is refused


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
    elems: int = 0
    payload: str = ""


def _never_raises(default: Callable[[Any], Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """For scheduler-side methods: an exception leaving one would end vLLM's engine core, so it is
    logged and default(self) is answered instead (every request's own faults are caught earlier,
    where they fail that request alone)."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception:
                logger.exception("kvfold: %s failed; answered as if nothing were there", fn.__name__)
                return default(self)
        return guarded
    return wrap


def _extra(vllm_config: Any) -> Dict[str, Any]:
    cfg = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(cfg, "kv_connector_extra_config", None) or {}
    if not isinstance(extra, dict):
        raise ValueError(f"kvfold: kv_connector_extra_config must be an object, not {type(extra).__name__}")
    return dict(extra)


def check_failure_policy(vllm_config: Any) -> None:
    """A failed load must fail the request: under "recompute" vLLM would compute the placeholder
    ids as text and could keep those blocks in its prefix cache (docs/decisions/load-failure-policy.md)."""
    cfg = vllm_config.kv_transfer_config
    policy = getattr(cfg, "kv_load_failure_policy", None)
    if policy == "fail":
        return
    why = (f"is {policy!r}" if policy is not None else
           "is missing (this vLLM predates the setting and always recomputes failed loads; use v0.13 or later)")
    raise ValueError(f"kvfold: kv_transfer_config.kv_load_failure_policy {why}; the KVFoldConnector needs "
                     '"kv_load_failure_policy": "fail" in --kv-transfer-config, so that a cache that cannot be '
                     "loaded fails its request instead of being recomputed from placeholder ids")


def check_hybrid_manager(vllm_config: Any) -> None:
    """vLLM turns its hybrid KV cache manager off for a connector that does not declare SupportsHMA
    (this one: it needs one KV cache group of one block size for every layer), unless the user
    forced it on with --no-disable-hybrid-kv-cache-manager; then say so."""
    sc = getattr(vllm_config, "scheduler_config", None)
    if getattr(sc, "disable_hybrid_kv_cache_manager", None) is False:
        raise ValueError("kvfold: the hybrid KV cache manager is on (--no-disable-hybrid-kv-cache-manager), and the "
                         "KVFoldConnector does not support it (it does not subclass SupportsHMA: it fills one KV "
                         "cache group of one block size for every layer). Serve without that flag: vLLM then turns "
                         "the hybrid manager off for this connector")


class KVFoldConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        check_hybrid_manager(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        check_failure_policy(vllm_config)
        cfg = parse_config(_extra(vllm_config))  # every key checked before anything starts
        mc = vllm_config.model_config
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        self._cp = _context_parallel(vllm_config, self._is_scheduler)  # (size, rank, interleave)
        self._block_size = self._manager_block_size(kv_cache_config) * self._cp[0]  # the scheduler's blocks
        self._n_layers = int(mc.get_total_num_hidden_layers())
        self._kv_heads = int(mc.get_total_num_kv_heads())
        self._head_dim = int(mc.get_head_size())
        self._vocab = int(mc.get_vocab_size())
        self._cache_root = cfg.cache_root
        self._on_invalid = cfg.on_invalid
        self._model_fp, why = cfg.model_fingerprint, "the model is not a local directory"
        if not self._model_fp and isinstance(mc.model, str) and os.path.isdir(mc.model):
            self._model_fp, why = read_fingerprint_cache(mc.model)
        if not self._model_fp:
            logger.warning("kvfold: the model's fingerprint is unknown (%s; set kv_connector_extra_config "
                           "'model_fingerprint' from `kvfold model-info`); cache files are checked against "
                           "the model's shape only", why)
        tok_dir = getattr(mc, "tokenizer", None) or mc.model  # files name the tokenizer that made their ids
        self._tok_digest = tokenizer_digest(tok_dir) if isinstance(tok_dir, str) and os.path.isdir(tok_dir) else ""
        if self._cache_root is None and self._is_scheduler:
            logger.warning("kvfold: no cache_root: requests may name any readable kvf file")
        # scheduler state
        self._decisions: Dict[str, Optional[_Decision]] = {}
        self._computed: Dict[str, int] = {}  # request -> the local hit vLLM last asked about
        self._pending: Dict[str, LoadSpec] = {}
        self._headers: Dict[Tuple[str, int, int, int], Dict[str, Any]] = {}
        # worker state
        self._kv_layout_override = cfg.kv_layout
        self._use_torch = cfg.copy_backend == "torch"
        self._pool = RetentionPool(cfg.pool_bytes)
        self._load_parts = cfg.load_parts  # layer ranges a cold load is read in
        self._async = cfg.load_mode == "async"
        self._load_threads = cfg.load_threads
        self._async_claims: Set[str] = set()  # scheduler: requests answered (E, True)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._inflight: Dict[str, Tuple[Future, LoadSpec, int]] = {}  # worker: req -> (load, spec, block size)
        self._aborted: Set[str] = set()      # in flight when vLLM finished them: no errors, just reported
        self._pool_lock = threading.Lock()   # the retention pool is not thread-safe
        self._tensors: List[Any] = []       # one per distinct target-layer tensor
        self._tensor_layers: List[int] = []  # the file's layer written into each
        self._destinations: List[Any] = []  # host_destination of each (host tensors)
        self._draft: List[Any] = []         # tensors of layers beyond the model's: zeroed
        self._layout = ""
        self._dtype = ""
        self._head_start = 0
        self._local_heads = 0
        self._load_errors: set = set()
        self.last_loads: List[Tuple[str, bool]] = []  # (req_id, pool hit) of the last step, for tests

    @staticmethod
    def _manager_block_size(kv_cache_config: Any) -> int:
        """Tokens per block of one rank's KV cache (vLLM multiplies it by the context-parallel size
        for the scheduler's blocks)."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if not groups:
            raise ValueError("kvfold: kv_cache_config has no KV cache groups")
        sizes = {int(g.kv_cache_spec.block_size) for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"kvfold: KV cache groups with block sizes {sorted(sizes)}: hybrid models (and vLLM's "
                             "hybrid KV cache manager) are not supported")
        return sizes.pop()

    # ---- scheduler side ------------------------------------------------------------------------

    @_never_raises(lambda self: (0, False))
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        d = self._decide(request)
        if d is None:
            return 0, False
        rid = request.request_id
        if d.reason:
            if self._on_invalid != "fail" and not _in_kvfold_namespace(request):
                return 0, False
            # a failing claim is always asynchronous: vLLM caches its blocks only once the load
            # succeeds, so the failure stays private (see docs/connector.md). At least one token is
            # claimed; vLLM's local hit leaves at least one, and an async claim may reach the end.
            if num_computed_tokens >= len(request.prompt_token_ids):
                return 0, False  # never asked so by vLLM: nothing is left to compute or to fail
            self._computed[rid] = num_computed_tokens
            self._async_claims.add(rid)
            return max(1, d.claim - num_computed_tokens), True
        self._computed[rid] = num_computed_tokens
        extra = d.claim - num_computed_tokens
        if self._async and extra > 0 and d.claim % self._block_size == 0:
            self._async_claims.add(rid)
            return extra, True
        self._async_claims.discard(rid)
        return max(0, extra), False

    @_never_raises(lambda self: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        d = self._decisions.get(rid)
        if d is None or num_external_tokens <= 0:
            return
        block_ids = [int(b) for b in blocks.get_block_ids()[0]]
        t0 = self._computed.get(rid, d.claim - num_external_tokens)
        self._pending[rid] = LoadSpec(rid, d.path, d.reason, d.key, d.n_tokens, block_ids, t0,
                                      t0 + num_external_tokens, d.elems, rid in self._async_claims, d.payload)

    @_never_raises(lambda self: KVFoldMetadata(self._block_size))
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KVFoldMetadata(self._block_size, list(self._pending.values()))
        self._pending.clear()
        return meta

    @_never_raises(lambda self: (False, None))
    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self._decisions.pop(request.request_id, None)
        self._computed.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._async_claims.discard(request.request_id)
        # vLLM itself keeps the blocks of a request still WAITING_FOR_REMOTE_KVS until the worker
        # reports it in get_finished (scheduler.py finish_requests), so no delay is asked here
        return False, None

    def _decide(self, request: Any) -> Optional[_Decision]:
        """Side-effect free for vLLM: the same answer each time it asks about a request."""
        rid = request.request_id
        if rid in self._decisions:
            return self._decisions[rid]
        params = getattr(request, "kv_transfer_params", None)
        spec = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if spec is None:
            if not _in_kvfold_namespace(request):
                return None
            d = _Decision(0, None, f"carries kvfold's cache_salt but no kv_transfer_params['{PARAMS_KEY}'] (the "
                          "salts 'kvfold-...' are reserved for caches loaded from files)", "", 0)
            logger.warning("kvfold: request %s: %s (failing it)", rid, d.reason)
            self._decisions[rid] = d
            return d
        try:
            d = self._evaluate(request, spec)
        except Exception as e:  # a request the checks above missed still fails alone
            logger.exception("kvfold: request %s: unexpected error while checking it", rid)
            d = _Decision(0, None, f"cannot be served ({type(e).__name__}: {show(str(e))})", "", 0)
        if d.reason:
            action = ("failing it" if self._on_invalid == "fail" or _in_kvfold_namespace(request) else
                      "claiming nothing")
            logger.warning("kvfold: request %s: %s (%s)", rid, d.reason, action)
        self._decisions[rid] = d
        return d

    def _evaluate(self, request: Any, spec: Any) -> _Decision:
        prompt = getattr(request, "prompt_token_ids", None)
        if not isinstance(prompt, (list, tuple)):
            return _Decision(0, None, f"the request has no prompt token ids ({show(prompt)})", "", 0)
        T = len(prompt)
        try:
            p = parse_params(spec, self._vocab)
        except ValueError as e:
            return _Decision(0, None, str(e), "", 0)
        C, key, id_range, name = p.n_tokens, p.key, p.id_range, p.cache
        why = token_id_error(prompt, self._vocab, "prompt token")
        if why:
            return _Decision(0, None, why, key, C)
        salt = getattr(request, "cache_salt", None)
        if salt != cache_salt(key):
            return _Decision(0, None, f"cache_salt {show(salt)} is not the cache's (kvfold.prompt gives it): K/V loaded "
                             "from a file enter vLLM's prefix cache only under the cache's own salt", key, C)
        expected = placeholder_ids(key, min(C, T), id_range)  # never more ids than the prompt holds
        run = 0
        while run < min(C, T) and prompt[run] == expected[run]:
            run += 1
        if run < C or T < C + 1:
            why = (f"prompt of {T} tokens starts with {run} of the cache's 'n_tokens' = {C} placeholder ids"
                   if run < C else f"prompt holds only the {C} placeholder ids: nothing after them for vLLM to compute")
            return _Decision(min(run, T - 1), None, why, key, C)
        try:
            path = self._resolve(name)
            h = self._header(path)
            self._check_header(h, path, key, C)
        except (OSError, ValueError, _kvfold.KvfError) as e:
            return _Decision(C, None, str(e), key, C)
        return _Decision(C, path, None, key, C, 2 * h["n_layers"] * C * h["kv_heads"] * h["head_dim"],
                         h["payload_digest"])

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
            after = os.stat(path)
            if (after.st_ino, after.st_size, after.st_mtime_ns) != k[1:]:
                return h  # replaced while read: not kept under the other file's key
            if len(self._headers) > 4096:
                self._headers.clear()
            self._headers[k] = h
        return h

    def _check_header(self, h: Dict[str, Any], path: str, key: str, C: int) -> None:
        if self._model_fp and h["model_fingerprint"] != self._model_fp:
            raise ValueError(f"{path}: written for model {h['model_fingerprint']}, not for the served model "
                             f"{self._model_fp}")
        if self._tok_digest and h.get("tokenizer_digest") and h["tokenizer_digest"] != self._tok_digest:
            raise ValueError(f"{path}: made with tokenizer {h['tokenizer_digest']}, not the served model's "
                             f"{self._tok_digest} (tokenizer.json)")
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
        target, draft = self._map_layers(kv_caches)
        self._tensor_layers = sorted(target)
        self._tensors = [target[i][1] for i in self._tensor_layers]
        self._draft = [t for _, t in draft]
        first = self._tensors[0]
        self._dtype = dtype_name(first.dtype)
        if self._dtype == "float32":
            raise ValueError("kvfold: float32 KV caches are not supported (bfloat16 or float16)")
        check_block_size(self._block_size, self._cp[0])
        tp_rank, tp_size = _tp_rank_size()
        self._local_heads = max(1, self._kv_heads // tp_size)
        self._head_start = tp_rank * self._kv_heads // tp_size
        local_bs = self._block_size // self._cp[0]
        layouts = set()
        for name, t in [target[i] for i in self._tensor_layers] + draft:
            if t.dtype != first.dtype or t.device != first.device or t.dim() != first.dim():
                raise ValueError(f"kvfold: layer {name}: {t.dtype} {tuple(t.shape)} on {t.device} differs from "
                                 f"{target[self._tensor_layers[0]][0]}")
            layouts.add(detect_layout(t.shape, local_bs, self._local_heads, self._head_dim, t.device.type,
                                      self._kv_layout_override, name))
        if len(layouts) != 1:
            raise ValueError(f"kvfold: the layers' KV caches have different layouts {sorted(layouts)}")
        self._layout = layouts.pop()
        if first.device.type == "cpu" and not self._use_torch:
            self._destinations = [host_destination(t, i) for t, i in zip(self._tensors, self._tensor_layers)]
        logger.info("kvfold: %d layers (%d tensors, %d draft), layout %s, %s, heads %d..%d of %d, blocks of %d%s",
                    self._n_layers, len(self._tensors), len(self._draft), self._layout, self._dtype,
                    self._head_start, self._head_start + self._local_heads - 1, self._kv_heads, self._block_size,
                    f", context-parallel rank {self._cp[1]} of {self._cp[0]}" if self._cp[0] > 1 else "")

    def _map_layers(self, kv_caches: Dict[str, Any]) -> Tuple[Dict[int, Tuple[str, Any]], List[Tuple[str, Any]]]:
        """The model's layers 0..L-1 -> (name, tensor), each distinct tensor once (as the lowest
        layer holding it: vLLM gives a layer that shares KV its target's tensor), and the layers
        beyond the model's (draft layers of EAGLE or MTP)."""
        by_index: Dict[int, Tuple[str, Any]] = {}
        draft: List[Tuple[str, Any]] = []
        owner: Dict[int, int] = {}  # data_ptr -> layer
        covered = set()
        for name, t in sorted(kv_caches.items(), key=lambda kv: _layer_index(kv[0])):
            idx = _layer_index(name)
            if idx >= self._n_layers:
                if t.data_ptr() not in owner:
                    owner[t.data_ptr()] = idx
                    draft.append((name, t))
                continue
            covered.add(idx)
            if t.data_ptr() in owner:  # shares the KV of a layer already mapped: written once, as that layer
                continue
            owner[t.data_ptr()] = idx
            by_index[idx] = (name, t)
        missing = sorted(set(range(self._n_layers)) - covered)
        if missing:
            raise ValueError(f"kvfold: no KV cache registered for layers {missing[:8]}{'...' if len(missing) > 8 else ''}"
                             f" of {self._n_layers}: the connector needs every layer on this worker (pipeline "
                             "parallelism is not supported)")
        return by_index, draft

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.last_loads = []
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, KVFoldMetadata):
            return
        for spec in meta.loads:
            if spec.asynchronous:
                self._submit(spec, meta.block_size)
                continue
            try:
                self.last_loads.append((spec.req_id, self._load(spec, meta.block_size)))
            except Exception as e:  # every failure becomes a load error: vLLM then fails the request
                self._report_failure(spec, meta.block_size, e)

    def _submit(self, spec: LoadSpec, block_size: int) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self._load_threads, thread_name_prefix="kvfold-async")
        if spec.req_id in self._inflight:  # vLLM never schedules a request twice while it loads
            raise RuntimeError(f"kvfold: request {spec.req_id} is already loading")
        if spec.reason:  # a failing claim: reported by this step's get_finished, no thread needed
            fut: Future = Future()
            fut.set_exception(ValueError(spec.reason))
        else:
            fut = self._executor.submit(self._load_on_thread, spec, block_size)
        self._inflight[spec.req_id] = (fut, spec, block_size)

    def _load_on_thread(self, spec: LoadSpec, block_size: int) -> bool:
        """An async load; on a CUDA cache the copies run on this thread's own stream, synchronized
        before the load counts as done."""
        if self._tensors and self._tensors[0].device.type == "cuda":
            import torch
            stream = torch.cuda.Stream(device=self._tensors[0].device)
            with torch.cuda.stream(stream):
                hit = self._load(spec, block_size)
            stream.synchronize()
            return hit
        return self._load(spec, block_size)

    def _report_failure(self, spec: LoadSpec, block_size: int, e: BaseException) -> None:
        if spec.t1 > spec.t0:
            self._load_errors.update(spec.block_ids[spec.t0 // block_size:(spec.t1 - 1) // block_size + 1])
        logger.error("kvfold: request %s: KV of tokens [%d, %d) not loaded: %s", spec.req_id, spec.t0, spec.t1, e)

    def _load(self, spec: LoadSpec, block_size: int) -> bool:
        """Fills the spec's slots from its file (or raises); True on a retention-pool hit."""
        if spec.reason:
            raise ValueError(spec.reason)
        if not self._tensors:
            raise ValueError("no KV caches registered")
        path, nbytes = spec.path, spec.elems * (4 if self._dtype == "float32" else 2)
        copied = []
        heads = (self._head_start, self._head_start + self._local_heads)  # only this TP rank's KV heads are read

        def copy(h: Dict[str, Any], data: Any, l0: int, l1: int) -> None:
            if cache_key(h) != spec.key:
                raise ValueError(f"{path}: changed since the request was scheduled")
            mine = [i for i, layer in enumerate(self._tensor_layers) if l0 <= layer < l1]
            if mine:
                copy_to_blocks(data, self._dtype, h["n_layers"], h["n_tokens"], h["kv_heads"], h["head_dim"],
                               [self._tensors[i] for i in mine], self._layout, spec.block_ids, block_size,
                               spec.t0, spec.t1, self._head_start, self._use_torch, self._local_heads,
                               [self._destinations[i] for i in mine] if self._destinations else None, self._cp,
                               [self._tensor_layers[i] for i in mine])
            copied.append((l0, l1))

        def cold(buf: Any) -> Tuple[Dict[str, Any], Any]:
            """Decodes into buf ([2, L, C, H, D], the pool's form) and fills the blocks: host
            tensors in one pass (each layer copied while in cache), others range by range."""
            if self._destinations:
                h = one_pass_load(path, self._dtype, buf, self._destinations, self._layout, spec.block_ids,
                                  block_size, spec.t0, spec.t1, model_fingerprint=self._model_fp,
                                  n_layers=self._n_layers, kv_heads=self._kv_heads, head_dim=self._head_dim,
                                  heads=heads, payload_digest=spec.payload or None, cp=self._cp)
                if cache_key(h) != spec.key:
                    raise ValueError(f"{path}: changed since the request was scheduled")
                copied.append((0, self._n_layers))
                return h, buf
            return pipelined_load(path, self._dtype, buf, self._n_layers,
                                  lambda h, l0, l1: copy(h, buf, l0, l1), model_fingerprint=self._model_fp,
                                  kv_heads=self._kv_heads, head_dim=self._head_dim, parts=self._load_parts,
                                  heads=heads)

        with self._pool_lock:
            entry, hit = self._pool.get(path, self._dtype, cold, nbytes, heads)
            try:
                if not copied:  # a pool hit: the whole copy now
                    copy(entry.header, entry.data, 0, self._n_layers)
                zero_slots(self._draft, self._layout, spec.block_ids, block_size, spec.t0, spec.t1, self._cp)
            finally:
                self._pool.release(entry)
        return hit

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # the load finished in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # a consumer: nothing is saved

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set) -> Tuple[Optional[set], Optional[set]]:
        """(None, the requests whose async loads ended since the last call). A failed load's
        blocks go to get_block_ids_with_load_errors, which vLLM calls after this in the same step,
        so the request is failed before it could be scheduled. A request vLLM finished while its
        load ran (an abort) is cancelled if its load has not started and reported once its thread
        has stopped: only then does vLLM free its blocks."""
        for rid in finished_req_ids or ():
            if rid in self._inflight:
                self._aborted.add(rid)
                self._inflight[rid][0].cancel()
        done = set()
        for rid, (fut, spec, block_size) in list(self._inflight.items()):
            if not fut.done():
                continue
            del self._inflight[rid]
            done.add(rid)
            aborted = rid in self._aborted
            self._aborted.discard(rid)
            if fut.cancelled():
                continue
            err = fut.exception()
            if err is None:
                self.last_loads.append((rid, fut.result()))
            elif not aborted:
                self._report_failure(spec, block_size, err)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def handle_preemptions(self, *args: Any, **kwargs: Any) -> None:
        return None  # only running requests are preempted, and none of them has a load in flight

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._inflight.clear()
        self._pool.evict()
        self._tensors = []


def _in_kvfold_namespace(request: Any) -> bool:
    """The request's cache_salt is kvfold's: its blocks in vLLM's prefix cache must hold K/V loaded
    from a file, never placeholder ids computed as text."""
    salt = getattr(request, "cache_salt", None)
    return isinstance(salt, str) and salt.startswith(SALT_PREFIX)


def _layer_index(name: str) -> int:
    m = _LAYER_RE.search(name)
    if not m:
        raise ValueError(f"kvfold: KV cache '{name}' names no layer index ('...layers.N...')")
    return int(m.group(1))


def _tp_rank_size() -> Tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)
        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except (ImportError, AssertionError, AttributeError):  # no distributed state (tests, single process)
        return 0, 1


def _context_parallel(vllm_config: Any, scheduler: bool) -> Tuple[int, int, int]:
    """(size, this rank, interleave) of decode x prefill context parallelism; vLLM's block table
    gives rank dcp_size * pcp_rank + dcp_rank the interleaved runs of each block it owns."""
    pc = getattr(vllm_config, "parallel_config", None)
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    inter = int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1)
    if dcp * pcp == 1 or scheduler:
        return dcp * pcp, 0, inter
    from vllm.distributed import parallel_state as ps
    dcp_rank = ps.get_dcp_group().rank_in_group if dcp > 1 else 0
    pcp_rank = ps.get_pcp_group().rank_in_group if pcp > 1 else 0
    return dcp * pcp, dcp * pcp_rank + dcp_rank, inter
