"""Parallel VAE (``vae_patch_parallel_size=N``): the tiles of a VAE's own tiled decode, and of
its tiled encode, spread over N ranks of a request's group.

diffusers' VAEs with tiling (Wan's, Flux's ``AutoencoderKL``, LTX-Video's, ...) decode a
latent as overlapping tiles, one independent decoder run per tile (Wan: one call per latent
frame, sharing a cache the tile starts by clearing), and then blend the tiles' overlaps.
:class:`TileSpread` runs that stock ``tiled_decode`` itself on each of the N ranks, with the
decoder's ``forward`` replaced for the call:

- [Note: tiles by cost] Tiles are numbered in the stock loop's order (a new tile at each
  decoder call, or for VAEs with ``clear_cache`` at the first call after it). Before a decode,
  every rank runs the stock loop once more with the decoder replaced by a counter (a census:
  each tile's input size, nothing decoded; it stops at the first blend). Who computes which
  tile is then chosen by simulating the decode with those sizes as times: every rank computes
  its tiles in the loop's order, back to back; the writer computes its own and, in the same
  order, waits for each other tile until its owner has finished it. Round robin (tile t to
  rank t mod N) is the start; single tiles move to another rank while that shortens the
  writer's finish. Round robin alone put whole columns on one rank (8 tiles in 2 rows of 4,
  the last row and column smaller: rank 0 0.526 of the area). Dealing by size alone (largest
  first to the least loaded rank) balanced the areas but, measured, made the writer wait at
  the first tile it did not own (2 ranks 0.75 of one rank, round robin 0.61): the writer's
  loop takes tiles in order. Every rank sees the same tiles in the same order, so all choose
  the same owners without a message. The encode (every rank needs every tile) stays round
  robin.
- **Decode.** The writer (the group's rank 0) gets each tile it does not own from its owner,
  call by call (a small header, then the bytes; point to point), so its stock blend runs on
  the very tensors a one-rank tiled decode makes: the result is the stock tiled decode's,
  bit for bit. [Note: receive ahead] A thread of the writer receives them while the writer
  computes its own tiles (its loop takes each tile's outputs from that tile's queue):
  receiving only when the loop reaches a tile made the ranks take turns (measured: 2 ranks
  0.93-0.98 of one). It receives in the order the simulation says the tiles finish (each
  rank's in its own order), so no rank's send waits on another rank's slower tile. The other
  ranks send their tiles as they finish them and keep none; their
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
        self.last: dict[str, Any] = {}  # the last decode's tiles, for reports and tests
        self.last_encode: dict[str, int] = {}
        self.owners: list[int] = []  # the current decode's owner of each tile ([Note: tiles by cost])
        self.costs: list[int] = []  # and each tile's size (the census)

    # -- transfers (host buffers; a tile on a GPU is copied over) ---------------------------

    def _send(self, t: torch.Tensor | None, dest: int) -> None:
        self.group.sendrecv(_header(t), dest, _NOTHING, dest)
        if t is not None:
            self.group.sendrecv(as_numpy(t.detach().cpu().contiguous()), dest, _NOTHING, dest)

    def _mark(self, status: int, dest: int) -> None:
        self.group.sendrecv(_header(None, status), dest, _NOTHING, dest)

    def _receive_all(self, tiles: dict[int, queue.Queue[Any]], end: queue.Queue[Any]) -> None:
        """The writer's receiver thread ([Note: receive ahead]): every other VAE rank's tiles, in
        the order they are expected to finish (:func:`receive_order`), each call's output put on
        its tile's queue until the tile's TILE_END, then each rank's ALL_DONE. Puts None on `end`
        when all arrived; an error (a failed header included) goes on every tile queue and `end`."""
        tile = -1
        try:
            for tile in receive_order(self.costs, self.owners):
                while not self._receive_one(tile, self.owners[tile], tiles[tile]):
                    pass
            for owner in range(1, self.n):
                h = self._header_from(owner, tile)
                if h[0] != _ALL_DONE:
                    raise RuntimeError(f"parallel VAE: rank {owner} of the VAE group sent more than its tiles "
                                       "(the ranks' tile loops differ)")
            end.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the decoding thread, which raises it
            for q in (*tiles.values(), end):
                q.put(exc)

    def _header_from(self, owner: int, tile: int) -> np.ndarray:
        h = np.empty(_HEADER, dtype=np.int64)
        self.group.sendrecv(_NOTHING, owner, h, owner)
        if h[0] == _FAILED:
            raise RuntimeError(f"parallel VAE: rank {owner} of the VAE group failed computing tile {tile} (its "
                               "own error is in its output)")
        return h

    def _receive_one(self, tile: int, owner: int, out: queue.Queue[Any]) -> bool:
        """One message of `tile` from `owner`: a decoder call's output (put on `out`; False), or its
        TILE_END (True)."""
        h = self._header_from(owner, tile)
        if h[0] == _TILE_END:
            return True
        if h[0] != 1:
            raise RuntimeError(f"parallel VAE: rank {owner} of the VAE group ended its tiles before tile {tile} "
                               "(the ranks' tile loops differ)")
        t = _empty_for(h)
        self.group.sendrecv(_NOTHING, owner, as_numpy(t), owner)
        out.put(t)
        return False

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
        stock loop; tile numbers follow [Note: tiles by cost]."""
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
        costs = self.costs = self._census(z, args, kwargs)
        self.owners = deal(costs, self.n)
        received = {t: queue.Queue() for t, owner in enumerate(self.owners) if owner != 0}
        end: queue.Queue[Any] = queue.Queue()

        def on_call(tile: int, stock: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
            if tile >= len(self.owners):  # recorded: a non-writer's loop swallows what it raises
                failed.append(RuntimeError(f"parallel VAE: the decode met tile {tile} but its census counted "
                                           f"{len(self.owners)} tiles: the tile loop is not the same twice"))
                raise failed[-1]
            owner = self.owners[tile]
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
                got = received[tile].get()
                if isinstance(got, BaseException):
                    raise got
                return got.to(z.device)
            return z.new_empty((0,) * z.dim())  # not computed: the stock loop only collects (and joins) it

        if writer:
            receiver = threading.Thread(target=self._receive_all, args=(received, end), name="hsdp-vae-receive",
                                        daemon=True)
            receiver.start()
            with self._tiles(self.vae.decoder, on_call) as state:
                out = self._stock_decode(z, *args, **kwargs)
            receiver.join()
            last = end.get()  # the receiver's end: everything received, or why not
            if last is not None:
                raise last
            unused = [t for t, q in received.items() if not q.empty()]
            if unused:
                raise RuntimeError(f"parallel VAE: the writer's loop ended with tiles {unused} received and unused "
                                   "(the ranks' tile loops differ)")
            self.last = self._summary(state, costs)
            log.info("parallel VAE: decoded %s", self.spread())
            return out
        state = self._until_blend(on_call, z, args, kwargs)
        if failed:
            raise failed[0]
        if sent["tile"] != -1:
            self._mark(_TILE_END, 0)
        self._mark(_ALL_DONE, 0)
        self.last = self._summary(state, costs)
        sample = z.new_zeros((z.shape[0], 3, *(1,) * (z.dim() - 2)))  # 1 pixel (and frame): not the output
        from diffusers.models.autoencoders.vae import DecoderOutput

        bound = inspect.signature(self._stock_decode).bind(z, *args, **kwargs)
        return DecoderOutput(sample=sample) if bound.arguments.get("return_dict", True) else (sample,)

    def _until_blend(self, on_call: Callable[..., torch.Tensor], z: torch.Tensor, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> dict[str, int]:
        """The stock decode loop with the decoder's forward replaced by `on_call`, stopped at its
        first blend (the loop's state: how many tiles and calls it met)."""
        blends = [name for name in ("blend_v", "blend_h") if hasattr(self.vae, name)]
        state: dict[str, int] = {"tile": -1, "calls": 0}
        try:
            for name in blends:
                setattr(self.vae, name, self._stop)
            with self._tiles(self.vae.decoder, on_call) as state:
                self._stock_decode(z, *args, **kwargs)
        except _Done:
            pass
        except Exception:  # noqa: BLE001, S110 - past its tiles: the stock code met a placeholder where it
            # expected a tile (a loop that works on its tiles before blending); what it met before is complete
            pass
        finally:
            for name in blends:
                with contextlib.suppress(AttributeError):
                    delattr(self.vae, name)
        return state

    def _census(self, z: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
        """Each tile's cost, in the stock loop's order: the elements its decoder calls take in
        ([Note: tiles by cost]; nothing is decoded). Deterministic, so equal on every rank."""
        costs: list[int] = []

        def count(tile: int, stock: Callable[..., torch.Tensor], *a: Any, **kw: Any) -> torch.Tensor:
            x = a[0] if a else next(iter(kw.values()))
            if tile == len(costs):
                costs.append(0)
            costs[tile] += int(x.numel())
            return x.new_empty((0,) * x.dim())

        self._until_blend(count, z, args, kwargs)
        return costs

    def _summary(self, state: dict[str, int], costs: list[int]) -> dict[str, Any]:
        share = [0] * self.n
        for tile, owner in enumerate(self.owners):
            share[owner] += costs[tile]
        return {"tiles": state["tile"] + 1, "calls": state["calls"], "ranks": self.n,
                "owners": list(self.owners), "counts": [self.owners.count(r) for r in range(self.n)],
                "area_share": [round(a / max(1, sum(share)), 4) for a in share]}

    def spread(self) -> str:
        """How the last decode's tiles fell on the ranks, e.g. '6 tiles over 2 ranks: 3 + 3 (area
        0.484 + 0.516)'."""
        last = self.last
        ranks = "1 rank" if self.n == 1 else f"{self.n} ranks"
        counts = last.get("counts") or [last.get("tiles", 0)]
        area = " + ".join(f"{a:.3f}" for a in last.get("area_share", []))
        return f"{last.get('tiles', 0)} tiles over {ranks}: {' + '.join(map(str, counts))}" + (
            f" (area {area})" if area else "")

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


def _finishes(costs: list[int], owners: list[int], n: int) -> tuple[int, list[int]]:
    """The simulated decode ([Note: tiles by cost]): when the writer's loop ends, and when each
    tile is done at its owner (costs as times; every rank computes its tiles in order)."""
    clock = [0] * n
    done = [0] * len(costs)
    writer = 0
    for t, (cost, owner) in enumerate(zip(costs, owners)):
        clock[owner] += cost
        done[t] = clock[owner]
        writer = writer + cost if owner == 0 else max(writer, done[t])
    return writer, done


def deal(costs: list[int], n: int, passes: int = 8, window: int = 8) -> list[int]:
    """The owner of each tile ([Note: tiles by cost]): round robin, then, while the writer's loop
    ends sooner for it, a tile moved to another rank or two tiles at most `window` apart
    swapping owners (the same on every rank: no randomness)."""
    owners = [t % n for t in range(len(costs))]
    if n <= 1:
        return owners
    best = _finishes(costs, owners, n)[0]

    def keep_if_better() -> bool:
        nonlocal best
        finish = _finishes(costs, owners, n)[0]
        if finish < best:
            best = finish
            return True
        return False

    for _ in range(passes):
        improved = False
        for t in range(len(costs)):
            for rank in range(n):
                if rank != owners[t]:
                    was, owners[t] = owners[t], rank
                    if keep_if_better():
                        improved = True
                    else:
                        owners[t] = was
            for u in range(t + 1, min(len(costs), t + 1 + window)):
                if owners[u] != owners[t]:
                    owners[t], owners[u] = owners[u], owners[t]
                    if keep_if_better():
                        improved = True
                    else:
                        owners[t], owners[u] = owners[u], owners[t]
        if not improved:
            break
    return owners


def receive_order(costs: list[int], owners: list[int]) -> list[int]:
    """The writer's receiving order: the other ranks' tiles by when they are expected to be done
    (each rank's own in the loop's order), so no sender waits behind a slower rank's tile."""
    done = _finishes(costs, owners, max(owners, default=0) + 1)[1]
    return sorted((t for t, owner in enumerate(owners) if owner != 0), key=lambda t: (done[t], t))


def install(pipe: Any, group: Any, n: int) -> TileSpread | None:
    """Spread `pipe`'s VAE's tiles over the first `n` ranks of `group` (see the module docstring)."""
    vae = getattr(pipe, "vae", None)
    if n <= 1 or vae is None:
        return None
    return TileSpread(vae, group, n)
