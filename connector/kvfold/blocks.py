"""vLLM's KV cache tensors: layouts, dtypes, and copying a decoded cache into their blocks.

A layout is recognised by the tensor's logical shape (vLLM allocates in a backend's stride order
and permutes back to the logical shape, so NHD, HND and FlexAttention's order differ only in
strides, which every copy goes through). The logical shapes, with the vLLM versions that use them
(docs/connector.md, "KV layouts"):

  kv_first      (2, blocks, block_size, kv_heads, head_dim)    FlashAttention to v0.22;
                                                               FlexAttention and the ROCm backends
                                                               (ROCM_ATTN, ROCM_AITER_FA,
                                                               ROCM_AITER_UNIFIED_ATTN) at 28be48fa
  blocks_first  (blocks, 2, block_size, kv_heads, head_dim)    FlashAttention from v0.23;
                                                               FlashInfer, Triton, FlexAttention
  cpu           (2, blocks, kv_heads, block_size, head_dim)    the CPU backend (5-D era)
  packed        (blocks, kv_heads, block_size, 2 * head_dim)   every standard backend from v0.26
                                                               (v0.26+): K, then V, in the last dim
                                                               (FlexAttention's get_kv_cache_shape
                                                               at 00507c2e returns it)

Host tensors are written by the C extension (kvfold._kvfold.copy_blocks), which is given each
tensor's memory as a writable buffer and checks that every element it writes lies inside it.
Tensors on another device (CUDA) are written with torch: the slice of the decoded cache goes into
a pinned host buffer, one non-blocking copy sends it on the current stream, and index_put_
scatters it into the blocks through the tensor's strides.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _kvfold

LAYOUTS = ("kv_first", "blocks_first", "cpu", "packed")
# kv_layout names a backend (or a layout); the backend's layouts across vLLM versions may match.
LAYOUT_ALIASES: Dict[str, Tuple[str, ...]] = {
    **{lay: (lay,) for lay in LAYOUTS},
    "flash_attn": ("blocks_first", "kv_first", "packed"),
    "flashattention": ("blocks_first", "kv_first", "packed"),
    "flash_attention": ("blocks_first", "kv_first", "packed"),
    "flashinfer": ("blocks_first", "packed"),
    "triton": ("blocks_first", "packed"),
    "triton_attn": ("blocks_first", "packed"),
    "flex_attention": ("kv_first", "blocks_first", "packed"),
    "flexattention": ("kv_first", "blocks_first", "packed"),
    "rocm_attn": ("kv_first",),
    "rocm_aiter_fa": ("kv_first",),
    "rocm_aiter_unified_attn": ("kv_first",),
    "cpu": ("cpu", "packed"),
    "cpu_attn": ("cpu", "packed"),
}
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
# dimension of (K/V, blocks, tokens, heads) in each logical shape; packed has K/V in the last dim
_DIMS = {"kv_first": (0, 1, 2, 3), "blocks_first": (1, 0, 2, 3), "cpu": (0, 1, 3, 2), "packed": (None, 0, 2, 1)}
_SHAPES = {"kv_first": "(2, blocks, block_size, kv_heads, head_dim)",
           "blocks_first": "(blocks, 2, block_size, kv_heads, head_dim)",
           "cpu": "(2, blocks, kv_heads, block_size, head_dim)",
           "packed": "(blocks, kv_heads, block_size, 2 * head_dim)"}


def dtype_name(dtype: Any) -> str:
    s = str(dtype).replace("torch.", "")
    if "float8" in s or s.startswith("fp8") or s in ("uint8", "int8"):
        raise ValueError(f"KV cache dtype {s}: fp8 (and fp4) caches are not supported by kvfold (serve with "
                         "kv_cache_dtype='auto', i.e. bfloat16 or float16)")
    if s not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"KV cache dtype {s} is not supported (bfloat16 or float16)")
    return s


def kernel_block_size(layout: str, shape: Sequence[int]) -> int:
    return int(shape[_DIMS[layout][2]])


def _matches(layout: str, shape: Sequence[int], block_size: int, kv_heads: int, head_dim: int) -> bool:
    kv, _, tok, head = _DIMS[layout]
    if layout == "packed":
        if len(shape) != 4 or shape[3] != 2 * head_dim:
            return False
    elif len(shape) != 5 or shape[kv] != 2 or shape[4] != head_dim:
        return False
    kbs = shape[tok]
    return shape[head] == kv_heads and kbs > 0 and block_size % kbs == 0


def detect_layout(shape: Sequence[int], block_size: int, kv_heads: int, head_dim: int, device_type: str,
                  override: Optional[str] = None, name: str = "") -> str:
    """The layout of a KV cache tensor from its logical shape. kv_layout (override) names a backend
    or a layout and narrows the candidates to that backend's layouts; the shape must match one. A
    host tensor matching the cpu layout is taken as such (vLLM's CPU backend); a device tensor is
    never the cpu layout."""
    shape = tuple(int(s) for s in shape)
    candidates = LAYOUTS
    if override:
        candidates = LAYOUT_ALIASES.get(override.lower())
        if candidates is None:
            raise ValueError(f"kv_layout '{override}' is not one of {', '.join(sorted(LAYOUT_ALIASES))}")
    found = [lay for lay in candidates if _matches(lay, shape, block_size, kv_heads, head_dim)]
    if len(found) > 1:
        narrowed = ["cpu"] if device_type == "cpu" and "cpu" in found else [x for x in found if x != "cpu"]
        found = narrowed or found
    if len(found) != 1:
        what = "matches none" if not found else "is ambiguous between " + " and ".join(found)
        of = ", ".join(f"{lay} {_SHAPES[lay]}" for lay in candidates)
        hint = "" if override else "; set kv_connector_extra_config 'kv_layout' to the attention backend"
        raise ValueError(f"{name}: KV cache shape {shape} {what} of the layouts {of}"
                         f"{' of kv_layout ' + repr(override) if override else ''} for {kv_heads} kv heads, "
                         f"head_dim {head_dim}, blocks of {block_size}{hint}")
    return found[0]


def check_block_size(block_size: int, cp_size: int = 1) -> None:
    """block_size: the scheduler's, cp_size context-parallel ranks share each block."""
    if block_size % cp_size or block_size // cp_size not in SUPPORTED_BLOCK_SIZES:
        per = f" ({block_size / cp_size:g} per context-parallel rank)" if cp_size > 1 else ""
        raise ValueError(f"block size {block_size}{per} is not supported by kvfold "
                         f"({', '.join(map(str, SUPPORTED_BLOCK_SIZES))}{' per rank' if cp_size > 1 else ''})")


def host_destination(t: Any, layer: int) -> Tuple[Any, int, Tuple[int, ...], Tuple[int, ...], str, int]:
    """(buffer, offset, shape, strides, dtype, layer) of a host tensor for copy_blocks: the buffer
    is a writable numpy view of the tensor's whole storage, so the C side checks every write."""
    import torch
    st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    es = t.element_size()
    whole = torch.empty(0, dtype=t.dtype).set_(st, 0, (st.nbytes() // es,), (1,))  # the whole storage, 1-D
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[es]
    return (whole.view(as_int).numpy(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()),
            dtype_name(t.dtype), int(layer))


def copy_to_blocks(src: Any, src_dtype: str, n_layers: int, C: int, src_heads: int, head_dim: int,
                   tensors: List[Any], layout: str, block_ids: Sequence[int], block_size: int, t0: int, t1: int,
                   head_start: int = 0, use_torch: bool = False, kv_heads: int = -1,
                   destinations: Optional[List[Any]] = None, cp: Tuple[int, int, int] = (1, 0, 1),
                   layers: Optional[Sequence[int]] = None, head_major: bool = False) -> None:
    """Write tokens [t0, t1) of a decoded cache (src: [2, n_layers, C, src_heads, head_dim] in
    src_dtype, or [2, n_layers, src_heads, C, head_dim] with head_major) into the tensors: layer layers[i] (default i) into tensors[i]. block_size is the scheduler's (per-rank block size
    x context-parallel size); cp = (size, rank, interleave) of context parallelism, whose tokens
    this rank holds as vLLM's block table spreads them. destinations: host_destination of each
    tensor, when the caller keeps them."""
    if t1 <= t0:
        return
    layers = list(range(len(tensors))) if layers is None else list(layers)
    on_host = all(t.device.type == "cpu" for t in tensors)
    if on_host and not use_torch:
        dst = destinations or [host_destination(t, i) for t, i in zip(tensors, layers)]
        _kvfold.copy_blocks(src, src_dtype, n_layers, C, src_heads, head_dim, dst, layout, list(block_ids),
                            block_size, t0, t1, head_start, kv_heads, *cp, head_major)
        return
    check_block_size(block_size, cp[0])
    _copy_torch(src, src_dtype, n_layers, C, src_heads, head_dim, tensors, layout, block_ids, block_size, t0, t1,
                head_start, cp, layers, head_major)


def _slot_index(layout: str, t: Any, block_ids: Sequence[int], block_size: int, t0: int, t1: int,
                cp: Tuple[int, int, int] = (1, 0, 1)) -> Tuple[Any, Any, Any]:
    """(kernel block, offset) on the tensor's device of each token in [t0, t1) this rank holds, and
    those tokens' indices in [0, t1 - t0)."""
    import torch
    size, rank, inter = cp
    kbs = kernel_block_size(layout, t.shape)
    pos = torch.arange(t0, t1)
    vo = pos % block_size
    mine = (vo // inter) % size == rank
    pos, vo = pos[mine], vo[mine]
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    slots = ids[pos // block_size] * (block_size // size) + vo // (size * inter) * inter + vo % inter
    return (slots // kbs).to(t.device), (slots % kbs).to(t.device), (pos - t0)


def put_slots(t: Any, layout: str, kb: Any, off: Any, x: Any) -> None:
    """Write x ([2, n, H, D]: K, V of n tokens) into slots (kb, off) of t, through its strides."""
    if layout == "kv_first":
        t[:, kb, off] = x  # (2, blocks, bs, H, D): adjacent indices keep their place
    elif layout == "blocks_first":
        t[kb, :, off] = x.transpose(0, 1)  # (blocks, 2, bs, H, D): indexed dims go first
    elif layout == "cpu":
        t[:, kb, :, off] = x.transpose(0, 1)  # (2, blocks, H, bs, D)
    else:
        t[kb, :, off] = x.permute(1, 2, 0, 3).reshape(x.shape[1], x.shape[2], 2 * x.shape[3])  # (blocks, H, bs, 2D)


def _copy_torch(src: Any, src_dtype: str, n_layers: int, C: int, src_heads: int, head_dim: int,
                tensors: List[Any], layout: str, block_ids: Sequence[int], block_size: int, t0: int, t1: int,
                head_start: int, cp: Tuple[int, int, int], layers: List[int], head_major: bool = False) -> None:
    import torch  # only here: importing kvfold must not start CUDA

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    whole = torch.frombuffer(src, dtype=tdt[src_dtype], count=2 * n_layers * C * src_heads * head_dim)
    if head_major:
        whole = whole.view(2, n_layers, src_heads, C, head_dim).transpose(2, 3)  # [2, L, C, H, D], a view
    else:
        whole = whole.view(2, n_layers, C, src_heads, head_dim)
    first = tensors[0]
    kv_heads = first.shape[_DIMS[layout][3]]
    kb, off, rows = _slot_index(layout, first, block_ids, block_size, t0, t1, cp)
    part = whole[:, :, t0:t1, head_start:head_start + kv_heads][:, :, rows].to(first.dtype)  # [2, L, n, H, D]
    if first.device.type != "cpu":
        part = part.pin_memory().to(first.device, non_blocking=True)  # stream-ordered before the scatter
    for layer, t in zip(layers, tensors):
        put_slots(t, layout, kb, off, part[:, layer].to(t.dtype))


def zero_slots(tensors: List[Any], layout: str, block_ids: Sequence[int], block_size: int, t0: int, t1: int,
               cp: Tuple[int, int, int] = (1, 0, 1)) -> None:
    """Zero tokens [t0, t1) of tensors that the file has no K/V for (EAGLE draft layers): the
    draft model then attends to nothing there, never to stale or NaN bytes."""
    if t1 <= t0 or not tensors:
        return
    import torch
    kb, off, rows = _slot_index(layout, tensors[0], block_ids, block_size, t0, t1, cp)
    for t in tensors:
        kv_heads, n = t.shape[_DIMS[layout][3]], len(rows)
        d = t.shape[-1] // 2 if layout == "packed" else t.shape[-1]
        put_slots(t, layout, kb, off, torch.zeros(2, n, kv_heads, d, dtype=t.dtype, device=t.device))
