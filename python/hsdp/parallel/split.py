"""The token split shared by Ulysses and USP: each rank of a sequence-parallel group
holds an equal share of the tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..adapters import NUMPY

if TYPE_CHECKING:
    from ..adapters import TensorAdapter


class TokenSplit:
    """Tokens split evenly over a sequence-parallel group (``group``, ``degree``, ``rank``),
    shared by :class:`Ulysses` and :class:`hsdp.ring.USP`; ``_split_name`` names the split
    in errors."""

    group: Any
    degree: int
    rank: int
    _split_name = "sequence parallel"
    _degree_label = ""  # before the degree in errors

    def local_tokens(self, total: int) -> int:
        """Tokens per rank for a sequence of `total` tokens (ValueError when it does not divide)."""
        if total % self.degree:
            raise ValueError(
                f"{self._split_name} gives each of its {self.degree} ranks an equal share of the tokens: {total} "
                f"tokens are not divisible by {self._degree_label}{self.degree}; change the frames, height or width so that the "
                f"number of patches is a multiple of {self.degree}"
            )
        return total // self.degree

    def split_tokens(self, x: np.ndarray) -> np.ndarray:
        """(B, N, C) -> this rank's (B, N / degree, C): tokens [rank * n, (rank + 1) * n)."""
        n = self.local_tokens(x.shape[1])
        return np.ascontiguousarray(x[:, self.rank * n : (self.rank + 1) * n])

    def gather_tokens(self, x: Any, adapter: TensorAdapter | None = None) -> Any:
        """Every rank's (B, n, ...) -> the whole (B, degree * n, ...), in rank order, in
        ``adapter``'s tensors (None: NumPy arrays)."""
        ad = adapter or NUMPY
        recv = ad.all_gather(self.group, x)  # (degree, B, n, ...)
        b, n, *rest = x.shape
        return ad.permute(recv, (1, 0, *range(2, recv.ndim))).reshape(b, self.degree * n, *rest)
