"""Batch-width buckets: the row counts the model is shown, so that a GPU backend meets few shapes.

MLX's CUDA backend builds kernels, matmul plans and CUDA graphs per exact shape of a pass: a decode step or a group of
prompts at a row count it has not run before paid 35-70 ms more once on an H100 (Qwen3-8B shape), and warming every
count 1..``max_running`` took 202 s at 64 rows on an H200. With buckets, a decode step of ``n`` rows and a pass of
``n`` prompts run at :func:`bucket_width` rows, the rest inert copies of a real row whose outputs are dropped, and
warm-up meets each bucket once (:mod:`mlxd.engine.step.warmup`).

The widths: 1, 2, 4, 8, then every multiple of :data:`STEP` (8) up to ``max_running`` (and ``max_running`` itself):
19 widths at 128 rows. A GPU decode step reads every weight once whatever the rows (an 8B model: 16 GB against
about 150 KB of KV per row and token), so a padded row costs its own KV read only: at most 7 rows more, 7/17 of the
KV read and nothing of the weights' at 17 rows, less above. Multiples of 16 would halve the widths (and warm-up's
passes) at twice that waste; powers of two beyond 8 would waste up to a whole half of the rows' KV at 33 rows.

On the CPU nothing is built per shape and a padded row costs its full compute, so buckets are on only for GPU
backends by default (:func:`pad_batches`); tests turn them on to check their outputs on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

SMALL = (1, 2, 4, 8)
STEP = 8


def pad_batches() -> bool:
    """Whether batches are padded to buckets by default here: on GPU backends, not on the CPU."""
    return mx.default_device() != mx.cpu


def bucket_widths(max_running: int) -> tuple[int, ...]:
    """Every width a batch of 1..``max_running`` rows is run at, ascending (``max_running`` the last)."""
    widths = [w for w in SMALL if w < max_running]
    widths += range(STEP * 2, max_running, STEP)
    return (*widths, max_running) if max_running >= 1 else ()


@dataclass(frozen=True, slots=True)
class Buckets:
    """The widths batches of up to ``max_running`` rows are padded to: groups of prompts always, decode steps when
    ``decode``."""

    max_running: int
    decode: bool = True

    @property
    def widths(self) -> tuple[int, ...]:
        return bucket_widths(self.max_running)

    def width(self, num_rows: int) -> int:
        """The rows a batch of ``num_rows`` real rows runs at: the smallest bucket that holds them (``num_rows``
        itself beyond ``max_running``, which only a plan made elsewhere can ask). Plain arithmetic: admission asks
        it for every request it weighs."""
        if num_rows >= self.max_running:
            return num_rows
        if num_rows <= SMALL[-1]:
            return min(1 << max(0, num_rows - 1).bit_length(), self.max_running)
        return min(-(-num_rows // STEP) * STEP, self.max_running)


def make_buckets(max_running: int, setting: str = "auto") -> Buckets | None:
    """The buckets for ``max_running`` rows as ``[engine] batch_buckets`` says: "on" (decode steps and groups of
    prompts), "groups" (groups only: decode steps at their own width), "off" (None: no padding), "auto" ("on" where
    :func:`pad_batches`, else "off")."""
    if setting == "auto":
        setting = "on" if pad_batches() else "off"
    if setting == "off" or max_running < 2:
        return None
    return Buckets(max_running, decode=setting == "on")
