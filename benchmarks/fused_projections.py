"""Experiment: sibling projections fed the same input (queries, keys and values; gate and up) as one wider product.

A decode step of Qwen3-8B makes 252 projection calls; on CUDA each costs host time (a Python call, a kernel node,
a share of a CUDA graph's update), and the batched step is bound by the host (``docs/benchmarks/engine.md``).
Fusing the attention's three input projections and the MLP's two makes it 144 calls. This script swaps, in a loaded
model, each such group for members that share one concatenated weight (the members hold row slices of it, so the
weights are not copied twice): the first member called with an input computes the whole product, the others take
their columns of it. It then times mlxd's ``DecodeBatch`` alone at several row counts with and without the fusion,
in alternating rounds, and checks that both give the same greedy tokens.

    python benchmarks/fused_projections.py --model ../models/qwen3-8b --rows 1,8,16
    python benchmarks/fused_projections.py --tiny qwen3 --rows 1,8     # CPU check of the mechanism
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from dispatch_costs import emit  # noqa: E402
from load import model_folder, story_prompt  # noqa: E402
from step_breakdown import joined_batch  # noqa: E402

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Group:
    """One concatenated weight (and bias) for sibling projections; remembers the last input's whole product until
    every member has taken its columns."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.weight = mx.concatenate([linear.weight for linear in linears])
        self.bias = mx.concatenate([linear.bias for linear in linears]) if "bias" in linears[0] else None
        mx.eval([a for a in (self.weight, self.bias) if a is not None])
        sizes = [linear.weight.shape[0] for linear in linears]
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.size = len(linears)
        self._input: mx.array | None = None
        self._output: mx.array | None = None
        self._left = 0
        self._matmul = _matmul_for(self.weight, self.bias is not None)

    def columns(self, x: mx.array, index: int) -> mx.array:
        if x is not self._input or self._left == 0:
            self._input, self._output, self._left = x, self._matmul(x, self.weight, self.bias), self.size
        out = self._output[..., self.bounds[index] : self.bounds[index + 1]]
        self._left -= 1
        if self._left == 0:
            self._input = self._output = None
        return out


class Member(nn.Linear):
    """A projection of a :class:`Group`: its weight (and bias) are row slices of the group's."""

    def __init__(self, group: Group, index: int) -> None:
        nn.Module.__init__(self)
        a, b = group.bounds[index], group.bounds[index + 1]
        self.weight = group.weight[a:b]
        if group.bias is not None:
            self.bias = group.bias[a:b]
        object.__setattr__(self, "_group", group)
        object.__setattr__(self, "_index", index)

    def __call__(self, x: mx.array) -> mx.array:
        return self._group.columns(x, self._index)


def _matmul_for(weight: mx.array, has_bias: bool):
    """``x @ weight.T (+ bias)``: mlxd's small-batch kernel for 2-16 rows on CUDA where it fits, else MLX's."""
    from mlxd.runtime.small_batch import MAX_ROWS, fits, plan, run

    launch = plan(weight, has_bias) if mx.cuda.is_available() and fits(weight) else None

    def matmul(x: mx.array, w: mx.array, bias: mx.array | None) -> mx.array:
        if launch is not None and x.dtype == w.dtype and 1 < x.size // x.shape[-1] <= MAX_ROWS:
            return run(launch, x, w, bias)
        return x @ w.T if bias is None else mx.addmm(bias, x, w.T)

    return matmul


def fuse(model: nn.Module) -> int:
    """Replace every group of :data:`GROUPS` found in ``model`` by :class:`Member` layers; returns the groups."""
    count = 0
    for _, module in model.named_modules():
        for names in GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if not all(isinstance(linear, nn.Linear) and not isinstance(linear, Member) for linear in linears):
                continue
            if len({linear.weight.shape[1] for linear in linears}) != 1 or len({"bias" in ln for ln in linears}) != 1:
                continue
            group = Group(linears)
            module.update_modules({name: Member(group, i) for i, name in enumerate(names)})
            count += 1
    return count


def decode_ms(model, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """Milliseconds a step of mlxd's DecodeBatch alone, and each row's greedy tokens."""
    batch = joined_batch(model, prompts)
    tokens = [[] for _ in prompts]
    batch.step()
    start = time.perf_counter()
    for _ in range(steps):
        for out, emitted in zip(tokens, batch.step(), strict=True):
            out += emitted
    seconds = time.perf_counter() - start
    return seconds / steps * 1000, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder")
    parser.add_argument("--tiny", help="build a tiny random model of this arch instead")
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()

    from mlxd.config.schema import ModelConfig
    from mlxd.models.load import load

    path = model_folder(args.model, args.tiny)
    plain, fused = load(ModelConfig(source=path)), load(ModelConfig(source=path))
    groups = fuse(fused.model)
    levels = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    same = {}
    for _ in range(args.rounds):
        for rows in levels:
            prompts = [plain.tokenizer.encode(story_prompt(i)) for i in range(rows)]
            outputs = {}
            for name, loaded in (("plain", plain), ("fused", fused)):
                ms, outputs[name] = decode_ms(loaded.model, prompts, args.steps)
                times.setdefault((name, rows), []).append(ms)
            same[rows] = same.get(rows, True) and outputs["plain"] == outputs["fused"]
    lines = [f"Model: `{path}`; {groups} projection groups fused; {args.steps} greedy steps a run, "
             f"{args.rounds} alternating rounds, best run kept.", "",
             "| rows | plain ms a step | fused ms a step | plain / fused | same greedy tokens |", "|---|---|---|---|---|"]
    for rows in levels:
        a, b = min(times[("plain", rows)]), min(times[("fused", rows)])
        lines.append(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {'yes' if same[rows] else 'no'} |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
