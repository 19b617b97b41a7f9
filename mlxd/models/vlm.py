"""A vision-language model from mlx-vlm, shaped like the mlx-lm models the engine already drives.

The engine calls every model the same way: ``model(token_ids, cache=cache) -> logits``. :class:`VisionLanguageModel`
gives an mlx-vlm model that form (its language model's ``LanguageModelOutput`` unwrapped) and adds what a vision row
needs, in three calls that compose mlx-vlm's public pieces and patch nothing:

- :meth:`~VisionLanguageModel.encode` runs the vision tower on one image (the unit the feature cache keeps);
- :meth:`~VisionLanguageModel.embed` merges a prompt's token embeddings with its images' features and returns the
  per-prompt inputs a chunk of the prompt is run with (:class:`VisionPrompt`);
- ``model(ids, cache=..., embeds=..., **extras)`` runs one prompt chunk; ``model(ids, cache=..., rope_deltas=...)``
  runs a decode step of rows that each carry their own position offset.

Passes that feed token ids only (text prompts, decode steps, verification) run through the language model's text
twin where the family has one (:mod:`mlxd.models.text_twin`: mlx-lm's text model on the same weights, ordinary RoPE
at each row's position); prompt chunks with image embeddings run through mlx-vlm's language model.

Qwen-VL models keep multimodal position state (``_rope_deltas``, ``_position_ids``) on the model object between
calls. Rows sharing a batch need their own, so every call here passes positions explicitly (``position_ids`` for
prompt chunks, per-row ``rope_deltas`` for decode steps) and the state left on the model is never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.models.text_twin import shifted

# Families whose image inputs split per image and whose features this module knows how to compute and merge.
_QWEN = ("qwen2_vl", "qwen2_5_vl")
_QWEN3 = ("qwen3_vl", "qwen3_vl_moe")
_GEMMA3 = ("gemma3",)
# Families whose get_input_embeddings scatters features unchanged into the image-token positions: one image's
# features are what it returns for a prompt of nothing but that image's tokens.
_SCATTER = ("idefics3", "idefics2", "llava", "mistral3", "pixtral")


@dataclass(slots=True)
class VisionPrompt:
    """A prompt's merged input embeddings (1, L, D) and the extra inputs its chunks are run with (full-prompt
    position ids, deepstack features...), which the language model slices at the cache offset."""

    embeds: mx.array | None  # None once the prompt is in (Row.release_prompt)
    extras: dict[str, Any] = field(default_factory=dict)
    rope_delta: int = 0  # decode positions are cache offset + this (multimodal RoPE), else 0


def family_of(model: Any) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", "") or getattr(model, "model_type", ""))


class VisionLanguageModel(nn.Module):
    """An mlx-vlm model as the engine drives it: callable like an mlx-lm model, plus image encoding and merging."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.vlm = model
        self.family = family_of(model)
        language = model.language_model
        # Multimodal RoPE (Qwen-VL): positions are not the cache offset once an image has been seen.
        self.uses_rope_deltas = hasattr(language, "get_rope_index")
        self.image_token_id = _image_token_id(model.config)
        self.per_image = self.family in _QWEN + _QWEN3 + _GEMMA3 + _SCATTER
        self.num_vision_calls = 0  # vision-tower runs (images encoded), for tests and /v1/status
        self.num_tower_passes = 0  # calls of the vision tower (several images can share one)
        # mlx-lm's text model on the language weights (outside the parameter tree: the arrays are counted once).
        self._text: Any = None

    def attach_text_twin(self, twin: Any) -> None:
        """Run token-only passes through ``twin`` (:func:`mlxd.models.text_twin.language_twin`)."""
        self._text = twin

    @property
    def text_twin(self) -> Any:
        return self._text

    @property
    def has_text_twin(self) -> bool:
        return self._text is not None

    @property
    def language_model(self) -> Any:
        return self.vlm.language_model

    @property
    def layers(self) -> list[Any]:
        return self.language_model.layers

    def make_cache(self) -> list[Any]:
        """A row's cache: mlx-lm's (the text twin's) where there is a twin, so that text rows batch their prompts
        as on a text model (mlx-vlm's language model drives mlx-lm's attention caches alike), else mlx-vlm's."""
        if self._text is not None:
            from mlx_lm.models.cache import make_prompt_cache as text_cache

            return text_cache(self._text)
        from mlx_vlm.models.cache import make_prompt_cache

        return make_prompt_cache(self.language_model)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, *, embeds: mx.array | None = None,
                 rope_deltas: mx.array | None = None, **extras: Any) -> mx.array:
        """Logits for ``inputs`` (B, L). A prompt chunk of a vision row passes its ``embeds`` slice and the
        prompt's ``extras``; a decode step of a multimodal-RoPE model passes ``rope_deltas`` (B, 1)."""
        if self._text is not None and embeds is None and not extras:
            if rope_deltas is not None and cache is not None:
                cache = shifted(cache, rope_deltas.reshape(-1))
            return self._text(inputs, cache=cache)
        out = self.language_model(inputs, inputs_embeds=embeds, cache=cache,
                                  **self._positions(inputs, cache, rope_deltas, extras))
        return getattr(out, "logits", out)

    def forward_hidden(self, inputs: mx.array, cache: list[Any] | None = None, *, embeds: mx.array | None = None,
                       rope_deltas: mx.array | None = None, **extras: Any) -> tuple[mx.array, mx.array]:
        """As a call, with the last hidden state (after the final norm: what MTP heads read): ``(logits (B, L, V),
        hidden (B, L, H))``. Qwen3.5-family language models only (``return_hidden``)."""
        out = self.language_model(inputs, inputs_embeds=embeds, cache=cache, return_hidden=True,
                                  **self._positions(inputs, cache, rope_deltas, extras))
        return out.logits, out.hidden_states[-1]

    @property
    def has_verify_entry(self) -> bool:
        """Whether the language model verifies speculative blocks itself (Qwen3.5: ``speculative_verify``)."""
        return callable(getattr(self.language_model, "speculative_verify_hidden", None))

    def verify_forward(self, inputs: mx.array, cache: list[Any], *, rope_deltas: mx.array | None = None,
                       **extras: Any) -> tuple[mx.array, mx.array, Any]:
        """A speculative step's forward through the language model's own entry: ``(logits, hidden, transaction)``,
        the transaction mlx-vlm opened on the caches it updated (commit the kept lengths, or abort). The ordinary
        call would not do: for several tokens a row on a batched cache it replaces cache objects row by row."""
        out = self.language_model(inputs, cache=cache, speculative_verify=True, return_hidden=True,
                                  **self._positions(inputs, cache, rope_deltas, extras))
        return out.logits, out.hidden_states[-1], out.gdn_states

    def _positions(self, inputs: mx.array, cache: list[Any] | None, rope_deltas: mx.array | None,
                   extras: dict[str, Any]) -> dict[str, Any]:
        """``extras`` with the position inputs of multimodal RoPE: per-row offsets in a batch, else positions from
        the cache offset."""
        if self.uses_rope_deltas and rope_deltas is None and "position_ids" not in extras:
            offset = _offset(cache)
            positions = mx.arange(offset, offset + inputs.shape[1])
            extras["position_ids"] = mx.broadcast_to(positions, (3, inputs.shape[0], inputs.shape[1]))
        if rope_deltas is not None:
            extras["rope_deltas"] = rope_deltas
        return extras

    # ---- images ----

    def split_inputs(self, inputs: dict[str, np.ndarray], num_images: int) -> list[dict[str, np.ndarray]] | None:
        """The processor's image inputs, one dict per image; ``None`` when this family's cannot be split."""
        if not self.per_image or num_images == 0:
            return None
        pixels = inputs["pixel_values"]
        if self.family in _QWEN + _QWEN3:
            grids = inputs["image_grid_thw"]
            ends = np.cumsum([int(np.prod(g)) for g in grids])
            starts = np.concatenate([[0], ends[:-1]])
            return [{"pixel_values": pixels[s:e], "image_grid_thw": grids[i : i + 1]}
                    for i, (s, e) in enumerate(zip(starts, ends, strict=True))]
        if pixels.ndim == 5:  # (1, images, C, H, W), Idefics-style
            if pixels.shape[1] != num_images:
                return None
            mask = inputs.get("pixel_attention_mask")
            return [{"pixel_values": pixels[:, i : i + 1],
                     **({"pixel_attention_mask": mask[:, i : i + 1]} if mask is not None else {})}
                    for i in range(num_images)]
        if pixels.shape[0] != num_images:
            return None
        return [{"pixel_values": pixels[i : i + 1]} for i in range(num_images)]

    def encode(self, image: dict[str, Any], num_tokens: int, num_images: int = 1) -> Any:
        """Run the vision tower on one image's inputs (MLX arrays; ``num_images`` joined ones from
        :meth:`encode_many`); returns what :meth:`embed` merges."""
        self.num_vision_calls += num_images
        self.num_tower_passes += 1
        vlm, pixels = self.vlm, image["pixel_values"]
        if self.family in _QWEN:
            dtype = vlm.vision_tower.patch_embed.proj.weight.dtype
            return vlm.vision_tower(pixels.astype(dtype), image["image_grid_thw"], output_hidden_states=False)
        if self.family in _QWEN3:
            dtype = vlm.vision_tower.patch_embed.proj.weight.dtype
            features, deepstack = vlm.vision_tower(pixels.astype(dtype), image["image_grid_thw"])
            return features, tuple(deepstack)
        if self.family in _GEMMA3:
            dtype = vlm.language_model.model.embed_tokens.weight.dtype
            hidden, _, _ = vlm.vision_tower(pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
            return vlm.multi_modal_projector(hidden)
        ids = mx.full((1, num_tokens), self.image_token_id, dtype=mx.int32)
        extra = {k: v for k, v in image.items() if k != "pixel_values"}
        return vlm.get_input_embeddings(ids, pixels, **extra).inputs_embeds[0]

    @property
    def encodes_together(self) -> bool:
        """Whether :meth:`encode_many` runs several images through one vision-tower call (the Qwen families, whose
        towers take a list of images as one sequence of patches, attention kept within each image)."""
        return self.family in _QWEN + _QWEN3

    def encode_many(self, images: list[dict[str, Any]]) -> list[Any]:
        """:meth:`encode` for several images (MLX arrays each) in one vision-tower call; features per image.
        Families that :attr:`encodes_together` only.

        A tower call costs the host a fixed number of operations per layer (and mlx-vlm's Qwen towers wait for the
        device once a layer), so images arriving together are cheaper in one call than one by one."""
        joined = {"pixel_values": mx.concatenate([i["pixel_values"] for i in images], axis=0),
                  "image_grid_thw": mx.concatenate([i["image_grid_thw"] for i in images], axis=0)}
        features = self.encode(joined, 0, num_images=len(images))
        merge = self.vlm.vision_tower.spatial_merge_size ** 2
        sizes = [int(np.prod(np.array(i["image_grid_thw"]))) // merge for i in images]
        bounds = np.cumsum(sizes)[:-1].tolist()
        if self.family in _QWEN3:
            main, deepstack = features
            parts = [mx.split(main, bounds, axis=0)] + [mx.split(d, bounds, axis=0) for d in deepstack]
            return [(part[0], tuple(part[1:])) for part in zip(*parts, strict=True)]
        return mx.split(features, bounds, axis=0)

    def embed(self, prompt: mx.array, inputs: dict[str, Any], features: list[Any] | None) -> VisionPrompt:
        """Merge a prompt's (1, L) token embeddings with its images: ``features`` per image (from :meth:`encode`),
        or ``None`` to run the vision tower on all of ``inputs`` at once (families that cannot split)."""
        vlm = self.vlm
        if features is None:
            self.num_vision_calls += 1
            self.num_tower_passes += 1
            out = vlm.get_input_embeddings(prompt, inputs["pixel_values"], mask=mx.ones_like(prompt),
                                           **_without(inputs, "pixel_values"))
        elif self.family in _QWEN3:
            return self._embed_qwen3(prompt, inputs, features)
        else:
            cached = mx.concatenate(features, axis=0)
            out = vlm.get_input_embeddings(prompt, inputs["pixel_values"], mask=mx.ones_like(prompt),
                                           cached_image_features=cached, **_without(inputs, "pixel_values"))
        extras = {k: v for k, v in out.to_dict().items()
                  if v is not None and k not in ("inputs_embeds", "attention_mask_4d", "attention_mask")}
        return self._prompt(out.inputs_embeds, extras)

    def _embed_qwen3(self, prompt: mx.array, inputs: dict[str, Any], features: list[Any]) -> VisionPrompt:
        # Qwen3-VL's own cached-features path drops the deepstack features, so the merge is done here from its
        # public pieces: the result equals get_input_embeddings on the images themselves.
        vlm, config = self.vlm, self.vlm.config
        embeds = vlm.language_model.model.embed_tokens(prompt)
        image_features = mx.concatenate([f for f, _ in features], axis=0)
        embeds, _ = vlm.merge_input_ids_with_image_features(
            image_features, embeds, prompt, config.image_token_index, config.video_token_index)
        num_layers = len(features[0][1])
        deepstack = [mx.concatenate([d[i] for _, d in features], axis=0) for i in range(num_layers)]
        extras = {"visual_pos_masks": prompt == config.image_token_index, "deepstack_visual_embeds": deepstack}
        positions, deltas = vlm.language_model.get_rope_index(prompt, inputs["image_grid_thw"], None, None)
        extras.update(position_ids=positions, rope_deltas=deltas)
        return self._prompt(embeds, extras)

    def _prompt(self, embeds: mx.array, extras: dict[str, Any]) -> VisionPrompt:
        deltas = extras.pop("rope_deltas", None)
        delta = int(mx.array(deltas).reshape(-1)[0].item()) if deltas is not None else 0
        return VisionPrompt(embeds, extras, delta)


def _image_token_id(config: Any) -> int | None:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


def _offset(cache: list[Any] | None) -> int:
    """The positions a cache holds: its first attention layer's offset (recurrent layers of hybrid models keep
    none)."""
    offset = next((layer.offset for layer in cache or () if getattr(layer, "offset", None) is not None), 0)
    return int(offset) if not isinstance(offset, mx.array) else int(offset.max().item())


def _without(inputs: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in inputs.items() if k not in names}
