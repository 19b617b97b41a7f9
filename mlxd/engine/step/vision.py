"""How the engine prepares a vision row's prompt: image features (through the feature cache), then the merged
input embeddings its prompt chunks run with. Everything else about a vision row (chunks, cache, decode batch) is
what a text row does.

The feature cache keeps each image's vision-tower output by the image's content digest, within a byte budget (least
recently used first out): an image re-sent in a later turn, or after a different system prompt, costs no
vision-tower call.

The engine comes here for the requests the ``route`` stage sent down the ``vision`` path (``EngineRequest.route``),
and only for those. One method runs the vision tower, :meth:`VisionPrefill.encode`; what differs is where and when
it runs:

- on the encoder thread (:mod:`mlxd.engine.step.encoder`), beside the engine's steps: an accepted request whose
  images the feature cache lacks is held (:meth:`VisionPrefill.hold`; the scheduler does not admit it) until the
  encoder thread gives their features back (:meth:`VisionPrefill.take`);
- without the encoder (the feature cache off, a family that does not split, a distributed group whose ranks must
  run the same work in the same step), in the engine's step that starts an image prompt, for the images of every
  image request not started yet (:meth:`VisionPrefill.encode_ahead`);
- as a request's prompt starts, for those of its images the feature cache still lacks (:meth:`VisionPrefill.prepare`;
  the encoder's job failed, say), where a failure ends that request only.

Families whose image inputs cannot be split per image (``mlxd.models.vlm`` lists those that split) have no features
of their own to cache: mlx-vlm's merge runs their tower with the prompt, on every request
(:meth:`~mlxd.models.vlm.VisionLanguageModel.embed` given no features, in :meth:`VisionPrefill.prepare`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxd.engine.base import EngineRequest
from mlxd.engine.step.encoder import Encoded, ImageEncoder, Job


def prompt_key(request: EngineRequest) -> list[int]:
    """The prefix-cache key of a prompt: its token ids, with the first placeholder token of each image replaced by
    a key derived from the image's digest (a negative number: never a token id). Cached state that covers an
    image's placeholders is then reused only for the same image bytes."""
    media = request.media
    if media is None:
        return request.prompt
    key = list(request.prompt)
    for (start, _), digest in zip(media.spans, media.digests, strict=True):
        key[start] = -1 - int(digest[:15], 16)
    return key


class FeatureCache:
    """Vision-tower outputs by image digest, within ``budget_bytes`` (0: off)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0

    def get(self, key: str) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            self.num_misses += 1
            return None
        self._entries.move_to_end(key)
        self.num_hits += 1
        return entry[0]

    def put(self, key: str, features: Any) -> None:
        num_bytes = sum(a.nbytes for _, a in tree_flatten(features))
        if num_bytes > self.budget_bytes or key in self._entries:
            return
        self._entries[key] = (features, num_bytes)
        self.num_bytes += num_bytes
        while self.num_bytes > self.budget_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self.num_bytes -= freed

    def holds(self, key: str) -> bool:
        """Whether ``key`` is cached (not counted as a hit or a miss)."""
        return key in self._entries

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.num_bytes, "budget_bytes": self.budget_bytes,
                "hits": self.num_hits, "misses": self.num_misses}


class VisionPrefill:
    """Builds vision rows' prompts for a :class:`~mlxd.models.vlm.VisionLanguageModel`; with ``deliver``, encodes
    images ahead on an :class:`~mlxd.engine.step.encoder.ImageEncoder` whose results ``deliver`` hands to the engine
    thread (which passes them to :meth:`take`)."""

    max_images_a_call = 16

    def __init__(self, model: Any, feature_cache_bytes: int,
                 deliver: Callable[[Encoded], None] | None = None) -> None:
        self.model = model
        self.features = FeatureCache(feature_cache_bytes)
        self.encoder = ImageEncoder(self.encode, deliver) if deliver is not None and feature_cache_bytes else None
        self._held: dict[str, set[str]] = {}  # request id -> digests of its images not encoded yet
        self._in_flight: set[str] = set()  # digests with the encoder
        self._job: Job = {}  # images to hand over at the next flush()

    def prepare(self, request: EngineRequest) -> Any:
        """The request's :class:`~mlxd.models.vlm.VisionPrompt` (evaluated: the vision tower runs here)."""
        media = request.media
        assert media is not None
        inputs = {k: mx.array(v) for k, v in media.inputs.items()}
        prompt = mx.array(request.prompt, dtype=mx.int32)[None]
        images = self._images(request)
        if images is None:
            vision = self.model.embed(prompt, inputs, None)
        else:
            vision = self.model.embed(prompt, inputs, [self._image(*image) for image in images])
        mx.eval(vision.embeds, vision.extras)
        return vision

    def encode_ahead(self, requests: list[EngineRequest]) -> int:
        """Encode the images of ``requests`` (prompts about to start) that the feature cache lacks in one
        vision-tower call, up to :attr:`max_images_a_call`; their :meth:`prepare` then finds them cached. Returns
        how many were encoded: none for families without a joint call, a feature cache turned off, or fewer than two
        images."""
        if not self.model.encodes_together or not self.features.budget_bytes:
            return 0
        job: Job = {}
        for request in requests:
            for digest, image in self._missing(request).items():
                if len(job) < self.max_images_a_call:
                    job.setdefault(digest, image)
        if len(job) < 2:
            return 0
        for digest, features in zip(job, self.encode(job), strict=True):
            self.features.put(digest, features)
        return len(job)

    def encode(self, job: Job) -> list[Any]:
        """The vision tower call, the only one: the features of ``job``'s images, in its order, evaluated. One tower
        call for them all where the family takes several images at once
        (:attr:`~mlxd.models.vlm.VisionLanguageModel.encodes_together`), else one each. Reads and writes nothing
        but the model, so that it runs on the encoder thread as well as on the engine thread."""
        images = [{k: mx.array(v) for k, v in inputs.items()} for inputs, _ in job.values()]
        if self.model.encodes_together and len(images) > 1:
            features = self.model.encode_many(images)
        else:
            features = [self.model.encode(image, num_tokens)
                        for image, (_, num_tokens) in zip(images, job.values(), strict=True)]
        mx.eval(features)
        return list(features)

    def hold(self, request: EngineRequest) -> bool:
        """Whether ``request`` must wait for the encoder: its images the feature cache lacks join the next job
        (those another request already sent are not sent twice). False without the encoder, or when every image
        is cached."""
        missing = self._missing(request) if self.encoder is not None else {}
        for digest, image in missing.items():
            if digest not in self._in_flight:
                self._job.setdefault(digest, image)
        if missing:
            self._held[request.request_id] = set(missing)
        return bool(missing)

    def _images(self, request: EngineRequest) -> list[tuple[str, dict[str, Any], int]] | None:
        """The request's images in prompt order: digest, processor inputs and placeholder tokens each; None when the
        family's inputs cannot be split per image."""
        media = request.media
        per_image = self.model.split_inputs(media.inputs, len(media.digests))
        if per_image is None:
            return None
        token = self.model.image_token_id
        return [(digest, image, request.prompt[start:end].count(token))
                for digest, image, (start, end) in zip(media.digests, per_image, media.spans, strict=True)]

    def _missing(self, request: EngineRequest) -> Job:
        """Those of the request's images the feature cache lacks (none when they cannot be split per image)."""
        return {digest: (image, num_tokens) for digest, image, num_tokens in self._images(request) or []
                if not self.features.holds(digest)}

    def flush(self) -> None:
        """Hand the images held since the last flush to the encoder, at most :attr:`max_images_a_call` a job."""
        if not self._job:
            return
        todo = list(self._job.items())
        self._job = {}
        for i in range(0, len(todo), self.max_images_a_call):
            job = dict(todo[i : i + self.max_images_a_call])
            self._in_flight.update(job)
            self.encoder.submit(job)

    def take(self, encoded: Encoded) -> list[str]:
        """Cache a finished job's features; returns the requests it released (every image of theirs is done,
        encoded or failed: a failed one is encoded again when the request starts, in :meth:`prepare`)."""
        for digest, features in zip(encoded.digests, encoded.features, strict=False):
            self.features.put(digest, features)
        done = set(encoded.digests)
        self._in_flight -= done
        released = []
        for request_id, digests in self._held.items():
            digests -= done
            if not digests:
                released.append(request_id)
        for request_id in released:
            del self._held[request_id]
        return released

    def forget(self, request_id: str) -> None:
        """A request ended: it waits for nothing any more. (Requests ended all at once, by an abort, are let go
        when their jobs finish.)"""
        self._held.pop(request_id, None)

    def start(self) -> None:
        if self.encoder is not None:
            self.encoder.start()

    def stop(self) -> None:
        if self.encoder is not None:
            self.encoder.stop()

    def status(self) -> dict[str, Any]:
        """Vision-tower runs (one per image encoded) and tower passes (images encoded together share one), the
        feature cache's counters, the encoder thread's (None: images are encoded in the engine's steps), and whether
        token-only passes run through the language model's text twin (:mod:`mlxd.models.text_twin`)."""
        return {"num_vision_calls": self.model.num_vision_calls, "num_tower_passes": self.model.num_tower_passes,
                "feature_cache": self.features.stats(), "text_twin": self.model.has_text_twin,
                "encoder": self.encoder.status() if self.encoder is not None else None,
                "num_held_requests": len(self._held)}

    def _image(self, digest: str, image: dict[str, Any], num_tokens: int) -> Any:
        """One image's features: from the cache, else from the vision tower (``image``: its numpy inputs)."""
        features = self.features.get(digest)
        if features is None:
            [features] = self.encode({digest: (image, num_tokens)})
            self.features.put(digest, features)
        return features
