"""vllm.distributed.parallel_state: the tensor-parallel rank and size of this worker. Tests set
_TP_RANK / _TP_SIZE to act as another rank."""
_TP_RANK = 0
_TP_SIZE = 1


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    return _TP_SIZE
