"""KV cache tensors shaped as vLLM's attention backends shape them: each backend's
get_kv_cache_shape (and get_kv_cache_stride_order, where it has one) is read out of the backend's
source file and run alone (the modules themselves need compiled ops), and the tensor is built as
the GPU model runner's _reshape_kv_cache_tensors does: raw bytes viewed in the stride order's
physical shape, then permuted back to the logical shape.
"""
from __future__ import annotations

import ast
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch

# backend -> (file under vllm/v1/attention/backends, backend class)
BACKENDS = {
    "flash_attn": ("flash_attn.py", "FlashAttentionBackend"),
    "flashinfer": ("flashinfer.py", "FlashInferBackend"),
    "triton_attn": ("triton_attn.py", "TritonAttentionBackend"),
    "cpu_attn": ("cpu_attn.py", "CPUAttentionBackend"),
    "flex_attention": ("flex_attention.py", "FlexAttentionBackend"),
}


def _method(tree: ast.Module, cls: str, name: str) -> Optional[ast.FunctionDef]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
            return None
    raise LookupError(f"class {cls} not found")


def _compile(fn: ast.FunctionDef, path: str, cache_layout: str) -> Callable[..., Any]:
    fn.decorator_list = []
    mod = ast.Module(body=[fn], type_ignores=[])
    ns: Dict[str, Any] = {"torch": torch, "get_kv_cache_layout": lambda: cache_layout,
                          "kv_cache_uses_per_token_head_scales": lambda s: False,
                          "nvfp4_kv_cache_full_dim": lambda d: d}
    exec(compile(mod, path, "exec"), ns)  # noqa: S102 - vLLM's own source
    return ns[fn.name]


def read_backend(vllm_dir: str, backend: str, cache_layout: str = "NHD") -> Tuple[Callable[..., Any], Optional[Callable[..., Any]]]:
    """(get_kv_cache_shape, get_kv_cache_stride_order or None) of a backend, from its source."""
    fname, cls = BACKENDS[backend]
    path = os.path.join(vllm_dir, "v1", "attention", "backends", fname)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    shape = _method(tree, cls, "get_kv_cache_shape")
    if shape is None:
        raise LookupError(f"{path}: {cls} defines no get_kv_cache_shape")
    order = _method(tree, cls, "get_kv_cache_stride_order")
    return _compile(shape, path, cache_layout), (_compile(order, path, cache_layout) if order else None)


def make_backend_cache(vllm_dir: str, backend: str, num_blocks: int, block_size: int, kv_heads: int,
                       head_dim: int, dtype: Any, cache_layout: str = "NHD", fill: float = float("nan")) -> torch.Tensor:
    """One layer's KV cache as the model runner allocates it for this backend."""
    shape_fn, order_fn = read_backend(vllm_dir, backend, cache_layout)
    shape = tuple(shape_fn(num_blocks, block_size, kv_heads, head_dim, cache_dtype_str="auto"))
    order = tuple(order_fn()) if order_fn else tuple(range(len(shape)))
    assert len(order) == len(shape)
    phys = torch.full([shape[i] for i in order], fill, dtype=dtype)
    inv = [order.index(i) for i in range(len(order))]
    return phys.permute(*inv)


def logical_layout(shape: Tuple[int, ...], num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> str:
    """The harness's name for a logical shape (what slot_view needs to read slots back)."""
    names = {(2, num_blocks, block_size, kv_heads, head_dim): "kv_first",
             (num_blocks, 2, block_size, kv_heads, head_dim): "blocks_first",
             (2, num_blocks, kv_heads, block_size, head_dim): "cpu",
             (num_blocks, kv_heads, block_size, 2 * head_dim): "packed"}
    if tuple(shape) not in names:
        raise ValueError(f"unknown logical KV cache shape {tuple(shape)}")
    return names[tuple(shape)]
