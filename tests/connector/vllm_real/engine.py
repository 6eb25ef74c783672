"""RealEngine: the interface of the stand-in harness.Engine, driven by vLLM's real v1 Scheduler.

Scheduler side, all vLLM: Scheduler, its KVCacheManager, BlockPool and prefix cache, real
Request objects (block hashing, cache_salt, kv_transfer_params from SamplingParams.extra_args),
the connector built by KVConnectorFactory from kv_connector_module_path, update_from_output with
real ModelRunnerOutput / KVConnectorOutput. Worker side: the worker-role connector built by
ensure_kv_transfer_initialized, called through the model-runner mixin's own
_get_kv_connector_output inside a real ForwardContext, handle_preemptions first (as the GPU
runner does); the "model" writes harness.COMPUTED into the slots of the tokens it computes and
samples token 1 for each request whose prefill is complete. The config objects are made without
their set-up code (it needs transformers and a platform), with vLLM's decision for connectors
without SupportsHMA copied (the hybrid KV cache manager off).

Test controls, as in the stand-in: fail_alloc (allocations refused per request), preempt_next
(running requests the scheduler itself preempts in the next step, which then runs one more step
to resume them: see _preempt_step).
"""
from __future__ import annotations

import copy
import pickle
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch

import harness
from harness import COMPUTED, Request, make_cache, slot_view, slots_of

from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ObservabilityConfig, ParallelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.config.model_arch import ModelArchitectureConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.request import Request as VRequest
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

import backends

SAMPLED = 1  # the token the "model" samples
_check_untouched = harness.Engine._check_untouched  # the stand-in's check, taken before conftest swaps Engine


class _HFConfig(SimpleNamespace):
    """The attributes of a Hugging Face config that vLLM's scheduler path reads."""

    def get_text_config(self, **kwargs: Any) -> "_HFConfig":
        return self


def _model_config(m: harness.ModelConfig, max_model_len: int) -> ModelConfig:
    """ModelConfig without __init__ (it loads the Hugging Face config through transformers)."""
    arch = ModelArchitectureConfig(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", text_model_type="qwen3",
        hidden_size=m.kv_heads * m.head_dim * 2, total_num_hidden_layers=m.n_layers,
        total_num_attention_heads=m.kv_heads * 2, head_size=m.head_dim, vocab_size=m.vocab,
        total_num_kv_heads=m.kv_heads, num_experts=0, quantization_config=None, is_deepseek_mla=False,
        is_mm_prefix_lm=False, derived_max_model_len_and_key=(float(max_model_len), "max_position_embeddings"))
    hf = _HFConfig(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=m.vocab,
                         num_hidden_layers=m.n_layers, num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
                         is_encoder_decoder=False)
    mc = object.__new__(ModelConfig)
    fields = dict(model=m.model, tokenizer=m.model, max_model_len=max_model_len, hf_config=hf, hf_text_config=hf,
                  model_arch_config=arch, multimodal_config=None, enable_return_routed_experts=False,
                  dtype=torch.bfloat16, runner_type="generate", skip_tokenizer_init=True,
                  enforce_eager=True, quantization=None)
    for k, v in fields.items():
        object.__setattr__(mc, k, v)
    return mc


def _vllm_config(m: harness.ModelConfig, extra: Dict[str, Any], block_size: int, num_blocks: int,
                 token_budget: int, prefix_caching: bool, policy: Optional[str], module: str,
                 class_name: str, max_model_len: int, max_num_seqs: int = 256) -> VllmConfig:
    ktc = dict(kv_connector=class_name, kv_connector_module_path=module, kv_role="kv_consumer",
               kv_connector_extra_config=dict(extra))
    if policy is not None:
        ktc["kv_load_failure_policy"] = policy
    kv = KVTransferConfig(**ktc)
    sc = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False,
                         max_num_batched_tokens=max(token_budget, 16), max_num_seqs=min(max_num_seqs, max(token_budget, 16)),
                         enable_chunked_prefill=True, disable_hybrid_kv_cache_manager=True)
    sc.max_num_scheduled_tokens = token_budget
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    cc.num_gpu_blocks = num_blocks
    vc = object.__new__(VllmConfig)  # __post_init__ needs a platform; its decisions used here are made below
    fields = dict(model_config=_model_config(m, max_model_len), cache_config=cc, parallel_config=ParallelConfig(),
                  scheduler_config=sc, kv_transfer_config=kv, observability_config=ObservabilityConfig(),
                  lora_config=None, speculative_config=None, kv_events_config=None, ec_transfer_config=None,
                  structured_outputs_config=None)
    for k, v in fields.items():
        object.__setattr__(vc, k, v)
    return vc


def _finished_name(status: RequestStatus) -> str:
    name = status.name
    return "FINISHED_LENGTH" if name == "FINISHED_LENGTH_CAPPED" else name


class RealEngine:
    """harness.Engine's constructor and attributes (see there), on vLLM's Scheduler."""

    def __init__(self, model: harness.ModelConfig, extra: Dict[str, Any], *, layout: str = "blocks_first",
                 block_size: int = 16, kernel_block_size: Optional[int] = None, num_blocks: int = 64,
                 dtype: Any = torch.bfloat16, order: str = "nhd", token_budget: int = 4096,
                 prefix_caching: bool = False, attn_metadata: bool = True, layer_hooks: bool = True,
                 check_untouched: bool = True, seed: int = 0, local_kv_heads: Optional[int] = None,
                 module: str = "kvfold.connector", class_name: str = "KVFoldConnector",
                 policy: Optional[str] = "fail", extra_layers: Optional[Dict[str, Optional[int]]] = None,
                 backend: Optional[str] = None, cache_layout: str = "NHD", max_model_len: int = 4096,
                 mark_computed: bool = True, max_num_seqs: int = 256):
        """seed: unused (vLLM's block pool hands out blocks in its own order). backend: shape the
        KV tensors with that attention backend's get_kv_cache_shape read from
        vLLM's source (layout and order are then ignored). mark_computed: the "model" writes
        COMPUTED into the slots it computes (off: only the connector writes, for long runs)."""
        self.model, self.bs = model, block_size
        self.kbs = kernel_block_size or block_size
        self.attn_metadata, self.layer_hooks, self.check_untouched = attn_metadata, layer_hooks, check_untouched
        self.mark_computed = mark_computed
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(model.n_layers)]
        self.vllm_config = _vllm_config(model, extra, block_size, num_blocks, token_budget, prefix_caching, policy,
                                        module, class_name, max_model_len, max_num_seqs)
        self.policy = policy or "recompute"
        heads = local_kv_heads or model.kv_heads  # a tensor-parallel rank's KV heads
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=model.head_dim, dtype=dtype)
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * num_blocks, shared_by=[n])
                              for n in self.layer_names],
            kv_cache_groups=[KVCacheGroupSpec(list(self.layer_names), spec)])
        self._hasher = self._block_hasher()
        self.sched = Scheduler(self.vllm_config, self.kv_cache_config, object.__new__(StructuredOutputManager),
                               block_size=block_size, log_stats=False)
        self.scheduler = self.sched.connector
        self._spy()
        self._start_worker(heads, dtype, num_blocks, layout, order, backend, cache_layout, extra_layers)
        self.reqs: Dict[str, tuple] = {}        # request id -> (harness Request, vLLM Request)
        self._live: set = set()                 # ids of requests vLLM still holds
        self.finished: Dict[str, Request] = {}
        self.fail_alloc: Dict[str, int] = {}
        self.preempt_next: set = set()
        self.steps: List[Dict[str, Any]] = []
        self.metas: List[Any] = []
        self.recomputed: set = set()
        self.async_slots: Dict[str, set] = {}
        self.async_promoted: List[str] = []
        self._tables: Dict[str, List[int]] = {}  # the worker's block table per request

    def _start_worker(self, heads: int, dtype: Any, num_blocks: int, layout: str, order: str,
                      backend: Optional[str], cache_layout: str, extra_layers: Optional[Dict[str, Optional[int]]]) -> None:
        """The worker-role connector as a worker process makes it, then its KV caches (as
        GPUModelRunner.initialize_kv_cache hands them over) and the handshake."""
        kv_transfer_state.ensure_kv_transfer_shutdown()
        kv_transfer_state.ensure_kv_transfer_initialized(self.vllm_config, self.kv_cache_config)
        self.worker = kv_transfer_state.get_kv_transfer_group()
        self.worker.get_required_kvcache_layout(self.vllm_config)
        kernel_blocks, D = num_blocks * (self.bs // self.kbs), self.model.head_dim

        def one() -> torch.Tensor:
            if backend:
                return backends.make_backend_cache(self.vllm_dir, backend, kernel_blocks, self.kbs, heads, D, dtype,
                                                   cache_layout)
            return make_cache(layout, kernel_blocks, self.kbs, heads, D, dtype, order)
        self.caches = {n: one() for n in self.layer_names}
        first = next(iter(self.caches.values()))
        self.layout = backends.logical_layout(tuple(first.shape), kernel_blocks, self.kbs, heads, D) if backend else layout
        for n, share in (extra_layers or {}).items():
            self.caches[n] = self.caches[self.layer_names[share]] if share is not None else one()
        self.worker.register_kv_caches(dict(self.caches))
        self.worker.set_host_xfer_buffer_ops(lambda *a: None)
        hs = self.worker.get_handshake_metadata()
        self.scheduler.set_xfer_handshake_metadata({0: hs} if hs is not None else {})

    vllm_dir = ""  # set by the suite: the vllm package directory (backends are read from it)

    def _block_hasher(self) -> Any:
        fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(fn)
        return get_request_block_hasher(self.bs, fn)

    def _spy(self) -> None:
        """Test controls and observations wrapped around the real methods (each calls through)."""
        km, s = self.sched.kv_cache_manager, self.sched
        alloc, promote, invalid = km.allocate_slots, s._update_waiting_for_remote_kv, s._update_requests_with_invalid_blocks

        def allocate_slots(request: Any, *a: Any, **kw: Any) -> Any:
            left = self.fail_alloc.get(request.request_id, 0)
            if left > 0:
                self.fail_alloc[request.request_id] = left - 1
                return None
            return alloc(request, *a, **kw)

        def update_waiting(request: Any) -> None:
            self.async_promoted.append(request.request_id)
            promote(request)

        def invalid_blocks(*a: Any, **kw: Any) -> Any:
            out = invalid(*a, **kw)
            if s.recompute_kv_load_failures:
                self.recomputed |= out[0]
            return out
        km.allocate_slots, s._update_waiting_for_remote_kv = allocate_slots, update_waiting
        s._update_requests_with_invalid_blocks = invalid_blocks

    # -- requests
    def add_request(self, req: Request) -> None:
        extra = {"kv_transfer_params": req.kv_transfer_params} if req.kv_transfer_params is not None else None
        sp = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, extra_args=extra)
        real = VRequest(req.request_id, list(req.prompt_token_ids), sp, None, cache_salt=req.cache_salt,
                        block_hasher=self._hasher)
        self.reqs[req.request_id] = (req, real)
        self._live.add(req.request_id)
        self.sched.add_request(real)
        self._sync([req.request_id])

    def abort(self, request_id: str) -> None:
        self.sched.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self._sync()

    def _sync(self, rids: Optional[List[str]] = None) -> None:
        """Mirrors each vLLM request into its harness Request (blocks kept once it finished)."""
        km = self.sched.kv_cache_manager
        for rid in list(self._live) if rids is None else rids:
            h, real = self.reqs[rid]
            done = RequestStatus.is_finished(real.status)
            h.status = _finished_name(real.status) if done else real.status.name
            h.num_computed_tokens, h.num_preemptions = real.num_computed_tokens, real.num_preemptions
            h.output_token_ids = list(real.output_token_ids)
            if not done or rid in self.sched.requests:
                ids = list(km.get_block_ids(rid)[0])
                if ids or not done:
                    h.blocks = ids
            if done:
                self.finished[rid] = h
                if rid not in self.sched.requests:
                    self._live.discard(rid)

    # -- state, as the stand-in exposes it
    @property
    def waiting(self) -> List[Request]:
        return [self.reqs[r.request_id][0] for r in list(self.sched.waiting) + list(self.sched.skipped_waiting)]

    @property
    def running(self) -> List[Request]:
        return [self.reqs[r.request_id][0] for r in self.sched.running]

    @property
    def delayed(self) -> Dict[str, Request]:
        """Finished requests whose blocks vLLM still holds (an async load in flight)."""
        return {rid: self.reqs[rid][0] for rid, r in self.sched.requests.items() if r.is_finished()}

    @property
    def free(self) -> List[int]:
        pool = self.sched.kv_cache_manager.block_pool
        return [b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null]

    def uncache(self, req: Request, index: int) -> None:
        """Evicts block `index` of req from the prefix cache."""
        self.sched.kv_cache_manager.evict_blocks({req.blocks[index]})

    def cached_blocks(self, req: Request, n: int) -> int:
        """How many of req's first n blocks are in the prefix cache."""
        pool = self.sched.kv_cache_manager.block_pool
        return sum(pool.blocks[b].block_hash is not None for b in req.blocks[:n])

    # -- one engine step: EngineCore.step without the processes
    def step(self) -> Dict[str, Any]:
        if self.preempt_next:
            self._preempt_step()
        so = self.sched.schedule()
        self._sync()  # blocks as scheduled (a request may finish and free them in this step)
        meta = so.kv_connector_metadata
        assert meta is not None and isinstance(meta, KVConnectorMetadata)
        self.metas.append(meta)
        for spec in getattr(meta, "loads", []):
            if getattr(spec, "asynchronous", False):
                self.async_slots[spec.req_id] = set(slots_of(spec.block_ids, self.bs, spec.t0, spec.t1))
        wso = copy.copy(so)  # what a worker receives: the metadata crosses processes pickled
        wso.kv_connector_metadata = pickle.loads(pickle.dumps(meta))
        out = self._execute(wso)
        kvo = out.kv_connector_output
        info = {"scheduled": dict(so.num_scheduled_tokens), "errors": set(kvo.invalid_block_ids) if kvo else set()}
        for rid in (kvo.finished_recving or ()) if kvo else ():
            self.async_slots.pop(rid, None)
        self.sched.update_from_output(so, out)
        self.steps.append(info)
        self._sync()
        return info

    def _preempt_step(self) -> None:
        """A step in which the scheduler itself preempts the requests of preempt_next: they go
        to the end of the running queue (the scheduler preempts from there) and the first running
        request's allocation is refused until they are preempted. The request that resumes them
        is the next step (vLLM resumes none in the step that preempts)."""
        victims = [self.reqs[rid][1] for rid in sorted(self.preempt_next)]
        self.preempt_next = set()
        running = self.sched.running
        victims = [r for r in victims if r in running]
        if not victims:
            return
        running[:] = [r for r in running if r not in victims] + victims
        first = running[0].request_id
        self.fail_alloc[first] = self.fail_alloc.get(first, 0) + len(victims)
        self.step()
        assert all(r.status == RequestStatus.PREEMPTED for r in victims), "not preempted"

    def _starts(self, so: Any) -> Dict[str, int]:
        """The worker's view: tokens computed before this step and the block table of each request."""
        starts = {}
        for nr in so.scheduled_new_reqs:
            self._tables[nr.req_id] = list(nr.block_ids[0])
            starts[nr.req_id] = nr.num_computed_tokens
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            new = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                self._tables[rid] = list(new[0]) if new else []
            elif new:
                self._tables.setdefault(rid, []).extend(new[0])
            starts[rid] = cr.num_computed_tokens[i]
        for rid in so.finished_req_ids:
            self._tables.pop(rid, None)
        return starts

    def _execute(self, so: Any) -> ModelRunnerOutput:
        w, meta = self.worker, so.kv_connector_metadata
        kv_transfer_state._KV_CONNECTOR_AGENT = w  # this engine's worker (several engines share the process)
        w.handle_preemptions(meta)
        starts = self._starts(so)
        forward = so.total_num_scheduled_tokens > 0
        md = {n: object() for n in self.layer_names} if self.attn_metadata and forward else None
        fc = ForwardContext(no_compile_layers={n: SimpleNamespace(kv_cache=t) for n, t in self.caches.items()},
                            vllm_config=self.vllm_config, attn_metadata=md, slot_mapping={})
        before = {n: t.clone() for n, t in self.caches.items()} if self.check_untouched else None
        with override_forward_context(fc):
            with KVConnectorModelRunnerMixin._get_kv_connector_output(so, wait_for_save=forward) as kvo:
                if before is not None:
                    _check_untouched(self, before, meta)
                self._forward(so, starts, md)
        if not forward:  # kv_connector_no_forward
            if kvo.is_empty():
                return EMPTY_MODEL_RUNNER_OUTPUT
            out = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
            out.kv_connector_output = kvo
            return out
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            real = self.reqs[rid][1]
            sampled.append([SAMPLED] if starts[rid] + so.num_scheduled_tokens[rid] >= real.num_tokens else [])
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kvo)

    def _forward(self, so: Any, starts: Dict[str, int], md: Any) -> None:
        for rid, n in so.num_scheduled_tokens.items() if self.mark_computed else ():
            for s in slots_of(self._tables[rid], self.bs, starts[rid], starts[rid] + n):
                for t in self.caches.values():
                    slot_view(t, self.layout, s).fill_(COMPUTED)
        if md is not None and self.layer_hooks:
            for n in self.layer_names:
                self.worker.wait_for_layer_load(n)
                self.worker.save_kv_layer(n, self.caches[n], md[n])

    def run(self, max_steps: int = 50, max_wait_s: float = 60.0) -> None:
        """Steps until no request is left (the scheduler's own count); steps that only wait for
        async loads do not count, up to max_wait_s of them."""
        deadline = time.monotonic() + max_wait_s
        steps = 0
        while self.sched.has_unfinished_requests() or self.delayed:
            if steps >= max_steps or time.monotonic() > deadline:
                raise AssertionError("requests did not finish")
            if self.step()["scheduled"] or not self._loading():
                steps += 1
            else:
                time.sleep(0.002)

    def _loading(self) -> bool:
        return bool(self.delayed) or any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                                         for r in self.sched.skipped_waiting)

    def shutdown(self) -> None:
        self.sched.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        kv_transfer_state.ensure_kv_transfer_shutdown()
