"""vllm.distributed.parallel_state: the tensor- and context-parallel ranks of this worker. Tests set
_TP_RANK / _TP_SIZE / _DCP_RANK / _PCP_RANK to act as another rank."""
from dataclasses import dataclass

_TP_RANK = 0
_TP_SIZE = 1
_DCP_RANK = 0
_PCP_RANK = 0


@dataclass
class GroupCoordinator:
    rank_in_group: int


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    return _TP_SIZE


def get_dcp_group() -> GroupCoordinator:
    return GroupCoordinator(_DCP_RANK)


def get_pcp_group() -> GroupCoordinator:
    return GroupCoordinator(_PCP_RANK)
