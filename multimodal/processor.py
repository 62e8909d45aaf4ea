"""Images -> what the engine and the workers need: the model's Hugging Face image processor
(run off the event loop by the API server), placeholder tokens expanded in the prompt (their
count from the processed arrays), a content hash per item (pixels + processor kwargs), and
the processed tensors in the shared-memory store (an item already there is only referenced:
the store is the processor-output cache).

transformers 5 cannot build AutoProcessor for Qwen2.5-VL without torchvision (it also makes a
video processor), so the image processor and the tokenizer are used directly; the prompt
expansion is the processor's own rule (grid t*h*w / merge^2 copies of the image token)."""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ipc.config import EngineConfig
from ipc.messages import MultiModalItem
from multimodal.media import MediaError, as_image
from multimodal.registry import LLAVA_TYPES, QWEN_VL_TYPES, llava_image_tokens
from shm.object_store import ObjectStoreWriter, StoreFull

STORE_WAIT_S = 10.0   # a full store frees as running requests finish


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
    def __init__(self, config: EngineConfig, store: ObjectStoreWriter | None):
        with open(f"{config.model}/config.json") as f:
            self.hf = json.load(f)
        self.config = config
        self.model_type = self.hf.get("model_type")
        self.store = store
        self.stats = MMStats()
        self._lock = threading.Lock()
        self._image_processor = None
        self._lengths: OrderedDict[str, int] = OrderedDict()   # hash -> placeholder tokens (cache index)
        self._executor = None   # the API server's thread for decoding and processing images
        if self.model_type in QWEN_VL_TYPES:
            self.image_token_id = int(self.hf["image_token_id"])
        elif self.model_type in LLAVA_TYPES:
            self.image_token_id = int(self.hf.get("image_token_index", self.hf.get("image_token_id", 32000)))
        else:
            self.image_token_id = None

    @property
    def image_processor(self):
        """Built once from the checkpoint; per-request kwargs go to each call, never into this
        construction, so one processor serves every request."""
        with self._lock:
            if self._image_processor is None:
                from transformers import AutoImageProcessor
                self._image_processor = AutoImageProcessor.from_pretrained(self.config.model)
            return self._image_processor

    async def off_loop(self, fn, *args):
        """fn(*args) in this processor's own thread, off the event loop (and off the tokenizer's)."""
        import asyncio
        from concurrent.futures import ThreadPoolExecutor
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="loom-mm")
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
        h.update(f"{img.mode}:{img.size}".encode())
        h.update(img.tobytes())
        return h.hexdigest()

    def process_image(self, img, kwargs: dict) -> tuple[int, dict[str, np.ndarray]]:
        """(placeholder tokens, processed arrays) of one image."""
        t0 = time.perf_counter()
        try:
            out = self.image_processor(images=[img], return_tensors="np", **self._call_kwargs(kwargs))
        except Exception as e:
            raise MediaError(f"the image processor failed: {e}") from None
        self.stats.processing_secs += time.perf_counter() - t0
        self.stats.processed_items += 1
        if self.model_type in QWEN_VL_TYPES:
            grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(3)
            merge = int(getattr(self.image_processor, "merge_size", 2))
            arrays = {"pixel_values": np.ascontiguousarray(out["pixel_values"], dtype=np.float32),
                      "image_grid_thw": grid}
            n = int(grid.prod()) // (merge * merge)
        else:
            arrays = {"pixel_values": np.ascontiguousarray(out["pixel_values"], dtype=np.float32)}
            n = llava_image_tokens(self.hf)
        if n > self.config.mm_max_item_tokens:
            raise MediaError(f"the image makes {n} tokens; at most {self.config.mm_max_item_tokens} "
                             "are accepted (lower max_pixels)")
        return n, arrays

    def _call_kwargs(self, kwargs: dict) -> dict:
        """A request's mm_processor_kwargs as the processor call takes them. vLLM's clients bound a
        Qwen-VL image by min_pixels / max_pixels; transformers 5 deprecates those in the call and
        reads them from size = {"shortest_edge": min, "longest_edge": max}."""
        if self.model_type not in QWEN_VL_TYPES or not ({"min_pixels", "max_pixels"} & kwargs.keys()):
            return kwargs
        kwargs = dict(kwargs)
        size = dict(kwargs.pop("size", None) or self.image_processor.size)
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if kwargs.get(key) is not None:
                size[edge] = kwargs[key]
            kwargs.pop(key, None)
        return {**kwargs, "size": size}

    def _store_item(self, img, kwargs: dict) -> tuple[str, int, int]:
        """(hash, placeholder tokens, store address), processing only on a cache miss."""
        key = self.item_hash(img, kwargs)
        self.stats.cache_queries += 1
        with self._lock:
            n = self._lengths.get(key)
        if n is not None:
            addr = self.store.lookup(key)
            if addr is not None:
                self.stats.cache_hits += 1
                return key, n, addr
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
        return key, n, addr

    # ------------------------------------------------------------ one prompt

    def process(self, prompt_ids: list[int], images: list, kwargs: dict | None = None
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand each image placeholder token of prompt_ids into the image's tokens and store
        the images. Blocking (run it off the event loop)."""
        kwargs = dict(kwargs or {})
        if len(images) > self.config.mm_limit("image"):
            mm_reject(self.config, len(images))
        spots = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if len(spots) != len(images):
            raise MediaError(f"the prompt has {len(spots)} image placeholder(s) for {len(images)} image(s)")
        items, ids, prev = [], [], 0
        try:
            for spot, image in zip(spots, images):
                key, n, addr = self._store_item(as_image(image), kwargs)
                ids.extend(prompt_ids[prev:spot])
                items.append(MultiModalItem("image", key, len(ids), n, self.store.name, addr))
                ids.extend([self.image_token_id] * n)
                prev = spot + 1
        except BaseException:
            self.unref(items)
            raise
        ids.extend(prompt_ids[prev:])
        return ids, items

    def addref(self, items: list[MultiModalItem], k: int) -> None:
        """k more references to each item (n > 1 choices: one engine request each)."""
        for it in items:
            for _ in range(k):
                if self.store.lookup(it.hash) != it.store_addr:
                    raise RuntimeError("a referenced store entry went away")

    def unref(self, items: list[MultiModalItem]) -> None:
        """Give back the store references of a request that never reached the engine."""
        for it in items:
            self.store.unref(it.store_addr)


def make_mm_processor(config: EngineConfig, client_index: int) -> MultiModalProcessor | None:
    """The processor and the shared-memory store of one API server (or the offline LLM); None
    for a text-only model or --language-model-only."""
    if not config.mm_encoder_budget:
        return None
    from shm.object_store import segment_name
    store = ObjectStoreWriter(segment_name(client_index), int(config.mm_processor_cache_gb * (1 << 30)),
                              n_readers=config.tensor_parallel_size)
    return MultiModalProcessor(config, store)


def mm_reject(config: EngineConfig, num_images: int):
    """Raise the MediaError for more images than --limit-mm-per-prompt (or any, for a text-only
    model)."""
    limit = config.mm_limit("image")
    if limit == 0:
        why = (" (it was started with --language-model-only)" if config.language_model_only else
               " (it is text-only)")
        raise MediaError("this model does not take images" + why)
    raise MediaError(f"At most {limit} image(s) may be provided in one prompt; got {num_images}.")
