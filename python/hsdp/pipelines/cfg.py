"""CFG parallel inside a stock diffusers pipeline call: the cond and uncond transformer calls
of a step are split across the two ranks of a CFG group.

Stock Wan and Flux pipelines call the current transformer twice per step with guidance,
cond then uncond (under ``cache_context("cond")`` / ``("uncond")``), and use both results
only after the second call. :class:`CFGSplit` wraps each transformer's ``__call__`` (outside
hsdp's and Ulysses' hooks, so a call a rank skips runs none of their collectives):

============  ===============================  =====================================
call          CFG rank 0                       CFG rank 1
============  ===============================  =====================================
1 (cond)      computes cond, returns it        returns an empty placeholder
2 (uncond)    exchanges; returns rank 1's      computes uncond, exchanges, fills the
              uncond                           placeholder with rank 0's cond in
                                               place; returns its uncond
============  ===============================  =====================================

Each rank thus runs exactly one forward per step, at the same point of the collective
sequence: HSDP's gathers, which in combined mode span ranks of both branches, pair up. The
pipeline then combines the two predictions as it always does, bit for bit the tensors an
unsplit run computes. A step without guidance (one call) runs on every rank.

Whether a step has guidance must be known at call 1, so each pipeline class needs a probe
(:data:`GUIDANCE_PROBES`): Wan asks ``pipe.do_classifier_free_guidance``; Flux's true CFG
is ``true_cfg_scale > 1`` with a negative prompt (or negative embeddings), read from the
arguments of the pipeline call, which the pipeline's class records (:func:`record_calls`).
Pipelines without a probe refuse CFG parallel when loaded. Both ranks check at call 2 that
the pipeline did what the probe said (the same model, under ``"uncond"``) and raise
otherwise, before any collective.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..adapters.torch import TorchAdapter
from ..parallel import ParallelGroups

GuidanceProbe = Callable[[Any, dict[str, Any]], bool]


def _wan_guidance(pipe: Any, call_args: dict[str, Any]) -> bool:
    return bool(pipe.do_classifier_free_guidance)


def _flux_true_cfg(pipe: Any, a: dict[str, Any]) -> bool:
    # FluxPipeline.__call__: do_true_cfg = true_cfg_scale > 1 and has_neg_prompt
    has_neg = a.get("negative_prompt") is not None or (
        a.get("negative_prompt_embeds") is not None and a.get("negative_pooled_prompt_embeds") is not None
    )
    return bool(a.get("true_cfg_scale", 1.0) > 1 and has_neg)


# pipeline class name -> whether the step about to run calls the transformer twice (cond, uncond)
GUIDANCE_PROBES: dict[str, GuidanceProbe] = {
    "WanPipeline": _wan_guidance,
    "WanImageToVideoPipeline": _wan_guidance,
    "FluxPipeline": _flux_true_cfg,
}


def guidance_probe(pipeline_cls: type) -> GuidanceProbe | None:
    for k in pipeline_cls.__mro__:
        if k.__name__ in GUIDANCE_PROBES:
            return GUIDANCE_PROBES[k.__name__]
    return None


_RECORDING: dict[type, type] = {}
_SPLITTING: dict[type, type] = {}


def _same_name(sub: type, cls: type) -> type:
    sub.__name__, sub.__qualname__, sub.__module__ = cls.__name__, cls.__qualname__, cls.__module__
    sub.__doc__ = cls.__doc__
    return sub


def record_calls(pipe: Any, on_call: Callable[[Any, dict[str, Any]], None]) -> None:
    """Give `pipe` a subclass of its own class (same name) whose ``__call__`` first hands
    `on_call(pipe, arguments)` the call's arguments, defaults filled in, then runs the stock
    ``__call__``. A method on the instance would not do: ``pipe(...)`` looks ``__call__`` up
    on the class."""
    cls = type(pipe)
    sub = _RECORDING.get(cls)
    if sub is None:
        signature = inspect.signature(cls.__call__)

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            hook = self.__dict__.get("_hsdp_on_call")
            if hook is not None:
                bound = signature.bind(self, *args, **kwargs)
                bound.apply_defaults()
                arguments = dict(bound.arguments)
                arguments.pop("self", None)
                arguments.update(arguments.pop("kwargs", {}) or {})
                hook(self, arguments)
            return cls.__call__(self, *args, **kwargs)

        sub = _RECORDING[cls] = _same_name(type(cls.__name__, (cls,), {"__call__": __call__}), cls)
    object.__setattr__(pipe, "_hsdp_on_call", on_call)
    pipe.__class__ = sub


def _sample(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0]
    sample = getattr(out, "sample", None)
    if not isinstance(sample, torch.Tensor):
        raise TypeError(f"CFG parallel: a transformer returned {type(out).__name__}, not a tuple or an output with .sample")
    return sample


def _like(out_kind: bool, sample: torch.Tensor) -> Any:
    """The transformer's output structure around `sample` (return_dict False: a tuple)."""
    if not out_kind:
        return (sample,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class CFGSplit:
    """The CFG split of one pipeline (see the module docstring); shared by its transformers."""

    def __init__(self, pipe: Any, groups: ParallelGroups, probe: GuidanceProbe) -> None:
        if groups.cfg is None or groups.cfg_degree != 2:
            raise ValueError(f"CFG parallel splits two branches over a CFG group of 2 ranks, not {groups.cfg_degree}")
        self.pipe = pipe
        self.groups = groups
        self.probe = probe
        self.call_args: dict[str, Any] = {}
        # (model, output returned at call 1, its sample: cond on rank 0, the placeholder on rank 1)
        self.pending: tuple[Any, Any, torch.Tensor] | None = None
        self.context: dict[int, str | None] = {}
        self.steps = 0  # steps split so far (for reports and tests)

    def on_call(self, pipe: Any, arguments: dict[str, Any]) -> None:
        self.call_args = arguments
        self.pending = None  # a call that raised mid-step leaves nothing behind

    def install(self, model: Any) -> None:
        """Route `model`'s calls through the split (in place; the class keeps its name)."""
        cls = type(model)
        sub = _SPLITTING.get(cls)
        if sub is None:
            def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
                split = self.__dict__.get("_hsdp_cfg_split")
                if split is None:
                    return cls.__call__(self, *args, **kwargs)
                return split.call(self, lambda: cls.__call__(self, *args, **kwargs), args, kwargs)

            sub = _SPLITTING[cls] = _same_name(type(cls.__name__, (cls,), {"__call__": __call__}), cls)
        object.__setattr__(model, "_hsdp_cfg_split", self)
        stock = getattr(model, "cache_context", None)
        if stock is not None:
            object.__setattr__(model, "cache_context", self._context_of(model, stock))
        model.__class__ = sub

    def _context_of(self, model: Any, stock: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        def cache_context(name: str, *args: Any, **kwargs: Any) -> Iterator[None]:
            self.context[id(model)] = name
            try:
                with stock(name, *args, **kwargs):
                    yield
            finally:
                self.context[id(model)] = None

        return cache_context

    def call(self, model: Any, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        context = self.context.get(id(model))
        if self.pending is None:
            if context == "uncond":
                raise RuntimeError(
                    f"CFG parallel: {type(self.pipe).__name__} called {type(model).__name__} under 'uncond' where "
                    "its guidance probe said the step has no guidance; every rank stops here"
                )
            if not self.probe(self.pipe, self.call_args):
                return run()  # no guidance in this step: one call, computed on every rank
            return_dict = kwargs.get("return_dict", True)
            if self.groups.cfg_rank == 0:
                out = run()
                self.pending = (model, out, _sample(out))
                return out
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if not isinstance(hidden, torch.Tensor):
                raise TypeError("CFG parallel: the transformer call has no hidden_states tensor to shape its output on")
            placeholder = torch.empty(0, dtype=hidden.dtype, device=hidden.device)
            out = _like(return_dict, placeholder)
            self.pending = (model, out, placeholder)
            return out
        first, out1, sample1 = self.pending
        self.pending = None
        if first is not model or context not in (None, "uncond"):
            raise RuntimeError(
                f"CFG parallel: {type(self.pipe).__name__}'s guidance probe said this step calls "
                f"{type(first).__name__} twice (cond, then uncond), but the next call went to "
                f"{'the same' if first is model else 'another'} model under {context!r}; every rank stops here"
            )
        return_dict = kwargs.get("return_dict", True)
        if self.groups.cfg_rank == 0:
            mine, out2 = sample1, None
        else:
            out2 = run()
            mine = _sample(out2)
        cond, uncond = self._exchange(mine, sample1)
        self.steps += 1
        if self.groups.cfg_rank == 0:
            return _like(return_dict, uncond)
        sample1.resize_(cond.shape).copy_(cond)  # the tensor the pipeline holds from call 1
        return out2

    def _exchange(self, mine: torch.Tensor, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather rank 0's cond and rank 1's uncond, as float32 (exact for every float
        dtype they come in) behind a two-number header: each result's dtype, and the dtype
        rank 1's placeholder was given, so both ranks see a mismatch and raise together."""
        g = self.groups
        mine = mine.contiguous()
        if mine.dtype not in _DTYPES:
            raise TypeError(f"CFG parallel exchanges floating predictions, got {mine.dtype}")
        code = float(_DTYPES.index(mine.dtype))
        expect = float(_DTYPES.index(placeholder.dtype)) if g.cfg_rank == 1 else -1.0
        send = torch.cat([torch.tensor([code, expect], device=mine.device), mine.reshape(-1).float()])
        both = TorchAdapter().all_gather(g.cfg, send)  # the adapter's, as hsdp.parallel.cfg_combine's
        header = both[:, :2].cpu().tolist()
        cond_dtype, uncond_dtype = _DTYPES[int(header[0][0])], _DTYPES[int(header[1][0])]
        if cond_dtype != _DTYPES[int(header[1][1])]:
            raise RuntimeError(
                f"CFG parallel: the transformer's cond prediction is {cond_dtype} but CFG rank 1 shaped its "
                f"placeholder as {_DTYPES[int(header[1][1])]} (the dtype of hidden_states); every rank stops here"
            )
        cond = both[0, 2:].reshape(mine.shape).to(cond_dtype)
        uncond = both[1, 2:].reshape(mine.shape).to(uncond_dtype)
        return cond, uncond
