"""The vision tower with mlx-vlm's attention (one call per window or image, the bounds read back once a layer) and
with mlxd's (one call a layer: ``mlxd.models.tower_attention``), on the same loaded weights, in alternating rounds.

For each case (a number of images of one size, encoded in one tower call, as requests arriving together are), the
script times the call (build, run, wait) and checks that both give the same features.

    python benchmarks/tower_attention.py --model ../models/qwen2_5_vl_7b --images 1,4 --size 448 --out x.md
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from dispatch_costs import emit  # noqa: E402
from vision import png  # noqa: E402

from mlxd.config.schema import ModelConfig  # noqa: E402
from mlxd.media.images import decode_image  # noqa: E402
from mlxd.models.load import load  # noqa: E402
from mlxd.models.tower_attention import FAMILIES, SegmentAttention  # noqa: E402
from mlxd.pipeline.images import ImageInputs  # noqa: E402


def tower_inputs(loaded, count: int, size: int, seed: int) -> list[dict[str, mx.array]]:
    """Per-image processor inputs for ``count`` new ``size``-px images."""
    images = [decode_image(png(seed + i, size), max_pixels=1 << 24, param="bench") for i in range(count)]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What are they?"}]
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                    add_generation_prompt=True)
    _, media = ImageInputs(loaded.processor, loaded.model.image_token_id).process(rendered, images)
    per_image = loaded.model.split_inputs(media.inputs, count)
    return [{k: mx.array(v) for k, v in image.items()} for image in per_image]


def encode(model, images: list[dict[str, mx.array]]) -> tuple[float, mx.array]:
    """Seconds for one tower call on ``images`` (evaluated), and its first output."""
    start = time.perf_counter()
    features = model.encode_many(images) if len(images) > 1 else [model.encode(images[0], 0)]
    mx.eval(features)
    first = features[0][0] if isinstance(features[0], tuple) else features[0]
    return time.perf_counter() - start, first


class Swapper:
    """Puts mlx-vlm's attention modules, or mlxd's, in the loaded tower; both hold the same ``qkv`` and ``proj``."""

    def __init__(self, loaded) -> None:
        vision = importlib.import_module(f"mlx_vlm.models.{loaded.model.family}.vision")
        self.blocks = loaded.model.vlm.vision_tower.blocks
        self.ours = [block.attn for block in self.blocks]
        self.theirs = []
        for ours in self.ours:
            theirs = vision.Attention(ours.qkv.weight.shape[1], ours.num_heads)
            theirs.update_modules({"qkv": ours.qkv, "proj": ours.proj})
            self.theirs.append(theirs)

    def use(self, ours: bool) -> None:
        for block, attn in zip(self.blocks, self.ours if ours else self.theirs, strict=True):
            block.update_modules({"attn": attn})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Qwen-VL model folder")
    parser.add_argument("--images", default="1,4", help="images per tower call, one case each")
    parser.add_argument("--size", type=int, default=448, help="image side in pixels")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per case and round")
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()

    loaded = load(ModelConfig(source=args.model))
    family = loaded.model.family
    if family not in FAMILIES:
        raise SystemExit(f"{family} is not a family mlxd's tower attention serves: {FAMILIES}")
    if not isinstance(loaded.model.vlm.vision_tower.blocks[0].attn, SegmentAttention):
        raise SystemExit("load() did not swap in mlxd's tower attention")
    swapper = Swapper(loaded)

    counts = [int(c) for c in args.images.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    diffs: dict[int, float] = {}
    for round_ in range(args.rounds):
        for label in (("mlx-vlm", "mlxd") if round_ % 2 == 0 else ("mlxd", "mlx-vlm")):
            swapper.use(label == "mlxd")
            for count in counts:
                for rep in range(args.repeats + 1):  # the first call of each case and round is a warm-up
                    images = tower_inputs(loaded, count, args.size, 10_000 * round_ + 100 * rep + count)
                    seconds, _ = encode(loaded.model, images)
                    if rep:
                        times.setdefault((label, count), []).append(seconds)
        for count in counts:
            images = tower_inputs(loaded, count, args.size, 99_999 + count)
            swapper.use(False)
            _, want = encode(loaded.model, images)
            swapper.use(True)
            _, got = encode(loaded.model, images)
            scale = float(mx.abs(want).max())
            diffs[count] = max(diffs.get(count, 0.0), float(mx.abs(got.astype(mx.float32) - want).max()) / scale)

    lines = [f"Model: `{args.model}` ({family}, tower dtype {swapper.ours[0].qkv.weight.dtype}); {args.size}-px "
             f"images; {args.rounds} rounds x {args.repeats} calls a case, the two kinds alternating; "
             f"device {mx.default_device()}.", "",
             "| images a call | mlx-vlm attention, median ms (min-max) | mlxd, median ms (min-max) | mlx-vlm / mlxd "
             "| largest difference / largest feature |", "|---|---|---|---|---|"]
    for count in counts:
        a, b = times[("mlx-vlm", count)], times[("mlxd", count)]
        ratio = statistics.median(a) / statistics.median(b)
        lines.append(f"| {count} | {_ms(a)} | {_ms(b)} | {ratio:.2f}x | {diffs[count]:.1e} |")
    emit("\n".join(lines) + "\n", args.out)


def _ms(seconds: list[float]) -> str:
    return f"{1000 * statistics.median(seconds):.1f} ({1000 * min(seconds):.1f}-{1000 * max(seconds):.1f})"


if __name__ == "__main__":
    main()
