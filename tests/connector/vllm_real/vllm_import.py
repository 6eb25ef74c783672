"""Imports vLLM's real v1 scheduler beside Debian's Python packages (torch 1.13, no msgspec, no
transformers), replacing only what cannot be imported, and records every replacement (report(),
printed in the suite's header):

- msgspec: a pure-Python Struct (msgspec_lite), when msgspec is not installed;
- torch 2.x names touched while vLLM's modules are imported (custom-op registration, dtypes,
  torch.compile, a few submodules): stand-ins that raise if anything calls them;
- regex, when absent: the standard library's re (vLLM compiles patterns at import);
- packages imported at module level but never called on the scheduler path (transformers,
  huggingface_hub, ...), when absent: modules whose every attribute is an inert class, and
  transformers' version for importlib.metadata;
- the tensor-parallel group (one_process_tp_group): one process stands for any rank.

vLLM comes from whatever `import vllm` finds (the suite puts an unpacked snapshot first on
sys.path when it has one). VLLM_USE_V2_MODEL_RUNNER=0: the V1 runner, whose connector mixin the
suite drives.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
from types import SimpleNamespace
import warnings
from typing import Any, List, Optional

REPLACED: List[str] = []
_FINDERS: List[Any] = []       # inert packages
_TORCH_FINDER: List[Any] = []  # inert torch submodules

# Imported by vLLM modules on the scheduler path at import time, never called there.
INERT_PACKAGES = ("transformers", "huggingface_hub", "safetensors", "gguf", "aiohttp", "openai", "openai_harmony",
                  "pybase64", "uvloop", "cpuinfo", "llguidance", "xgrammar", "cachetools", "zmq", "cloudpickle",
                  "cbor2", "tqdm", "prometheus_client", "filelock", "xxhash", "einops", "triton", "soundfile", "cv2")
INERT_VERSIONS = {"transformers": "5.0.0"}
# absent packages used at import time through an API the standard library has
ALIASES = {"regex": "re"}


class _InertMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _inert_class(f"{cls.__name__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


class _Inert(metaclass=_InertMeta):
    """Stands for any name of an absent package: subclassable, usable in annotations; calling it
    or anything it returns raises, so a use on the tested path cannot pass silently."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise RuntimeError(f"{type(self).__name__}: an inert stand-in for a package the test does not provide "
                           "was called")


def _inert_class(qualname: str) -> type:
    return _InertMeta(qualname.rsplit(".", 1)[-1], (_Inert,), {"__qualname__": qualname, "__module__": "inert"})


class _InertModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _inert_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the absent packages of INERT_PACKAGES (and their submodules) as inert modules;
    answers importlib.metadata for them too."""

    def __init__(self, names: List[str]):
        self.names = set(names)
        self.served: List[str] = []  # what vLLM actually imported

    def _ours(self, fullname: str) -> bool:
        return any(fullname == n or fullname.startswith(n + ".") for n in self.names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not self._ours(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        self.served.append(spec.name)
        m = _InertModule(spec.name)
        m.__path__ = []
        m.__version__ = INERT_VERSIONS.get(spec.name, "0.0.0")
        return m

    def exec_module(self, module: Any) -> None:
        return None

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()) -> Any:
        name = getattr(context, "name", None)
        if name in self.names and name in INERT_VERSIONS:
            return [_Dist(name, INERT_VERSIONS[name])]
        return []


class _Dist(importlib.metadata.Distribution):
    def __init__(self, name: str, version: str):
        self._text = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"

    def read_text(self, filename: str) -> Optional[str]:
        return self._text if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path: Any) -> Any:
        return path


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _install_aliases() -> None:
    for name, std in ALIASES.items():
        if not _importable(name):
            sys.modules[name] = importlib.import_module(std)
            REPLACED.append(f"{name}: the standard library's {std} (vLLM compiles patterns with it at import)")


def _install_inert_packages() -> None:
    absent = [n for n in INERT_PACKAGES if not _importable(n)]
    if absent:
        _FINDERS.append(_InertFinder(absent))
        sys.meta_path.append(_FINDERS[-1])
    versions = [n for n in absent if n in INERT_VERSIONS]
    if versions:
        REPLACED.append("importlib.metadata version of " + ", ".join(f"{n} ({INERT_VERSIONS[n]})" for n in versions))


def _install_msgspec() -> None:
    if _importable("msgspec"):
        return
    import msgspec_lite
    msgspec_lite.install()
    REPLACED.append("msgspec: msgspec_lite (pure-Python Struct, field, structs.replace/asdict; no encoding)")


def _raises(what: str) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{what}: a torch 2.x feature stood in for on torch {_torch_version()}")
    return fail


# torch 2.x modules vLLM's modules import (served as inert modules when absent)
TORCH_MODULES = ["torch._inductor", "torch.distributed._functional_collectives", "torch.distributed._symmetric_memory",
                 "torch.func"]
# (module, name) pairs of torch 2.x that vLLM's modules import; lower-case names are functions
TORCH_NAMES = [("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
               ("torch.distributed.distributed_c10d", "_get_default_timeout"),
               ("torch.distributed.distributed_c10d", "_unregister_process_group"),
               ("torch.cuda.memory", "CUDAPluggableAllocator"),
               ("torch.nn.modules.module", "register_module_module_registration_hook")]


def _inert_function(what: str) -> Any:
    return _raises(what)


def _torch_version() -> str:
    import torch
    return torch.__version__


def _torch_gaps() -> None:
    """Names vLLM's modules touch at import time that torch 1.13 lacks."""
    import torch
    import torch.library as tl
    added = []

    def put(obj: Any, name: str, value: Any, label: str) -> None:
        if not hasattr(obj, name):
            setattr(obj, name, value)
            added.append(label)

    put(tl, "infer_schema", _infer_schema, "torch.library.infer_schema (types from annotations only)")
    if not getattr(tl.Library, "_kvfold_fragments", False):
        tl.Library = _fragment_library(tl.Library)
        added.append('torch.library.Library(kind="FRAGMENT") (registers nothing: vLLM\'s custom ops stay absent)')
    put(tl, "register_fake", lambda *a, **kw: (lambda f: f), "torch.library.register_fake")
    put(tl, "custom_op", lambda *a, **kw: (lambda f: f), "torch.library.custom_op")
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                 "float4_e2m1fn_x2", "uint16", "uint32", "uint64"):
        put(torch, name, _FakeDtype(name), f"torch.{name}")
    put(torch, "compile", _identity_decorator, "torch.compile (the function itself)")
    if not hasattr(torch, "compiler"):
        torch.compiler = _compiler_module()
        sys.modules["torch.compiler"] = torch.compiler
        added.append("torch.compiler (decorators return the function; is_compiling() is False)")
    if not hasattr(getattr(torch, "Tag", None), "needs_fixed_stride_order"):
        torch.Tag = _inert_class("torch.Tag")
        added.append("torch.Tag (2.x tags)")
    for name in ("SymInt", "SymFloat", "SymBool", "Event", "Stream"):
        put(torch, name, _inert_class(f"torch.{name}"), f"torch.{name}")
    if not getattr(torch.finfo, "_kvfold", False):
        torch.finfo = _finfo(torch.finfo)
        added.append("torch.finfo of the float8 stand-ins")
    for mod, name in TORCH_NAMES:
        m = importlib.import_module(mod)
        put(m, name, _inert_function(f"{mod}.{name}") if name[0].islower() else _inert_class(f"{mod}.{name}"),
            f"{mod}.{name}")
    absent = [n for n in TORCH_MODULES if not _importable(n)]
    if absent:
        _TORCH_FINDER.append(_InertFinder(absent))
        sys.meta_path.append(_TORCH_FINDER[-1])
    if added:
        REPLACED.append("torch 2.x names absent from torch " + torch.__version__ + ": " + ", ".join(added))


def _compiler_module() -> Any:
    class Compiler(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("is_"):
                return lambda *a, **kw: False
            return _identity_decorator
    return Compiler("torch.compiler")


def _identity_decorator(fn: Any = None, **kwargs: Any) -> Any:
    return fn if fn is not None else (lambda f: f)


def _schema_type(t: Any) -> str:
    import typing
    if t is None or t is type(None):
        return "()"
    if typing.get_origin(t) is tuple:
        return "(" + ", ".join(_schema_type(a) for a in typing.get_args(t)) + ")"
    return "Tensor" if "Tensor" in str(t) else "Any"


def _infer_schema(fn: Any, *args: Any, **kwargs: Any) -> str:
    """A schema string shaped as torch 2.x's infer_schema makes it (vLLM parses its returns)."""
    import inspect
    import typing
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = getattr(fn, "__annotations__", {})
    params = [f"{_schema_type(hints.get(n))} {n}" for n in inspect.signature(fn).parameters]
    return f"({', '.join(params)}) -> {_schema_type(hints.get('return'))}"


def _fragment_library(real: type) -> type:
    """torch 1.13's Library refuses kind "FRAGMENT"; such a library here registers nothing."""

    class Library(real):
        _kvfold_fragments = True

        def __init__(self, ns: str, kind: str, *args: Any, **kwargs: Any):
            self._fragment = kind == "FRAGMENT"
            if self._fragment:
                self.ns, self.kind = ns, kind
                return
            super().__init__(ns, kind, *args, **kwargs)

        def __getattribute__(self, name: str) -> Any:
            if object.__getattribute__(self, "_fragment"):
                if name == "define":
                    return object.__getattribute__(self, "_define_inert")
                if name in ("impl", "_register_fake", "fallback"):
                    return lambda *a, **kw: None
            return super().__getattribute__(name)

        def _define_inert(self, schema: str, *args: Any, **kwargs: Any) -> None:
            import torch
            op, _, overload = schema.split("(", 1)[0].partition(".")
            ns = getattr(torch.ops, self.ns)
            packet = ns.__dict__.get(op) or _InertOp(f"{self.ns}::{op}")
            setattr(ns, op, packet)
            if overload:
                setattr(packet, overload, _InertOp(f"{self.ns}::{op}.{overload}"))

        def __del__(self) -> None:
            if not self._fragment:
                super().__del__()
    return Library


class _InertOp:
    """torch.ops.<ns>.<op> of a fragment library: present (vLLM checks), raises when called."""

    def __init__(self, name: str):
        self.name, self.default = name, self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"torch.ops.{self.name}: vLLM's custom op is not registered on this torch")


def _finfo(real: Any) -> Any:
    def finfo(dtype: Any = None) -> Any:
        if isinstance(dtype, _FakeDtype):
            big = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0}.get(dtype.name, 57344.0)
            return SimpleNamespace(max=big, min=-big, bits=8, eps=0.125, tiny=2.0 ** -6, dtype=dtype.name)
        return real(dtype) if dtype is not None else real()
    finfo._kvfold = True
    return finfo


class _FakeDtype:
    """A dtype torch 1.13 lacks: comparable and hashable, never used to allocate."""

    def __init__(self, name: str):
        self.name = name
        self.is_floating_point = name.startswith("float")
        self.itemsize = 1 if "8" in name or "4" in name else int(name[4:]) // 8

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class _OneProcessGroup:
    """The tensor-parallel group of one process standing for rank _TP_RANK of _TP_SIZE."""

    def __init__(self, ps: Any):
        self._ps = ps

    @property
    def rank_in_group(self) -> int:
        return self._ps._TP_RANK

    @property
    def world_size(self) -> int:
        return self._ps._TP_SIZE

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        return obj


def one_process_tp_group() -> None:
    """vLLM's tensor-parallel group needs torch.distributed and a process per rank; the worker
    connector reads only its rank and size (and its engine id is broadcast to itself)."""
    import vllm.distributed.parallel_state as ps
    if getattr(ps, "_TP_RANK", None) is None:
        ps._TP_RANK, ps._TP_SIZE = 0, 1
        group = _OneProcessGroup(ps)
        ps.get_tp_group = lambda: group
        REPLACED.append("vllm.distributed.parallel_state.get_tp_group: one process stands for a tensor-parallel "
                        "rank (parallel_state._TP_RANK of _TP_SIZE; no torch.distributed group)")


def report() -> List[str]:
    """What was replaced, including the inert modules vLLM actually imported."""
    out = list(REPLACED)
    for finders, what in ((_TORCH_FINDER, "torch 2.x modules absent from this torch, served inert"),
                          (_FINDERS, "absent packages vLLM imports but never calls on the scheduler path, served "
                                     "inert")):
        names = sorted({n.split(".")[0] if finders is _FINDERS else n for f in finders for n in f.served})
        if names:
            out.append(f"{what}: {', '.join(names)}")
    return out


def prepare(source: Optional[str] = None) -> None:
    """Makes `import vllm...` work; source: a directory holding vllm/ (and pydantic 2)."""
    if source:
        sys.path.insert(0, source)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the V1 runner, whose connector mixin is driven
    warnings.filterwarnings("ignore", message="Failed to read commit hash", category=RuntimeWarning)
    _install_msgspec()
    _torch_gaps()
    _install_aliases()
    _install_inert_packages()
