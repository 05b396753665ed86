"""``Module``: the torch.nn.Module protocol on NumPy.

hsdp walks module trees through this protocol only (named_modules, named_parameters,
get_submodule, forward hooks), so the same sharding code serves these modules and torch's.
Names, ordering and hook semantics follow torch so that code written against one reads the
same against the other.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from ..engine.dtypes import DType, as_dtype
from ..engine.units import PARAM_WATCH
from .parameter import Parameter

_hook_ids = itertools.count()


class RemovableHandle:
    """Returned by ``register_forward_(pre_)hook``; ``remove()`` unregisters the hook."""

    __slots__ = ("id", "_hooks_ref")

    def __init__(self, hooks: "OrderedDict[int, Any]") -> None:
        self.id = next(_hook_ids)
        # Weak: a handle kept by the caller must not keep a dropped module's hooks alive.
        self._hooks_ref = weakref.ref(hooks)

    def remove(self) -> None:
        hooks = self._hooks_ref()
        if hooks is not None:
            hooks.pop(self.id, None)

    def __enter__(self) -> "RemovableHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class StateDictError(KeyError, ValueError):
    """Keys of a state dict do not match the module's parameters (catchable as either)."""

    def __str__(self) -> str:  # KeyError's str() would repr() the multi-line message
        return str(self.args[0]) if self.args else ""


# Hook records: (hook, with_kwargs, always_call).
_HookRecord = tuple[Callable[..., Any], bool, bool]



class Module:
    """Base class of every layer and model; subclasses call ``super().__init__()`` first."""

    training: bool
    _parameters: dict[str, Parameter | None]
    _modules: dict[str, "Module | None"]
    _forward_pre_hooks: "OrderedDict[int, _HookRecord]"
    _forward_hooks: "OrderedDict[int, _HookRecord]"

    def __init__(self) -> None:
        # object.__setattr__: our own __setattr__ needs these dicts to exist already.
        setattr_ = object.__setattr__
        setattr_(self, "training", True)
        setattr_(self, "_parameters", {})
        setattr_(self, "_modules", {})
        setattr_(self, "_forward_pre_hooks", OrderedDict())
        setattr_(self, "_forward_hooks", OrderedDict())
        setattr_(self, "_device", "cpu")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f'Module [{type(self).__name__}] is missing the required "forward" function')

    # -- attribute protocol ---------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        params = d.get("_parameters")
        if isinstance(value, Parameter):
            if params is None:
                raise AttributeError("cannot assign parameters before Module.__init__() call")
            d.pop(name, None)
            self._modules.pop(name, None)
            self.register_parameter(name, value)
            return
        if params is not None and name in params:
            if value is not None:
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as parameter '{name}' "
                    "(hsdp.nn.Parameter or None expected)"
                )
            params[name] = None
            return
        modules = d.get("_modules")
        if isinstance(value, Module):
            if modules is None:
                raise AttributeError("cannot assign module before Module.__init__() call")
            d.pop(name, None)
            params.pop(name, None)  # type: ignore[union-attr]
            modules[name] = value
            return
        if modules is not None and name in modules:
            if value is not None:
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as child module '{name}' "
                    "(hsdp.nn.Module or None expected)"
                )
            modules[name] = None
            return
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails, so plain attributes cost nothing extra.
        d = self.__dict__
        params = d.get("_parameters")
        if params is not None and name in params:
            return params[name]
        modules = d.get("_modules")
        if modules is not None and name in modules:
            return modules[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        if name in self._parameters:
            del self._parameters[name]
        elif name in self._modules:
            del self._modules[name]
        else:
            object.__delattr__(self, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._parameters) | set(self._modules))

    # -- registration ---------------------------------------------------------------------

    def _check_new_name(self, name: Any, kind: str, table: dict[str, Any]) -> None:
        if not isinstance(name, str):
            raise TypeError(f"{kind} name should be a string, got {type(name).__name__}")
        if name == "":
            raise KeyError(f'{kind} name can\'t be empty string ""')
        if "." in name:
            raise KeyError(f'{kind} name can\'t contain ".", got: {name}')
        if hasattr(self, name) and name not in table:
            raise KeyError(f"attribute '{name}' already exists")

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError("cannot assign parameter before Module.__init__() call")
        self._check_new_name(name, "parameter", self._parameters)
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(
                f"cannot assign '{type(param).__name__}' object to parameter '{name}' "
                "(hsdp.nn.Parameter or None required)"
            )
        self._parameters[name] = param
        watch = self.__dict__.get(PARAM_WATCH)
        if watch is not None and name in watch:
            watch[name](param)  # a sharded parameter replaced: its unit is told (hsdp.engine.units)

    def add_module(self, name: str, module: "Module | None") -> None:
        if "_modules" not in self.__dict__:
            raise AttributeError("cannot assign module before Module.__init__() call")
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self._check_new_name(name, "module", self._modules)
        self._modules[name] = module

    def register_module(self, name: str, module: "Module | None") -> None:
        self.add_module(name, module)

    # -- traversal ------------------------------------------------------------------------

    def named_modules(
        self, memo: set["Module"] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, "Module"]]:
        """Pre-order: this module first (named ``prefix``), then each child's subtree."""
        if memo is None:
            memo = set()
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        for name, module in self._modules.items():
            if module is None:
                continue
            sub = prefix + ("." if prefix else "") + name
            yield from module.named_modules(memo, sub, remove_duplicate)

    def modules(self) -> Iterator["Module"]:
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        memo: set[Module] = set()
        for name, module in self._modules.items():
            if module is not None and module not in memo:
                memo.add(module)
                yield name, module

    def children(self) -> Iterator["Module"]:
        for _, m in self.named_children():
            yield m

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Parameter]]:
        """Each module's own parameters, modules in ``named_modules`` order."""
        mods: Iterable[tuple[str, Module]] = (
            self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, self)]
        )
        memo: set[Parameter] = set()
        for mod_prefix, module in mods:
            for name, p in module._parameters.items():
                if p is None or p in memo:
                    continue
                if remove_duplicate:
                    memo.add(p)
                yield mod_prefix + ("." if mod_prefix else "") + name, p

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def get_submodule(self, target: str) -> "Module":
        if target == "":
            return self
        mod: Module = self
        for item in target.split("."):
            if item not in mod._modules or mod._modules[item] is None:
                if hasattr(mod, item) and not isinstance(getattr(mod, item), Module):
                    raise AttributeError(f"`{item}` is not an nn.Module")
                raise AttributeError(f"{mod._get_name()} has no attribute `{item}`")
            mod = mod._modules[item]  # type: ignore[assignment]
        return mod

    def get_parameter(self, target: str) -> Parameter:
        module_path, _, name = target.rpartition(".")
        mod = self.get_submodule(module_path)
        if name not in mod._parameters:
            if hasattr(mod, name):
                raise AttributeError(f"`{name}` is not an nn.Parameter")
            raise AttributeError(f"{mod._get_name()} has no attribute `{name}`")
        p = mod._parameters[name]
        if p is None:
            raise AttributeError(f"`{name}` is not an nn.Parameter")
        return p

    # -- hooks and call -------------------------------------------------------------------

    def register_forward_pre_hook(
        self, hook: Callable[..., Any], *, prepend: bool = False, with_kwargs: bool = False
    ) -> RemovableHandle:
        """``hook(module, args)`` -> None or new args; with_kwargs: ``hook(module, args, kwargs)``
        -> None or ``(args, kwargs)``."""
        handle = RemovableHandle(self._forward_pre_hooks)
        self._forward_pre_hooks[handle.id] = (hook, bool(with_kwargs), False)
        if prepend:
            self._forward_pre_hooks.move_to_end(handle.id, last=False)
        return handle

    def register_forward_hook(
        self,
        hook: Callable[..., Any],
        *,
        prepend: bool = False,
        with_kwargs: bool = False,
        always_call: bool = False,
    ) -> RemovableHandle:
        """``hook(module, args, output)`` -> None or a replacement output (with_kwargs:
        ``hook(module, args, kwargs, output)``). always_call: also run (with output None) when
        forward or a pre-hook raised, before the exception propagates."""
        handle = RemovableHandle(self._forward_hooks)
        self._forward_hooks[handle.id] = (hook, bool(with_kwargs), bool(always_call))
        if prepend:
            self._forward_hooks.move_to_end(handle.id, last=False)
        return handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Hot path: a module without hooks costs two dict truth tests over a plain forward.
        if self._forward_pre_hooks or self._forward_hooks:
            return self._call_with_hooks(args, kwargs)
        return self.forward(*args, **kwargs)

    def _call_with_hooks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        always_done: set[int] = set()
        output: Any = None  # handed to always_call hooks if a later hook raises
        try:
            for hook, with_kwargs, _ in list(self._forward_pre_hooks.values()):
                if with_kwargs:
                    res = hook(self, args, kwargs)
                    if res is not None:
                        if not (isinstance(res, tuple) and len(res) == 2):
                            raise RuntimeError(
                                "forward pre-hook registered with with_kwargs=True must return None "
                                f"or a tuple of (new_args, new_kwargs), but got {res!r}"
                            )
                        args, kwargs = res
                        if not isinstance(args, tuple):
                            args = (args,)
                else:
                    res = hook(self, args)
                    if res is not None:
                        args = res if isinstance(res, tuple) else (res,)
            output = self.forward(*args, **kwargs)
            for hook_id, (hook, with_kwargs, always) in list(self._forward_hooks.items()):
                if always:
                    always_done.add(hook_id)
                res = hook(self, args, kwargs, output) if with_kwargs else hook(self, args, output)
                if res is not None:
                    output = res
            return output
        except BaseException:
            # BaseException, not Exception: a KeyboardInterrupt mid-forward must still let
            # always_call hooks (hsdp's reshard) run so the engine's state stays consistent.
            for hook_id, (hook, with_kwargs, always) in list(self._forward_hooks.items()):
                if not always or hook_id in always_done:
                    continue
                try:
                    if with_kwargs:
                        hook(self, args, kwargs, output)
                    else:
                        hook(self, args, output)
                except Exception as hook_exc:  # the original error is the one to report
                    warnings.warn(
                        f"forward hook with always_call=True raised {hook_exc!r}, silenced "
                        "because another error was raised in forward",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            raise

    # -- state ----------------------------------------------------------------------------

    def train(self, mode: bool = True) -> "Module":
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        for child in self.children():
            child.train(mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def to(self, device: Any = None, dtype: Any = None, non_blocking: bool = False) -> "Module":
        """Device must be the CPU (this runtime computes with NumPy); dtype casts every
        floating-point parameter. ``to(dtype)`` positionally works too, as in torch."""
        if dtype is None and device is not None:
            as_dt = _try_dtype(device)
            if as_dt is not None:
                device, dtype = None, as_dt
        if device is not None:
            _check_device(device)
        new_dtype: DType | None = None
        if dtype is not None:
            new_dtype = as_dtype(dtype)
            if not new_dtype.is_floating_point:
                raise TypeError(f"Module.to only accepts floating point dtypes, but got {new_dtype.name}")
        for m in self.modules():
            if device is not None:
                m._device = device
        if new_dtype is not None:
            for p in self.parameters():
                if p.is_floating_point() and p.dtype != new_dtype:
                    p._set_dtype(new_dtype)
        return self

    def cpu(self) -> "Module":
        return self.to("cpu")

    def state_dict(self, *, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """Name -> array (the parameter's current array, not a copy; keep_vars: the Parameter).

        Reads ``.data``, so a sharded or meta parameter raises."""
        out: dict[str, Any] = {}
        for name, p in self.named_parameters(prefix=prefix, remove_duplicate=False):
            out[name] = p if keep_vars else p.data
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> _IncompatibleKeys:
        """Assign every matching entry to ``.data``. Everything is checked before anything is
        assigned, so a failed load leaves the module unchanged."""
        own = dict(self.named_parameters(remove_duplicate=False))
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            lines = [f"Error(s) in loading state_dict for {self._get_name()}:"]
            if missing:
                lines.append("  missing keys: " + ", ".join(repr(k) for k in missing))
            if unexpected:
                lines.append("  unexpected keys: " + ", ".join(repr(k) for k in unexpected))
            raise StateDictError("\n".join(lines))
        mismatched = []
        for k, p in own.items():
            if k in state_dict:
                shape = tuple(np.shape(state_dict[k]))
                if shape != p.shape:
                    mismatched.append(f"  {k!r}: checkpoint shape {shape}, parameter shape {p.shape}")
        if mismatched:
            raise ValueError(
                f"Error(s) in loading state_dict for {self._get_name()}: shape mismatch\n" + "\n".join(mismatched)
            )
        converted = []
        for k, p in own.items():  # every conversion (dtype, range, sharded state) before any assignment
            if k in state_dict:
                if p._hsdp_state is not None:
                    raise RuntimeError(f"cannot load {k!r}: the parameter is {p._hsdp_state}")
                value = state_dict[k]
                try:
                    converted.append((p, p._convert(np.asarray(value.data if isinstance(value, Parameter) else value))))
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"Error(s) in loading state_dict for {self._get_name()}: {k!r}: {exc}") from None
        for p, value in converted:
            p._data = value
        return _IncompatibleKeys(missing, unexpected)

    def apply(self, fn: Callable[["Module"], None]) -> "Module":
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    # -- repr -----------------------------------------------------------------------------

    def _get_name(self) -> str:
        return type(self).__name__

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        extra = self.extra_repr()
        extra_lines = extra.split("\n") if extra else []
        child_lines = [
            f"({key}): " + _addindent(repr(module), 2) for key, module in self._modules.items()
        ]
        lines = extra_lines + child_lines
        main = self._get_name() + "("
        if lines:
            if len(extra_lines) == 1 and not child_lines:
                main += extra_lines[0]
            else:
                main += "\n  " + "\n  ".join(lines) + "\n"
        return main + ")"


class ModuleList(Module):
    """A list of modules registered under the names "0", "1", ..."""

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def _index(self, idx: int) -> int:
        n = len(self._modules)
        i = int(idx)
        if not -n <= i < n:
            raise IndexError(f"index {idx} is out of range for {self._get_name()} of length {n}")
        return i % n

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return type(self)(list(self._modules.values())[idx])
        return self._modules[str(self._index(idx))]

    def __setitem__(self, idx: int, module: Module) -> None:
        setattr(self, str(self._index(idx)), module)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def append(self, module: Module) -> "ModuleList":
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> "ModuleList":
        for m in modules:
            self.append(m)
        return self


class Sequential(Module):
    """Modules called in order, each on the previous one's output.

    ``Sequential(a, b)`` names them "0", "1"; ``Sequential(OrderedDict(name=module))`` keeps names.
    """

    def __init__(self, *modules: Any) -> None:
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], (dict, OrderedDict)):
            for name, m in modules[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(modules):
                self.add_module(str(i), m)

    def __getitem__(self, idx: int | slice) -> Any:
        items = list(self._modules.items())
        if isinstance(idx, slice):
            return type(self)(OrderedDict(items[idx]))
        n = len(items)
        if not -n <= int(idx) < n:
            raise IndexError(f"index {idx} is out of range for {self._get_name()} of length {n}")
        return items[int(idx)][1]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def append(self, module: Module) -> "Sequential":
        self.add_module(str(len(self)), module)
        return self

    def forward(self, x: Any) -> Any:
        for m in self._modules.values():
            x = m(x)  # type: ignore[misc]
        return x


def _addindent(s: str, spaces: int) -> str:
    first, *rest = s.split("\n")
    if not rest:
        return s
    pad = " " * spaces
    return first + "\n" + "\n".join(pad + line for line in rest)


def _try_dtype(value: Any) -> DType | None:
    """``value`` as a dtype if it is one (for ``to(dtype)`` given positionally), else None."""
    if isinstance(value, str) and value.split(":")[0] in ("cpu", "cuda", "meta", "mps", "xpu"):
        return None
    try:
        return as_dtype(value)
    except TypeError:
        return None


def _check_device(device: Any) -> None:
    if str(device) == "cpu" or getattr(device, "type", None) == "cpu":
        return
    raise ValueError(
        f"device {str(device)!r} is not supported: hsdp.nn computes with NumPy on the CPU, "
        "so only 'cpu' (or None) is accepted"
    )


__all__ = ["Module", "ModuleList", "Sequential", "RemovableHandle", "StateDictError"]
