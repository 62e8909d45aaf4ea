"""Images -> what the engine and the workers need: the model's Hugging Face image processor
(run off the event loop by the API server), placeholder tokens expanded in the prompt (their
count from the processed arrays), a content hash per item (pixels + processor kwargs), and
the processed tensors in the shared-memory store (an item already there is only referenced:
the store is the processor-output cache).

What differs between models (the placeholder token, its count per image, the accepted
mm_processor_kwargs, the arrays kept) is the model's own MultiModalInfo (multimodal/info.py),
which the frontend passes in: nothing here names a model type.

transformers 5 cannot build AutoProcessor for Qwen2.5-VL without torchvision (it also makes a
video processor), so the image processor and the tokenizer are used directly; the prompt
expansion is the processor's own rule (grid t*h*w / merge^2 copies of the image token)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from ipc import envs
from ipc.config import EngineConfig
from ipc.messages import MultiModalItem
from multimodal.media import MediaError
from multimodal.info import MultiModalInfo
from shm.object_store import ObjectStoreWriter, StoreFull

STORE_WAIT_S = 10.0   # a full store frees as running requests finish


class StoredImage(NamedTuple):
    """An image in the shared-memory store: its content hash, its placeholder tokens, its entry."""
    hash: str
    num_tokens: int
    store_addr: int


class StoreBusy(RuntimeError):
    """The store stayed full of images of requests in flight: the server is overloaded (503)."""


@dataclass
class MMStats:
    """Counters for metrics: processor-output cache lookups, and processing time (vLLM has no
    metric for it: the stats log line shows it)."""
    cache_queries: int = 0
    cache_hits: int = 0
    processing_secs: float = 0.0
    processed_items: int = 0


class MultiModalProcessor:
    def __init__(self, config: EngineConfig, store: ObjectStoreWriter | None, info: MultiModalInfo):
        with open(f"{config.model}/config.json") as f:
            self.hf = json.load(f)
        self.config = config
        self.info = info
        self.model_type = self.hf.get("model_type")   # part of each item's hash
        self.max_pixels = info.max_pixels(config.model, self.hf)  # the largest image mm_processor_kwargs may ask for
        self.store = store
        self.stats = MMStats()
        self._lock = threading.Lock()
        self._image_processor = None
        self._lengths: OrderedDict[str, int] = OrderedDict()   # hash -> placeholder tokens (cache index)
        self._executor = None   # the API server's thread for decoding and processing images
        self.image_token_id = info.image_token_id(self.hf)   # the placeholder token (of an audio clip too)
        self.modality = info.modality

    @property
    def image_processor(self):
        """Built once from the checkpoint; per-request kwargs go to each call, never into this
        construction, so one processor serves every request."""
        with self._lock:
            if self._image_processor is None:
                self._image_processor = self.info.load_processor(self.config.model, self.config.trust_remote_code)
            return self._image_processor

    async def off_loop(self, fn, *args):
        """fn(*args) in this processor's threads, off the event loop (and off the tokenizer's).
        Several: decoding, resizing, normalising and hashing an image release the GIL, and with one
        thread an API server processed one image at a time (~8 HD images/s, which bounded a
        Qwen2.5-VL server's requests/s while its GPU idled). The store and the caches take locks."""
        from concurrent.futures import ThreadPoolExecutor
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max(envs.LOOM_MEDIA_LOADING_THREAD_COUNT or 1, 1),
                                                thread_name_prefix="loom-mm")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            self.store.close()

    # ------------------------------------------------------------ one item

    def item_hash(self, img, kwargs: dict) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([self.model_type, kwargs], sort_keys=True, default=str).encode())
        shape, content = self.info.content_bytes(img)
        h.update(shape.encode())
        h.update(content)
        return h.hexdigest()

    def check_kwargs(self, kwargs) -> dict:
        """A request's mm_processor_kwargs, checked: only the settings that bound an image's size
        (vLLM's Qwen-VL clients send min_pixels / max_pixels), at most the model's own max_pixels,
        which sized the engine's encoder budget. Any other processor setting (a patch size, a
        normalisation) would change what the vision encoder receives."""
        if kwargs is None:
            return {}
        if not isinstance(kwargs, dict):
            raise MediaError("mm_processor_kwargs must be an object")
        accepted = self.info.accepted_kwargs
        out = {}
        for key, value in kwargs.items():
            if key not in accepted:
                raise MediaError(f"mm_processor_kwargs: {key!r} is not accepted for this model"
                                 + (f" (accepted: {', '.join(accepted)})" if accepted else " (it takes none)"))
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < 2 ** 63 \
                    or value != int(value):  # (NaN and inf fail the range)
                raise MediaError(f"mm_processor_kwargs.{key} must be a positive integer")
            out[key] = int(value)
        ceiling = self.max_pixels
        if out.get("max_pixels", 0) > ceiling:
            raise MediaError(f"mm_processor_kwargs.max_pixels may be at most {ceiling} (the model's own)")
        if out.get("min_pixels", 0) > out.get("max_pixels", ceiling):
            raise MediaError("mm_processor_kwargs.min_pixels is above max_pixels")
        return out

    def process_image(self, img, kwargs: dict) -> tuple[int, dict[str, np.ndarray]]:
        """(placeholder tokens, processed arrays) of one image; kwargs as check_kwargs returns them."""
        t0 = time.perf_counter()
        try:
            call_kwargs = self.info.call_kwargs(kwargs, self.image_processor) if kwargs else {}
            out = self.info.run_processor(self.image_processor, img, call_kwargs)
        except Exception as e:
            raise MediaError(f"the {self.modality} processor failed: {e}") from None
        with self._lock:   # (threads of the pool finish together)
            self.stats.processing_secs += time.perf_counter() - t0
            self.stats.processed_items += 1
        arrays = self.info.arrays(out)
        n = self.info.placeholder_tokens(self.hf, arrays)
        if n is None:   # an array the encoder cannot take would fail the engine's step, not this request
            raise MediaError(f"the {self.modality} processor made arrays of shapes "
                             f"{[a.shape for a in arrays.values()]}, which this model's encoder does not take")
        if n > self.config.mm_max_item_tokens:
            raise MediaError(f"the {self.modality} makes {n} tokens; at most {self.config.mm_max_item_tokens} "
                             "are accepted (lower max_pixels)")
        return n, arrays

    def _store_item(self, img, kwargs: dict) -> StoredImage:
        """The image in the store, processed only on a cache miss."""
        key = self.item_hash(img, kwargs)
        with self._lock:
            self.stats.cache_queries += 1
            n = self._lengths.get(key)
        if n is not None:
            addr = self.store.lookup(key)
            if addr is not None:
                with self._lock:
                    self.stats.cache_hits += 1
                return StoredImage(key, n, addr)
        n, arrays = self.process_image(img, kwargs)
        deadline = time.monotonic() + STORE_WAIT_S
        while True:
            try:
                addr = self.store.put(key, arrays)
                break
            except StoreFull as e:
                if "does not fit" in str(e):
                    raise MediaError(str(e)) from None
                if time.monotonic() > deadline:
                    raise StoreBusy(f"{e}: try again later, or raise --mm-processor-cache-gb") from None
                time.sleep(0.01)
        with self._lock:
            self._lengths[key] = n
            self._lengths.move_to_end(key)
            while len(self._lengths) > 65536:
                self._lengths.popitem(last=False)
        return StoredImage(key, n, addr)

    # ------------------------------------------------------------ one prompt

    def check_prompt(self, prompt_ids: list[int], num_images: int) -> None:
        """Before any image is loaded: at most --limit-mm-per-prompt, one placeholder each."""
        if num_images > self.config.mm_limit(self.modality):
            mm_reject(self.config, num_images, self.modality)
        spots = prompt_ids.count(self.image_token_id)
        if spots != num_images:
            raise MediaError(f"the prompt has {spots} {self.modality} placeholder(s) for {num_images} "
                             f"{self.modality} item(s)")

    def store_image(self, image, kwargs: dict) -> StoredImage:
        """One image processed (on a cache miss) and referenced in the store. Blocking (run it off
        the event loop); kwargs as check_kwargs returns them."""
        return self._store_item(self.info.prepare(image, self.config.model), kwargs)

    def expand(self, prompt_ids: list[int], stored: list[StoredImage]) -> tuple[list[int], list[MultiModalItem]]:
        """Each image placeholder token of prompt_ids expanded into its image's tokens."""
        items, ids, prev = [], [], 0
        spots = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        for spot, image in zip(spots, stored, strict=True):
            ids.extend(prompt_ids[prev:spot])
            items.append(MultiModalItem(self.modality, image.hash, len(ids), image.num_tokens, self.store.name,
                                        image.store_addr))
            ids.extend([self.image_token_id] * image.num_tokens)
            prev = spot + 1
        ids.extend(prompt_ids[prev:])
        return ids, items

    def process(self, prompt_ids: list[int], images: list, kwargs: dict | None = None
                ) -> tuple[list[int], list[MultiModalItem]]:
        """The offline path, with decoded images: check, store each, expand. Blocking."""
        kwargs = self.check_kwargs(kwargs)
        self.check_prompt(prompt_ids, len(images))
        stored = []
        try:
            for image in images:
                stored.append(self.store_image(image, kwargs))
        except BaseException:
            self.unref(stored)
            raise
        return self.expand(prompt_ids, stored)

    async def process_urls(self, prompt_ids: list[int], urls: list, kwargs: dict | None, allowed_dir: str | None
                           ) -> tuple[list[int], list[MultiModalItem]]:
        """The API server's path: each image_url loaded (http(s) fetched on the event loop, decoded
        off it), then processed and stored before the next one is loaded, so that one decoded image
        (up to MAX_IMAGE_PIXELS) is held at a time."""
        kwargs = self.check_kwargs(kwargs)
        self.check_prompt(prompt_ids, len(urls))
        stored = []
        num_tokens = len(prompt_ids) - len(urls)   # without the placeholders, which the images replace
        try:
            for url in urls:
                image = await self.info.load_url(url, allowed_dir, self.off_loop, self.config.model)
                stored.append(await self._store_off_loop(image, kwargs))
                del image
                num_tokens += stored[-1].num_tokens
                if num_tokens > self.config.max_model_len:   # no need to load the others
                    raise MediaError(f"the prompt is longer than the model's context ({self.config.max_model_len} "
                                     f"tokens) with {len(stored)} of its {len(urls)} images: {num_tokens} tokens")
        except BaseException:
            self.unref(stored)
            raise
        return self.expand(prompt_ids, stored)

    async def _store_off_loop(self, image, kwargs: dict) -> StoredImage:
        """store_image on the processor's thread. The thread cannot be stopped: when the caller is
        cancelled meanwhile (its client went), the item is still stored and referenced, and that
        reference goes back once it is."""
        job = asyncio.ensure_future(self.off_loop(self.store_image, image, kwargs))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(self._unref_done)
            raise

    def _unref_done(self, job: "asyncio.Future[StoredImage]") -> None:
        if not job.cancelled() and job.exception() is None:
            self.unref([job.result()])

    def addref(self, items: list[MultiModalItem], k: int) -> None:
        """k more references to each item (n > 1 choices: one engine request each)."""
        for it in items:
            for _ in range(k):
                if self.store.lookup(it.hash) != it.store_addr:
                    raise RuntimeError("a referenced store entry went away")

    def unref(self, items: "list[MultiModalItem] | list[StoredImage]") -> None:
        """Give back the store references of a request that never reached the engine."""
        for it in items:
            self.store.unref(it.store_addr)


def make_mm_processor(config: EngineConfig, client_index: int,
                      multimodal_info: Callable[[str], MultiModalInfo | None]) -> MultiModalProcessor | None:
    """The processor and the shared-memory store of one API server (or the offline LLM); None
    for a text-only model or --language-model-only. multimodal_info: model directory -> the
    model's declaration (workers.models.registry.multimodal_info), asked only for a model that
    takes images."""
    if not config.mm_encoder_budget:
        return None
    info = multimodal_info(config.model)
    from shm.object_store import segment_name
    tp = config.tensor_parallel_size
    store = ObjectStoreWriter(segment_name(client_index), int(config.mm_processor_cache_gb * (1 << 30)),
                              n_readers=config.data_parallel_size * tp, readers_per_request=tp)
    return MultiModalProcessor(config, store, info)


def mm_reject(config: EngineConfig, num_images: int, modality: str = "image"):
    """Raise the MediaError for more items than --limit-mm-per-prompt (or any, for a text-only
    model or one of another modality)."""
    limit = config.mm_limit(modality)
    noun = "images" if modality == "image" else modality
    if limit == 0:
        why = (" (it was started with --language-model-only)" if config.language_model_only else
               " (it is text-only)" if not config.mm_encoder_budget else "")
        raise MediaError(f"this model does not take {noun}" + why)
    raise MediaError(f"At most {limit} {modality}(s) may be provided in one prompt; got {num_images}.")
