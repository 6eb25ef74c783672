"""Synthetic kvf files for the connector tests."""
import os
from typing import Any, Dict, Tuple

import numpy as np

import kvfold
from kvfold import _kvfold

FP = "ab" * 16
OTHER_FP = "cd" * 16


def header(n_layers: int, kv_heads: int, head_dim: int, C: int, doc: str, fp: str = FP, dtype: str = "bfloat16",
           method: str = "fold") -> Dict[str, Any]:
    return {"model_fingerprint": fp, "document_digest": doc, "n_doc_tokens": 4 * C, "n_tokens": C,
            "method": method, "budget": 0.25, "lambda": 0.01 if method == "fold" else 0.0, "dtype": dtype,
            "n_layers": n_layers, "kv_heads": kv_heads, "head_dim": head_dim}


def write_cache(path: str, n_layers: int, kv_heads: int, head_dim: int, C: int, seed: int, doc: str = "",
                **kw: Any) -> Tuple[np.ndarray, np.ndarray]:
    """Writes a cache of random K/V (fp32 given; the file's dtype rounds them); returns them. doc:
    the document digest (default: one per seed)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n_layers, C, kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((n_layers, C, kv_heads, head_dim), dtype=np.float32)
    doc = doc or "%032x" % (seed * 7919 + 1)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _kvfold.write(path, header(n_layers, kv_heads, head_dim, C, doc, **kw), k.tobytes(), v.tobytes())
    return k, v


def file_kv(path: str, dtype: str = "float32") -> np.ndarray:
    """[2, n_layers, C, kv_heads, head_dim] as float32, through a cache dtype."""
    h, buf = _kvfold.load(path, dtype)
    shape = (2, h["n_layers"], h["n_tokens"], h["kv_heads"], h["head_dim"])
    if dtype == "float32":
        return np.frombuffer(buf, np.float32).reshape(shape)
    import torch
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return torch.frombuffer(buf, dtype=tdt).float().numpy().reshape(shape)
