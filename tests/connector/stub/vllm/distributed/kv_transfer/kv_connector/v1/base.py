"""vllm.distributed.kv_transfer.kv_connector.v1.base, reduced to the v1 connector API as the
conformance review (docs/connector.md, vLLM 52a31cce) describes it: the same
class names, abstract methods, defaults and signatures; written from that description, not copied.
The 0.26 profile adds the later defaulted members."""
import enum
from abc import ABC, abstractmethod
from typing import Any, Iterable, Optional

import vllm


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024 - empty on purpose, as in vLLM
    pass


class KVConnectorBase_V1(ABC):
    prefer_cross_layer_blocks = False

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        self._connector_metadata: Optional[KVConnectorMetadata] = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KV connectors")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # worker-side metadata binding (concrete in vLLM)
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    # worker side
    def register_kv_caches(self, kv_caches: dict) -> None:
        return

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        return

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        return

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        return

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set) -> tuple:
        return None, None

    def get_block_ids_with_load_errors(self) -> set:
        return set()

    def get_kv_connector_stats(self) -> Any:
        return None

    def get_kv_connector_kv_cache_events(self) -> Any:
        return None

    def build_connector_worker_meta(self) -> Any:
        return None

    def get_handshake_metadata(self) -> Any:
        return None

    def shutdown(self) -> None:
        return None

    # scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata: ...

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        return

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        return

    def on_new_request(self, request: Any) -> None:
        return

    def update_connector_output(self, connector_output: Any) -> None:
        return

    def request_finished(self, request: Any, block_ids: list) -> tuple:
        return False, None

    def take_events(self) -> Iterable[Any]:
        return ()

    def get_finished_count(self) -> Optional[int]:
        return None

    def reset_cache(self) -> Optional[bool]:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> Any:
        return None

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> Any:
        return None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        if cls is KVConnectorBase_V1:  # vLLM raises when asked on the base class itself
            raise TypeError("get_required_kvcache_layout should not be called on the abstract base class")
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict) -> bool:
        return False

    if vllm.PROFILE >= "0.26":  # defaulted members of the later base class
        requires_kv_delivery = False

        def has_pending_push_work(self) -> bool:
            return False

        def set_xfer_handshake_metadata_pp_aware(self, metadata: dict) -> None:
            return
