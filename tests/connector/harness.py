"""Drives a KV connector the way vLLM's scheduler and workers call it (docs/connector.md,
"Call order"): config resolution, one scheduler and one worker instance, per step schedule ->
build_connector_meta -> (pickled) -> worker hooks -> update_from_output, with a block pool that
hands out non-contiguous ids (never block 0), optional prefix caching that registers full blocks
at allocation time, a token budget (chunked prefill), allocation failures (the waiting queue stops
at the first, as vLLM's `break`), preemption, and vLLM's handling of failed loads: only blocks
inside a request's pre-step computed range count; under "fail" the invalid blocks and every block
after them leave the prefix cache and the request finishes FINISHED_ERROR without output; under
"recompute" its computed tokens are cut at the first bad block. Asynchronous loads follow vLLM's
WAITING_FOR_REMOTE_KVS state (scheduler.py at 00024d31: schedule, _update_waiting_for_remote_kv,
_handle_invalid_blocks, finish_requests, _update_from_kv_xfer_finished): a claim answered
(E, True) gets blocks for its L + E tokens only, none cached, and waits; when the worker reports it
in get_finished it becomes computed up to len(blocks) * block_size (at most the prompt less one
token), its blocks are cached and it is scheduled as usual. Failed blocks of a waiting request fail
it (all its blocks count); a request finished while it waits for its load keeps its blocks until
the worker reports it, and a report for a request the scheduler does not hold fails an assert, as
in vLLM. The "model" writes a marker into
the slots of the tokens it computes. The KV cache layout defaults to the stand-in vllm profile's
(vllm.PROFILE): FlashAttention blocks-first for 0.25, packed for 0.26.
"""
from __future__ import annotations

import importlib
import inspect
import pickle
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole

COMPUTED = 0.5  # what the "model" writes into the slots it computes
# the stand-in's profile; a real vLLM (tests/connector/vllm_real) is of the 5-D layout era
PROFILE = getattr(vllm, "PROFILE", "0.25")
DEFAULT_LAYOUT = "packed" if PROFILE >= "0.26" else "blocks_first"
# stride orders (vLLM's get_kv_cache_stride_order: physical dims in terms of the logical ones)
ORDERS = {
    "kv_first": {"nhd": (0, 1, 2, 3, 4), "hnd": (0, 1, 3, 2, 4)},
    "blocks_first": {"nhd": (0, 1, 2, 3, 4), "hnd": (0, 1, 3, 2, 4), "flex": (0, 2, 1, 3, 4)},
    "cpu": {"nhd": (0, 1, 2, 3, 4)},
    "packed": {"nhd": (0, 2, 1, 3), "hnd": (0, 1, 2, 3)},
}
# the (layout, stride order) cases of each profile
PROFILE_LAYOUTS = ([("packed", "nhd"), ("packed", "hnd")] if PROFILE >= "0.26" else
                   [("blocks_first", "nhd"), ("blocks_first", "hnd"), ("blocks_first", "flex"),
                    ("kv_first", "nhd"), ("kv_first", "hnd"), ("cpu", "nhd")])


# ---- configs (the fields and methods the connector reads) ----------------------------------------

@dataclass
class ModelConfig:
    model: str
    n_layers: int
    kv_heads: int
    head_dim: int
    vocab: int

    def get_total_num_hidden_layers(self) -> int:
        return self.n_layers

    def get_total_num_kv_heads(self) -> int:
        return self.kv_heads

    def get_head_size(self) -> int:
        return self.head_dim

    def get_vocab_size(self) -> int:
        return self.vocab


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_connector_module_path: str
    kv_role: str = "kv_consumer"
    kv_connector_extra_config: Dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: Optional[str] = "fail"

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


@dataclass
class KVTransferConfigV012:
    """vLLM v0.12's: no kv_load_failure_policy (failed loads are always recomputed)."""
    kv_connector: str
    kv_connector_module_path: str
    kv_role: str = "kv_consumer"
    kv_connector_extra_config: Dict[str, Any] = field(default_factory=dict)


@dataclass
class CacheConfig:
    block_size: int


@dataclass
class ParallelConfig:
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    kv_transfer_config: KVTransferConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any


@dataclass
class KVCacheGroupSpec:
    layer_names: List[str]
    kv_cache_spec: FullAttentionSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: List[KVCacheGroupSpec]


# ---- scheduler-side objects -----------------------------------------------------------------------

@dataclass
class Request:
    request_id: str
    prompt_token_ids: List[int]
    kv_transfer_params: Optional[Dict[str, Any]] = None
    cache_salt: Optional[str] = None
    max_tokens: int = 2
    output_token_ids: List[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    status: str = "WAITING"
    blocks: List[int] = field(default_factory=list)
    mm_features: List[Any] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> List[int]:
        return self.prompt_token_ids + self.output_token_ids


class KVCacheBlocks:
    def __init__(self, blocks: tuple):
        self.blocks = blocks

    def get_block_ids(self) -> tuple:
        return tuple(list(b) for b in self.blocks)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: List[int]
    block_ids: tuple
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: List[str] = field(default_factory=list)
    resumed_req_ids: set = field(default_factory=set)
    new_block_ids: List[Optional[tuple]] = field(default_factory=list)
    num_computed_tokens: List[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: List[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: Dict[str, int] = field(default_factory=dict)
    finished_req_ids: set = field(default_factory=set)
    kv_connector_metadata: Any = None


@dataclass
class Layer:
    kv_cache: Any


@dataclass
class ForwardContext:
    no_compile_layers: Dict[str, Layer]
    attn_metadata: Optional[Dict[str, Any]]


@dataclass
class WorkerOutput:
    invalid_block_ids: set
    finished: tuple


# ---- slots of a paged tensor ----------------------------------------------------------------------

def slot_view(t: torch.Tensor, layout: str, slot: int) -> torch.Tensor:
    """The (2, kv_heads, head_dim) view of one slot, whatever the layout and strides."""
    kbs = t.shape[3] if layout == "cpu" else t.shape[2]
    kb, off = divmod(slot, kbs)
    if layout == "kv_first":
        return t[:, kb, off]
    if layout == "blocks_first":
        return t[kb, :, off]
    if layout == "cpu":
        return t[:, kb, :, off]
    return t[kb, :, off].unflatten(1, (2, t.shape[3] // 2)).transpose(0, 1)  # packed: (H, 2D) -> (2, H, D)


def slots_of(block_ids: List[int], block_size: int, t0: int, t1: int) -> List[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(t0, t1)]


def gather(t: torch.Tensor, layout: str, slots: List[int]) -> torch.Tensor:
    """[2, len(slots), kv_heads, head_dim] copied out of the blocks."""
    return torch.stack([slot_view(t, layout, s) for s in slots], dim=1)


def logical_shape(layout: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple:
    return {"kv_first": (2, num_blocks, block_size, kv_heads, head_dim),
            "blocks_first": (num_blocks, 2, block_size, kv_heads, head_dim),
            "cpu": (2, num_blocks, kv_heads, block_size, head_dim),
            "packed": (num_blocks, kv_heads, block_size, 2 * head_dim)}[layout]


def make_cache(layout: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: Any,
               order: str = "nhd", fill: float = float("nan")) -> torch.Tensor:
    """A cache tensor in the logical shape of a layout, allocated in a stride order and permuted
    back (as vLLM's _reshape_kv_cache_tensors does: HND and FlexAttention are non-contiguous)."""
    shape = logical_shape(layout, num_blocks, block_size, kv_heads, head_dim)
    perm = ORDERS[layout][order]
    if not dtype.is_floating_point:
        fill = 0
    phys = torch.full([shape[i] for i in perm], fill, dtype=dtype)
    inv = [perm.index(i) for i in range(len(perm))]
    return phys.permute(*inv)


def num_slots(t: torch.Tensor, layout: str) -> int:
    kbs = t.shape[3] if layout == "cpu" else t.shape[2]
    return (t.shape[1] if layout in ("kv_first", "cpu") else t.shape[0]) * kbs


# ---- the engine -----------------------------------------------------------------------------------

class Engine:
    def __init__(self, model: ModelConfig, extra: Dict[str, Any], *, layout: str = DEFAULT_LAYOUT,
                 block_size: int = 16, kernel_block_size: Optional[int] = None, num_blocks: int = 64,
                 dtype: Any = torch.bfloat16, order: str = "nhd", token_budget: int = 4096,
                 prefix_caching: bool = False, attn_metadata: bool = True, layer_hooks: bool = True,
                 check_untouched: bool = True, seed: int = 0, local_kv_heads: Optional[int] = None,
                 module: str = "kvfold.connector", class_name: str = "KVFoldConnector",
                 policy: Optional[str] = "fail", extra_layers: Optional[Dict[str, Optional[int]]] = None):
        """extra_layers: more KV cache names, each with the layer index whose tensor it shares
        (KV sharing) or None for a tensor of its own (a draft model's layer)."""
        self.model, self.layout, self.bs = model, layout, block_size
        self.kbs = kernel_block_size or block_size
        self.token_budget, self.prefix_caching = token_budget, prefix_caching
        self.attn_metadata, self.layer_hooks, self.check_untouched = attn_metadata, layer_hooks, check_untouched
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(model.n_layers)]
        ktc = (KVTransferConfig("KVFoldConnector", module, "kv_consumer", dict(extra), policy) if policy else
               KVTransferConfigV012("KVFoldConnector", module, "kv_consumer", dict(extra)))
        self.vllm_config = VllmConfig(model, CacheConfig(block_size), ktc)
        self.policy = policy or "recompute"
        self.kv_cache_config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(
            list(self.layer_names), FullAttentionSpec(block_size, model.kv_heads, model.head_dim, dtype))])
        # 1. config resolution: import by module path, check the 3-argument constructor
        cls = getattr(importlib.import_module(module), class_name)
        assert "kv_cache_config" in inspect.signature(cls.__init__).parameters
        assert cls.requires_piecewise_for_cudagraph({}) is False
        # 2. scheduler
        self.scheduler = cls(self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.scheduler.bind_gpu_block_pool(object())
        # 3. worker: layout query, then the tensors
        self.worker = cls(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        cls.get_required_kvcache_layout(self.vllm_config)
        per = block_size // self.kbs
        heads = local_kv_heads or model.kv_heads  # a tensor-parallel rank holds its slice of the heads
        self.caches = {n: make_cache(layout, num_blocks * per, self.kbs, heads, model.head_dim, dtype, order)
                       for n in self.layer_names}
        for n, share in (extra_layers or {}).items():
            self.caches[n] = (self.caches[self.layer_names[share]] if share is not None else
                              make_cache(layout, num_blocks * per, self.kbs, heads, model.head_dim, dtype, order))
        self.worker.register_kv_caches(dict(self.caches))
        self.worker.set_host_xfer_buffer_ops(lambda *a: None)
        hs = self.worker.get_handshake_metadata()
        self.scheduler.set_xfer_handshake_metadata({0: hs} if hs is not None else {})
        # block pool
        ids = list(range(1, num_blocks))
        random.Random(seed).shuffle(ids)
        self.free: List[int] = ids
        self.refs: Dict[int, int] = {}
        self.cached: Dict[Any, int] = {}      # block hash -> block id (prefix cache)
        self.block_hash: Dict[int, Any] = {}
        self.waiting: List[Request] = []
        self.running: List[Request] = []
        self.finished: Dict[str, Request] = {}
        self._finished_ids: set = set()
        self.fail_alloc: Dict[str, int] = {}  # request id -> allocations to refuse
        self.preempt_next: set = set()
        self.steps: List[Dict[str, Any]] = []
        self.metas: List[Any] = []
        self.recomputed: set = set()
        self.finished_recving: set = set()    # async loads reported done, not yet promoted
        self.delayed: Dict[str, Request] = {}  # finished requests whose blocks wait for the worker
        self.async_slots: Dict[str, set] = {}  # slots an async load in flight may write
        self.async_promoted: List[str] = []    # request ids, in the order their loads were taken up

    # -- requests
    def add_request(self, req: Request) -> None:
        self.scheduler.on_new_request(req)
        self.waiting.append(req)

    def _hashes(self, req: Request, n_blocks: int) -> List[Any]:
        h, out = ("salt", req.cache_salt), []
        for i in range(n_blocks):
            h = (h, tuple(req.all_token_ids[i * self.bs:(i + 1) * self.bs]))
            out.append(hash(h))
        return out

    def _take(self, n: int) -> List[int]:
        got = [self.free.pop(0) for _ in range(n)]
        for b in got:
            if b in self.block_hash:  # evicted from the prefix cache on reuse
                self.cached.pop(self.block_hash.pop(b), None)
            self.refs[b] = 1
        return got

    def _release(self, blocks: List[int]) -> None:
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def _local_hit(self, req: Request) -> List[int]:
        if not self.prefix_caching:
            return []
        hit = []
        for h in self._hashes(req, (req.num_tokens - 1) // self.bs):
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        for b in hit:
            if self.refs.get(b, 0) == 0:
                self.free.remove(b)
            self.refs[b] = self.refs.get(b, 0) + 1
        return hit

    def _cache_blocks(self, req: Request, n_tokens: int) -> None:
        if not self.prefix_caching:
            return
        for i, h in enumerate(self._hashes(req, n_tokens // self.bs)):
            if h not in self.cached and req.blocks[i] not in self.block_hash:
                self.cached[h] = req.blocks[i]
                self.block_hash[req.blocks[i]] = h

    def uncache(self, req: Request, index: int) -> None:
        """Evicts block `index` of req from the prefix cache."""
        self.cached.pop(self.block_hash.pop(req.blocks[index]))

    def cached_blocks(self, req: Request, n: int) -> int:
        """How many of req's first n blocks are in the prefix cache."""
        return len(set(self._hashes(req, n)) & set(self.cached))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req.blocks)
        req.blocks, req.num_computed_tokens = [], 0
        req.num_preemptions += 1
        req.status = "PREEMPTED"
        self.waiting.insert(0, req)

    def _finish(self, req: Request, status: str) -> None:
        """vLLM's finish_requests/_free_request: a request still waiting for its async load keeps
        its blocks until the worker reports the load (as does one whose connector asks to delay)."""
        delay = False
        if req.status == "WAITING_FOR_REMOTE_KVS":
            delay = req.request_id not in self.finished_recving
            self.finished_recving.discard(req.request_id)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        connector_delay, _ = self.scheduler.request_finished(req, list(req.blocks))
        if delay or connector_delay:
            self.delayed[req.request_id] = req
        else:
            self._release(req.blocks)
        self.finished[req.request_id] = req
        self._finished_ids.add(req.request_id)

    def abort(self, request_id: str) -> None:
        """The API server's abort (finish_requests with FINISHED_ABORTED)."""
        req = next(r for r in self.running + self.waiting if r.request_id == request_id)
        self._finish(req, "FINISHED_ABORTED")

    def _promote(self, req: Request) -> bool:
        """_update_waiting_for_remote_kv: ready once the worker reported the load."""
        if req.request_id not in self.finished_recving:
            return False
        self.finished_recving.discard(req.request_id)
        n = min(len(req.blocks) * self.bs, req.num_tokens)
        if n == req.num_tokens:
            n -= 1
        self._cache_blocks(req, n)
        req.num_computed_tokens = n
        req.status = "PREEMPTED" if req.num_preemptions else "WAITING"
        self.async_promoted.append(req.request_id)
        return True

    # -- one engine step
    def step(self) -> Dict[str, Any]:
        for req in [r for r in self.running if r.request_id in self.preempt_next]:
            self._preempt(req)
        self.preempt_next = set()
        so = SchedulerOutput()
        budget = self.token_budget
        scheduled: List[Request] = []
        for req in list(self.running):
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            need = -(-(req.num_computed_tokens + n) // self.bs) - len(req.blocks)
            if need > len(self.free):
                continue
            new = self._take(max(0, need))
            req.blocks += new
            cr = so.scheduled_cached_reqs
            cr.req_ids.append(req.request_id)
            cr.new_block_ids.append((new,) if new else None)
            cr.num_computed_tokens.append(req.num_computed_tokens)
            so.num_scheduled_tokens[req.request_id] = n
            budget -= n
            scheduled.append(req)
        for req in list(self.waiting):
            if budget <= 0:
                break
            if req.status == "WAITING_FOR_REMOTE_KVS" and not self._promote(req):
                continue  # still loading: skipped, stays at the head of the queue
            if req.num_computed_tokens == 0:
                held = self._local_hit(req)
                L = len(held) * self.bs
                E, load_async = self.scheduler.get_num_new_matched_tokens(req, L)
                if E is None:
                    self._release(held)
                    continue
                assert not load_async or E > 0, "an async claim of 0 tokens"
            else:  # its async load finished: the blocks it holds are computed
                held, L, E, load_async = list(req.blocks), req.num_computed_tokens, 0, False
            num_new = 0 if load_async else min(req.num_tokens - L - E, budget)
            assert load_async or num_new > 0, "the connector claimed every token"
            need = -(-(L + E + num_new) // self.bs) - len(held)
            if self.fail_alloc.get(req.request_id, 0) > 0 or need > len(self.free):
                self.fail_alloc[req.request_id] = self.fail_alloc.get(req.request_id, 0) - 1
                if req.num_computed_tokens == 0:
                    self._release(held)
                break  # vLLM: the waiting queue stops at the first request it cannot allocate
            req.blocks = held + self._take(max(0, need))
            self.scheduler.update_state_after_alloc(req, KVCacheBlocks((list(req.blocks),)), E)  # also when E is 0
            if load_async:  # blocks for L + E tokens, not cached until the load is reported
                req.status = "WAITING_FOR_REMOTE_KVS"
                continue
            req.num_computed_tokens = L + E
            self._cache_blocks(req, L + E + num_new)
            self.waiting.remove(req)
            self.running.append(req)
            if req.num_preemptions:  # V1 runner: resumed requests come as cached requests, full block list
                cr = so.scheduled_cached_reqs
                cr.req_ids.append(req.request_id)
                cr.resumed_req_ids.add(req.request_id)
                cr.new_block_ids.append((list(req.blocks),))
                cr.num_computed_tokens.append(req.num_computed_tokens)
            else:
                so.scheduled_new_reqs.append(NewRequestData(req.request_id, list(req.prompt_token_ids),
                                                            (list(req.blocks),), req.num_computed_tokens))
            req.status = "RUNNING"
            so.num_scheduled_tokens[req.request_id] = num_new
            budget -= num_new
            scheduled.append(req)
        so.finished_req_ids, self._finished_ids = self._finished_ids, set()
        meta = self.scheduler.build_connector_meta(so)
        assert meta is not None and isinstance(meta, KVConnectorMetadata)
        for spec in getattr(meta, "loads", []):
            if getattr(spec, "asynchronous", False):
                self.async_slots[spec.req_id] = set(slots_of(spec.block_ids, self.bs, spec.t0, spec.t1))
        so.kv_connector_metadata = meta
        self.metas.append(meta)
        starts = {r.request_id: r.num_computed_tokens for r in scheduled}
        blocks = {r.request_id: list(r.blocks) for r in scheduled}
        for r in scheduled:
            r.num_computed_tokens += so.num_scheduled_tokens[r.request_id]
        out = self._execute(pickle.loads(pickle.dumps(so)), starts, blocks)  # TP > 1 pickles it
        info = {"scheduled": dict(so.num_scheduled_tokens), "errors": set(out.invalid_block_ids)}
        self._update_from_output(scheduled, out, starts)
        self.steps.append(info)
        return info

    def _execute(self, so: SchedulerOutput, starts: Dict[str, int], blocks: Dict[str, List[int]]) -> WorkerOutput:
        w, meta = self.worker, so.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        md = {n: object() for n in self.layer_names} if self.attn_metadata else None
        fc = ForwardContext({n: Layer(t) for n, t in self.caches.items()}, md)
        before = {n: t.clone() for n, t in self.caches.items()} if self.check_untouched else None
        w.start_load_kv(fc)
        if before is not None:
            self._check_untouched(before, meta)
        for rid, n in so.num_scheduled_tokens.items():  # the model computes the scheduled tokens
            for s in slots_of(blocks[rid], self.bs, starts[rid], starts[rid] + n):
                for t in self.caches.values():
                    slot_view(t, self.layout, s).fill_(COMPUTED)
        if md is not None and self.layer_hooks:
            for n in self.layer_names:
                w.wait_for_layer_load(n)
                w.save_kv_layer(n, self.caches[n], md[n])
        w.wait_for_save()
        finished = w.get_finished(so.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        w.get_kv_connector_stats()
        w.get_kv_connector_kv_cache_events()
        w.build_connector_worker_meta()
        w.clear_connector_metadata()
        return WorkerOutput(set(errors), finished)

    def _check_untouched(self, before: Dict[str, torch.Tensor], meta: Any) -> None:
        """Every slot outside the loads' [t0, t1) ranges is byte-identical after start_load_kv."""
        allowed = set().union(*self.async_slots.values())  # async loads may write at any time
        for spec in getattr(meta, "loads", []):
            allowed.update(slots_of(spec.block_ids, self.bs, spec.t0, spec.t1))
        for n, t in self.caches.items():
            changed = (t.view(torch.int16) != before[n].view(torch.int16)) if t.dtype != torch.float32 else \
                (t.view(torch.int32) != before[n].view(torch.int32))
            if not changed.any():
                continue
            total = num_slots(t, self.layout)
            for s in range(total):
                if s not in allowed:
                    a, b = slot_view(t, self.layout, s), slot_view(before[n], self.layout, s)
                    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{n}: slot {s} was written"

    def _update_from_output(self, scheduled: List[Request], out: WorkerOutput, starts: Dict[str, int]) -> None:
        bad = out.invalid_block_ids
        for req in [r for r in self.waiting if r.status == "WAITING_FOR_REMOTE_KVS"] if bad else []:
            if any(b in bad for b in req.blocks):  # an async load: every allocated block counts
                assert self.policy == "fail", "the harness models async failures under 'fail' only"
                self._finish(req, "FINISHED_ERROR")
        for req in list(self.running) if bad else []:
            computed = req.blocks[:-(-starts.get(req.request_id, req.num_computed_tokens) // self.bs)]
            first = next((i for i, b in enumerate(computed) if b in bad), None)  # only the pre-step computed range
            if first is None:
                continue
            if self.policy == "fail":
                for b in req.blocks[first:]:  # the bad block and every later one leave the prefix cache
                    if b in self.block_hash:
                        self.cached.pop(self.block_hash.pop(b), None)
                self._finish(req, "FINISHED_ERROR")  # no output for this step
            else:  # "recompute": computed again from the first bad block, on the placeholder ids; the
                req.num_computed_tokens = first * self.bs  # blocks keep their hashes in the prefix cache
                self.recomputed.add(req.request_id)
        self._update_from_xfer(out)
        list(self.scheduler.take_events())
        for req in scheduled:
            if req.status == "RUNNING" and req.num_computed_tokens >= req.num_tokens:
                req.output_token_ids.append(1)
                if len(req.output_token_ids) >= req.max_tokens:
                    self._finish(req, "FINISHED_LENGTH")

    def _update_from_xfer(self, out: WorkerOutput) -> None:
        """_update_from_kv_xfer_finished: a reported load readies its waiting request, or frees the
        blocks of one finished meanwhile; any other id is an error."""
        self.scheduler.update_connector_output(out)
        sending, recving = out.finished if out.finished else (None, None)
        assert not sending, "a consumer connector reported sends"
        for rid in recving or ():
            self.async_slots.pop(rid, None)
            if rid in self.delayed:
                self._release(self.delayed.pop(rid).blocks)
                continue
            req = [r for r in self.waiting if r.request_id == rid]
            assert len(req) == 1 and req[0].status == "WAITING_FOR_REMOTE_KVS", f"unknown finished load {rid}"
            assert rid not in self.finished_recving, f"load of {rid} reported twice"
            self.finished_recving.add(rid)

    def run(self, max_steps: int = 50, max_wait_s: float = 60.0) -> None:
        """Steps until every request finished and no blocks wait for a load; steps that only wait
        for async loads (nothing scheduled) do not count, up to max_wait_s of them."""
        deadline = time.monotonic() + max_wait_s
        steps = 0
        while self.waiting or self.running or self.delayed:
            if steps >= max_steps or time.monotonic() > deadline:
                raise AssertionError("requests did not finish")
            loading = self.delayed or any(r.status == "WAITING_FOR_REMOTE_KVS" for r in self.waiting)
            if self.step()["scheduled"] or not loading:
                steps += 1
            else:
                time.sleep(0.002)

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
