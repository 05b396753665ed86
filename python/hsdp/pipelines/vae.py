"""Parallel VAE (``vae_patch_parallel_size=N``): the tiles of a VAE's own tiled decode, and of
its tiled encode, spread over N ranks of a request's group.

diffusers' VAEs with tiling (Wan's, Flux's ``AutoencoderKL``, LTX-Video's, ...) decode a
latent as overlapping tiles, one independent decoder run per tile (Wan: one call per latent
frame, sharing a cache the tile starts by clearing), and then blend the tiles' overlaps.
:class:`TileSpread` runs that stock ``tiled_decode`` itself on each of the N ranks, with the
decoder's ``forward`` replaced for the call:

- [Note: tiles round robin] Tile t (in the stock loop's order; a new tile at each decoder
  call, or for VAEs with ``clear_cache`` at the first call after it) belongs to rank t mod N.
  Its owner computes it; every other rank skips it.
- **Decode.** The writer (the group's rank 0) gets each tile it does not own from its owner,
  call by call (a small header, then the bytes; point to point), so its stock blend runs on
  the very tensors a one-rank tiled decode makes: the result is the stock tiled decode's,
  bit for bit. [Note: receive ahead] A thread of the writer receives them while the writer
  computes its own tiles (its loop takes them from a queue): receiving only when the loop
  reaches a tile made the ranks take turns (measured: 2 ranks 0.93-0.98 of one). The other ranks send their tiles as they finish them and keep none; their
  stock loop runs on empty placeholders and stops at its first blend, and they return a
  1-pixel placeholder (the pipeline's post-processing runs on it; only the writer's output
  is kept). So no rank but the writer holds more than one tile and its activations.
- **Encode** (Wan 2.2 image-to-video): every rank of the group needs the latents, so each
  tile is broadcast from its owner to the whole group and every rank blends.
- Tiling is switched on (``enable_tiling()``, the VAE's default tile sizes) unless the user
  switched it on already; tile sizes a user sets later are used as set. A VAE without tiled
  decode decodes whole, with a warning.

Transfers go through the host (a GPU tile is copied to the CPU): UNTESTED ON A GPU.
Imported only by callers, so ``import hsdp`` never pulls torch in.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..adapters.torch import as_numpy

log = logging.getLogger("hsdp")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 10  # status, dtype index, ndim, up to 7 dims
_FAILED = -1
_TILE_END = 2  # the owner's tile is complete: the next message is for its next tile
_ALL_DONE = 3  # the owner has no more tiles
_NOTHING = np.empty(0, dtype=np.uint8)


class _Done(Exception):
    """A non-writing rank's stock loop reached its blend: its tiles are sent, it is done."""


def _header(t: torch.Tensor | None, status: int = _FAILED) -> np.ndarray:
    h = np.zeros(_HEADER, dtype=np.int64)
    if t is None:
        h[0] = status
        return h
    if t.dtype not in _DTYPES or t.dim() > _HEADER - 3:
        raise TypeError(f"parallel VAE: a tile of dtype {t.dtype} and {t.dim()} dims cannot be sent")
    h[0], h[1], h[2] = 1, _DTYPES.index(t.dtype), t.dim()
    h[3 : 3 + t.dim()] = t.shape
    return h


def _empty_for(h: np.ndarray) -> torch.Tensor:
    return torch.empty(tuple(int(x) for x in h[3 : 3 + int(h[2])]), dtype=_DTYPES[int(h[1])])


class TileSpread:
    """One VAE's tiled decode and encode spread over the first `n` ranks of `group` (every
    rank of the group runs the same request). Installed on the instance: its ``tiled_decode``
    and ``tiled_encode`` become this object's."""

    def __init__(self, vae: Any, group: Any, n: int) -> None:
        self.vae, self.group, self.n = vae, group, n
        self.rank = int(group.rank)
        self.tiled = callable(getattr(vae, "tiled_decode", None)) and callable(getattr(vae, "enable_tiling", None))
        if not self.tiled:
            if self.rank == 0:
                log.warning("vae_patch_parallel_size=%d: the VAE (%s) has no tiled decode (tiled_decode and "
                            "enable_tiling); it decodes whole on one rank", n, type(vae).__name__)
            return
        if not getattr(vae, "use_tiling", False):
            vae.enable_tiling()  # its default tile sizes, as vllm-omni does
        self._stock_decode = type(vae).tiled_decode.__get__(vae)
        vae.tiled_decode = self.tiled_decode
        # the tiled encode the VAE's _encode calls (AutoencoderKL: _tiled_encode; tiled_encode
        # is its deprecated public wrapper)
        name = "_tiled_encode" if callable(getattr(type(vae), "_tiled_encode", None)) else "tiled_encode"
        if callable(getattr(vae, name, None)):
            self._stock_encode = getattr(type(vae), name).__get__(vae)
            setattr(vae, name, self.tiled_encode)
        self.last: dict[str, int] = {}  # the last decode's tiles, for reports and tests
        self.last_encode: dict[str, int] = {}

    # -- transfers (host buffers; a tile on a GPU is copied over) ---------------------------

    def _send(self, t: torch.Tensor | None, dest: int) -> None:
        self.group.sendrecv(_header(t), dest, _NOTHING, dest)
        if t is not None:
            self.group.sendrecv(as_numpy(t.detach().cpu().contiguous()), dest, _NOTHING, dest)

    def _mark(self, status: int, dest: int) -> None:
        self.group.sendrecv(_header(None, status), dest, _NOTHING, dest)

    def _receive_all(self, out: queue.Queue[Any]) -> None:
        """The writer's receiver thread ([Note: receive ahead]): every other VAE rank's tiles, in
        the stock loop's order (tile t from rank t mod n; a tile's calls until its TILE_END),
        put on `out` as (tile, tensor), until every other rank said ALL_DONE. A failed header,
        or any error here, is put on `out` as (tile, exception)."""
        done: set[int] = set()
        tile = -1
        try:
            while len(done) < self.n - 1:
                tile += 1
                owner = tile % self.n
                if owner == 0 or owner in done:
                    continue
                while True:
                    h = np.empty(_HEADER, dtype=np.int64)
                    self.group.sendrecv(_NOTHING, owner, h, owner)
                    if h[0] == _TILE_END:
                        break
                    if h[0] == _ALL_DONE:
                        done.add(owner)
                        break
                    if h[0] == _FAILED:
                        raise RuntimeError(f"parallel VAE: rank {owner} of the VAE group failed computing tile "
                                           f"{tile} (its own error is in its output)")
                    t = _empty_for(h)
                    self.group.sendrecv(_NOTHING, owner, as_numpy(t), owner)
                    out.put((tile, t))
        except BaseException as exc:  # noqa: BLE001 - handed to the decoding thread, which raises it
            out.put((tile, exc))

    def _broadcast(self, t: torch.Tensor | None, root: int, device: torch.device, where: str) -> torch.Tensor:
        h = _header(t) if self.rank == root else np.empty(_HEADER, dtype=np.int64)
        self.group.broadcast(h, root)
        if h[0] == _FAILED:
            raise RuntimeError(f"parallel VAE: rank {root} of the VAE group failed computing {where} "
                               "(its own error is in its output)")
        if self.rank == root:
            assert t is not None
            self.group.broadcast(as_numpy(t.detach().cpu().contiguous()), root)
            return t
        out = _empty_for(h)
        self.group.broadcast(as_numpy(out), root)
        return out.to(device)

    # -- the tile loop ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _tiles(self, module: Any, on_call: Callable[..., torch.Tensor]) -> Iterator[dict[str, int]]:
        """`module`'s forward replaced by on_call(tile, stock_forward, *args, **kwargs) for the
        stock loop; tile numbers follow [Note: tiles round robin]."""
        vae = self.vae
        state = {"tile": -1, "new": 1, "calls": 0}
        stock_forward = module.forward
        clear = getattr(vae, "clear_cache", None)

        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            if state["new"] or clear is None:
                state["tile"] += 1
                state["new"] = 0
            state["calls"] += 1
            return on_call(state["tile"], stock_forward, *args, **kwargs)

        def clear_cache() -> None:
            assert clear is not None
            clear()
            state["new"] = 1

        module.forward = forward
        if clear is not None:
            vae.clear_cache = clear_cache
        try:
            yield state
        finally:
            del module.forward
            if clear is not None:
                del vae.clear_cache

    def tiled_decode(self, z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The stock ``tiled_decode(z, ...)`` (Wan's and Flux's take ``return_dict``, LTX's
        ``temb`` first), spread."""
        if self.n == 1 or self.rank >= self.n:  # not a VAE rank: the stock decode, whole
            return self._stock_decode(z, *args, **kwargs)
        writer = self.rank == 0
        failed: list[BaseException] = []
        sent = {"tile": -1}  # a non-writer: the last of its tiles it sent (TILE_END follows it)
        received: queue.Queue[Any] = queue.Queue()

        def on_call(tile: int, stock: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
            owner = tile % self.n
            if owner == self.rank:
                if not writer and sent["tile"] not in (-1, tile):
                    self._mark(_TILE_END, 0)
                try:
                    out = stock(*args, **kwargs)
                except BaseException as exc:
                    failed.append(exc)
                    if not writer:
                        self._send(None, 0)  # the writer raises instead of waiting for it
                    raise
                if writer:
                    return out
                self._send(out, 0)
                sent["tile"] = tile
                return out.new_empty((0,) * out.dim())
            if writer:  # the receiver thread has it, or will
                got_tile, got = received.get()
                if isinstance(got, BaseException):
                    raise got
                if got_tile != tile:
                    raise RuntimeError(f"parallel VAE: the writer expected tile {tile} and received tile {got_tile}: "
                                       "the ranks' tile loops differ (the same latents and tile sizes on every rank?)")
                return got.to(z.device)
            return z.new_empty((0,) * z.dim())  # not computed: the stock loop only collects (and joins) it

        if writer:
            receiver = threading.Thread(target=self._receive_all, args=(received,), name="hsdp-vae-receive",
                                        daemon=True)
            receiver.start()
            with self._tiles(self.vae.decoder, on_call) as state:
                out = self._stock_decode(z, *args, **kwargs)
            receiver.join()
            self.last = {"tiles": state["tile"] + 1, "calls": state["calls"], "ranks": self.n}
            log.info("parallel VAE: decoded %s", self.spread(self.last["tiles"]))
            return out
        blends = {name: getattr(self.vae, name) for name in ("blend_v", "blend_h") if hasattr(self.vae, name)}
        try:
            for name in blends:
                setattr(self.vae, name, self._stop)
            with self._tiles(self.vae.decoder, on_call) as state:
                self._stock_decode(z, *args, **kwargs)
        except _Done:
            pass
        except Exception:
            if failed:
                raise
            # past its tiles: the stock code met a placeholder where the writer has a tile
        finally:
            for name in blends:
                delattr(self.vae, name)
        if sent["tile"] != -1:
            self._mark(_TILE_END, 0)
        self._mark(_ALL_DONE, 0)
        self.last = {"tiles": state["tile"] + 1, "calls": state["calls"], "ranks": self.n}
        sample = z.new_zeros((z.shape[0], 3, *(1,) * (z.dim() - 2)))  # 1 pixel (and frame): not the output
        from diffusers.models.autoencoders.vae import DecoderOutput

        bound = inspect.signature(self._stock_decode).bind(z, *args, **kwargs)
        return DecoderOutput(sample=sample) if bound.arguments.get("return_dict", True) else (sample,)

    def spread(self, tiles: int) -> str:
        """How `tiles` tiles fall on the ranks, e.g. '15 tiles over 2 ranks: 8 + 7 (uneven)'."""
        counts = [len(range(r, tiles, self.n)) for r in range(self.n)]
        uneven = " (uneven: the first ranks take one more)" if len(set(counts)) > 1 else ""
        ranks = "1 rank" if self.n == 1 else f"{self.n} ranks"
        return f"{tiles} tiles over {ranks}: {' + '.join(map(str, counts))}{uneven}"

    @staticmethod
    def _stop(*args: Any, **kwargs: Any) -> Any:
        raise _Done

    def tiled_encode(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.n == 1:
            return self._stock_encode(x, *args, **kwargs)

        def on_call(tile: int, stock: Callable[..., torch.Tensor], *a: Any, **kw: Any) -> torch.Tensor:
            owner = tile % self.n
            out = None
            if owner == self.rank:
                try:
                    out = stock(*a, **kw)
                except BaseException:
                    self.group.broadcast(_header(None), owner)  # the others raise too
                    raise
            return self._broadcast(out, owner, x.device, f"encoding tile {tile}")

        with self._tiles(self.vae.encoder, on_call) as state:
            out = self._stock_encode(x, *args, **kwargs)
        self.last_encode = {"tiles": state["tile"] + 1, "calls": state["calls"], "ranks": self.n}
        return out


def install(pipe: Any, group: Any, n: int) -> TileSpread | None:
    """Spread `pipe`'s VAE's tiles over the first `n` ranks of `group` (see the module docstring)."""
    vae = getattr(pipe, "vae", None)
    if n <= 1 or vae is None:
        return None
    return TileSpread(vae, group, n)
