"""vLLM's KV cache tensors: layouts, dtypes, and copying a decoded cache into their blocks.

Host tensors are written by the C extension (kvfold._kvfold.copy_blocks) through their strides.
Tensors on another device (CUDA) are written with torch: the slice of the decoded cache is put in
a pinned host buffer, sent with a non-blocking copy on the current stream, and scattered into the
blocks by index_put_, which also goes through the tensor's strides (the C extension is built
without CUDA: kvfold._kvfold.WITH_CUDA is False).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from . import _kvfold

LAYOUTS = ("flash_attn", "flashinfer", "cpu")
LAYOUT_ALIASES = {"flash_attn": "flash_attn", "flashattention": "flash_attn", "flex_attention": "flash_attn",
                  "flashinfer": "flashinfer", "triton": "flashinfer", "triton_attn": "flashinfer", "cpu": "cpu",
                  "cpu_attn": "cpu"}
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)


def dtype_name(dtype: Any) -> str:
    s = str(dtype).replace("torch.", "")
    if "float8" in s or s.startswith("fp8") or s == "uint8":
        raise ValueError(f"KV cache dtype {s}: fp8 caches are not supported by kvfold (serve with "
                         "kv_cache_dtype='auto', i.e. bfloat16 or float16)")
    if s not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"KV cache dtype {s} is not supported (bfloat16 or float16)")
    return s


def _matches(layout: str, shape: Sequence[int], block_size: int, kv_heads: int, head_dim: int) -> bool:
    if len(shape) != 5:
        return False
    kv, tok, head = {"flash_attn": (0, 2, 3), "flashinfer": (1, 2, 3), "cpu": (0, 3, 2)}[layout]
    kbs = shape[tok]
    return (shape[kv] == 2 and shape[head] == kv_heads and shape[4] == head_dim and kbs > 0
            and block_size % kbs == 0)


def detect_layout(shape: Sequence[int], block_size: int, kv_heads: int, head_dim: int, device_type: str,
                  override: Optional[str] = None, name: str = "") -> str:
    """The layout of a KV cache tensor from its logical shape (the override, when given, wins but
    must match). A CPU tensor matching the CPU layout is taken as such (vLLM's CPU backend); a
    device tensor is never the CPU layout."""
    shape = tuple(int(s) for s in shape)
    if override:
        lay = LAYOUT_ALIASES.get(override.lower())
        if lay is None:
            raise ValueError(f"kv_layout '{override}' is not one of {', '.join(LAYOUTS)}")
        if not _matches(lay, shape, block_size, kv_heads, head_dim):
            raise ValueError(f"{name}: shape {shape} is not a {lay} cache of {kv_heads} kv heads x {head_dim} "
                             f"with blocks of {block_size}")
        return lay
    found = [lay for lay in LAYOUTS if _matches(lay, shape, block_size, kv_heads, head_dim)]
    if len(found) > 1:
        narrowed = ["cpu"] if device_type == "cpu" and "cpu" in found else [x for x in found if x != "cpu"]
        found = narrowed or found
    if len(found) != 1:
        what = "matches none" if not found else "is ambiguous between " + " and ".join(found)
        raise ValueError(f"{name}: KV cache shape {shape} {what} of the layouts flash_attn (2, blocks, "
                         f"block_size, kv_heads, head_dim), flashinfer (blocks, 2, block_size, kv_heads, "
                         f"head_dim), cpu (2, blocks, kv_heads, block_size, head_dim) for {kv_heads} kv heads, "
                         f"head_dim {head_dim}, blocks of {block_size}; set kv_connector_extra_config "
                         f"'kv_layout'")
    return found[0]


def check_block_size(block_size: int) -> None:
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block size {block_size} is not supported by kvfold "
                         f"({', '.join(map(str, SUPPORTED_BLOCK_SIZES))})")


def copy_to_blocks(src: Any, src_dtype: str, n_layers: int, C: int, src_heads: int, head_dim: int,
                   tensors: List[Any], layout: str, block_ids: Sequence[int], block_size: int, t0: int, t1: int,
                   head_start: int = 0, use_torch: bool = False, kv_heads: int = -1) -> None:
    """Write tokens [t0, t1) of every layer of a decoded cache (src: [2, n_layers, C, src_heads,
    head_dim] in src_dtype) into tensors[layer]."""
    if t1 <= t0:
        return
    check_block_size(block_size)
    dst_dtype = dtype_name(tensors[0].dtype)
    on_host = all(t.device.type == "cpu" for t in tensors)
    if on_host and not use_torch:
        dst = [(t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in tensors]
        _kvfold.copy_blocks(src, src_dtype, n_layers, C, src_heads, head_dim, dst, dst_dtype, layout,
                            list(block_ids), block_size, t0, t1, head_start, kv_heads)
        return
    _copy_torch(src, src_dtype, n_layers, C, src_heads, head_dim, tensors, layout, block_ids, block_size, t0, t1,
                head_start)


def _copy_torch(src: Any, src_dtype: str, n_layers: int, C: int, src_heads: int, head_dim: int,
                tensors: List[Any], layout: str, block_ids: Sequence[int], block_size: int, t0: int, t1: int,
                head_start: int) -> None:
    import torch  # only here: importing kvfold must not start CUDA

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    whole = torch.frombuffer(src, dtype=tdt[src_dtype]).view(2, n_layers, C, src_heads, head_dim)
    first = tensors[0]
    kv_heads = first.shape[2 if layout == "cpu" else 3]
    part = whole[:, :, t0:t1, head_start:head_start + kv_heads].to(first.dtype)  # [2, L, n, H, D]
    device = first.device
    if device.type != "cpu":
        part = part.pin_memory().to(device, non_blocking=True)  # stream-ordered before the scatter
    kbs = first.shape[3 if layout == "cpu" else 2]
    pos = torch.arange(t0, t1)
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    slots = ids[pos // block_size] * block_size + pos % block_size
    kb, off = (slots // kbs).to(device), (slots % kbs).to(device)
    for layer, t in enumerate(tensors):
        x = part[:, layer]  # [2, n, H, D]
        if layout == "flash_attn":
            t[:, kb, off] = x  # (2, blocks, bs, H, D): adjacent indices keep their place
        elif layout == "flashinfer":
            t[kb, :, off] = x.transpose(0, 1)  # (blocks, 2, bs, H, D): indexed dims go first
        else:
            t[:, kb, :, off] = x.transpose(0, 1)  # (2, blocks, H, bs, D)
