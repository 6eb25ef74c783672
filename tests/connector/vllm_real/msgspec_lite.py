"""A pure-Python stand-in for the parts of msgspec that vLLM's scheduler path uses (msgspec is not
packaged for Debian 12): Struct (fields from annotations, defaults, field(), __post_init__),
structs.replace/asdict/astuple/fields, UNSET, NODEFAULT and the error types. Nothing on the
scheduler path encodes or decodes, so msgpack/json/convert raise if they are ever called.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Dict, Tuple


class _Nodefault:
    def __repr__(self) -> str:
        return "NODEFAULT"


class UnsetType:
    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


NODEFAULT = _Nodefault()
UNSET = UnsetType()


class MsgspecError(Exception):
    pass


class ValidationError(MsgspecError, ValueError):
    pass


class DecodeError(MsgspecError, ValueError):
    pass


class EncodeError(MsgspecError, ValueError):
    pass


class FieldInfo:
    """What structs.fields() returns per field (the names vLLM reads)."""

    def __init__(self, name: str, default: Any = NODEFAULT, default_factory: Any = NODEFAULT, type: Any = None):
        self.name, self.encode_name = name, name
        self.default, self.default_factory, self.type = default, default_factory, type
        self.required = default is NODEFAULT and default_factory is NODEFAULT


class _Field:
    def __init__(self, default: Any = NODEFAULT, default_factory: Any = NODEFAULT, name: Any = None):
        self.default, self.default_factory, self.name = default, default_factory, name


def field(*, default: Any = NODEFAULT, default_factory: Any = NODEFAULT, name: Any = None) -> Any:
    return _Field(default, default_factory, name)


def _is_classvar(annotation: Any) -> bool:
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return text.startswith(("ClassVar", "typing.ClassVar"))


class Struct:
    """Fields in annotation order across the class hierarchy; class keywords (omit_defaults,
    array_like, dict, gc, frozen, kw_only, tag, ...) change only encoding or memory layout in
    msgspec and are accepted and ignored here."""
    __struct_fields__: Tuple[str, ...] = ()
    __struct_defaults_map__: Dict[str, _Field] = {}

    def __init_subclass__(cls, **options: Any) -> None:
        super().__init_subclass__()
        names = list(getattr(cls, "__struct_fields__", ()))
        defaults = dict(getattr(cls, "__struct_defaults_map__", {}))
        for name, ann in cls.__dict__.get("__annotations__", {}).items():
            if _is_classvar(ann) or (name.startswith("__") and name.endswith("__")):
                continue
            if name not in names:
                names.append(name)
            if name in cls.__dict__:
                value = cls.__dict__[name]
                defaults[name] = value if isinstance(value, _Field) else _Field(default=value)
                if isinstance(value, _Field):
                    delattr(cls, name)
        cls.__struct_fields__ = tuple(names)
        cls.__struct_defaults_map__ = defaults

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = self.__struct_fields__
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}: {len(args)} positional arguments for {len(names)} fields")
        values = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise TypeError(f"{type(self).__name__}: unexpected keyword argument '{k}'")
            if k in values:
                raise TypeError(f"{type(self).__name__}: argument '{k}' given twice")
            values[k] = v
        for name in names:
            if name in values:
                object.__setattr__(self, name, values[name])
                continue
            d = self.__struct_defaults_map__.get(name)
            if d is None:
                raise TypeError(f"{type(self).__name__}: missing required argument '{name}'")
            value = d.default_factory() if d.default_factory is not NODEFAULT else d.default
            object.__setattr__(self, name, value)
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()

    def __eq__(self, other: Any) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__struct_fields__)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n, '?')!r}" for n in self.__struct_fields__)
        return f"{type(self).__name__}({inner})"

    def __copy__(self) -> Any:
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __rich_repr__(self) -> Any:
        for n in self.__struct_fields__:
            yield n, getattr(self, n)


def _replace(obj: Any, **changes: Any) -> Any:
    new = obj.__copy__()
    for k, v in changes.items():
        if k not in obj.__struct_fields__:
            raise TypeError(f"{type(obj).__name__} has no field '{k}'")
        object.__setattr__(new, k, v)
    return new


def _fields(obj_or_cls: Any) -> Tuple[FieldInfo, ...]:
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    out = []
    for n in cls.__struct_fields__:
        d = cls.__struct_defaults_map__.get(n)
        out.append(FieldInfo(n, d.default if d else NODEFAULT, d.default_factory if d else NODEFAULT))
    return tuple(out)


def _unsupported(what: str) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"msgspec_lite: {what} is not available (nothing on the scheduler path "
                                  "serialises)")
    return fail


convert = _unsupported("msgspec.convert")
to_builtins = _unsupported("msgspec.to_builtins")


class Meta:
    def __init__(self, **constraints: Any):
        self.constraints = constraints


class Raw(bytes):
    pass


def install() -> None:
    """Registers this module as `msgspec` (with structs, msgpack and json submodules)."""
    me = sys.modules[__name__]
    structs = types.ModuleType("msgspec.structs")
    structs.replace, structs.fields = _replace, _fields
    structs.asdict = lambda o: {n: getattr(o, n) for n in o.__struct_fields__}
    structs.astuple = lambda o: tuple(getattr(o, n) for n in o.__struct_fields__)
    structs.force_setattr = object.__setattr__
    structs.FieldInfo = FieldInfo
    pkg = types.ModuleType("msgspec")
    pkg.__dict__.update({k: v for k, v in me.__dict__.items() if not k.startswith("__")})
    pkg.__path__ = []
    pkg.structs = structs
    for sub in ("msgpack", "json"):
        m = types.ModuleType(f"msgspec.{sub}")

        class Ext:
            def __init__(self, code: int, data: bytes):
                self.code, self.data = code, data

        class Encoder:
            def __init__(self, *a: Any, **kw: Any):
                pass
            encode = _unsupported(f"msgspec.{sub}.Encoder.encode")
            encode_into = _unsupported(f"msgspec.{sub}.Encoder.encode_into")

        class Decoder:
            def __init__(self, *a: Any, **kw: Any):
                pass
            decode = _unsupported(f"msgspec.{sub}.Decoder.decode")

        m.Ext, m.Encoder, m.Decoder = Ext, Encoder, Decoder
        m.encode, m.decode = _unsupported(f"msgspec.{sub}.encode"), _unsupported(f"msgspec.{sub}.decode")
        setattr(pkg, sub, m)
        sys.modules[f"msgspec.{sub}"] = m
    sys.modules["msgspec"] = pkg
    sys.modules["msgspec.structs"] = structs
