from . import parallel_state  # noqa: F401  (vllm.distributed re-exports the group getters)
from .parallel_state import get_dcp_group, get_pcp_group  # noqa: F401
