"""Images over HTTP: a real `loom serve` of a tiny Qwen2.5-VL and the official openai client.
One server for the module; every bad input gets OpenAI's 400 and the server keeps serving."""
from __future__ import annotations

import base64
import http.server
import io
import os
import threading
import time

import openai
import pytest
import requests

from tests.conftest import own_run_id
from tests.tiny_vl_models import hf_qwen_vl_greedy, make_tiny_qwen2_5_vl, random_image

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
RUN_ID = own_run_id()


def png_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(*urls: str, text: str = "Describe it.") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl_api")))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    random_image(30, 70, 70).save(d / "ok.png")
    return d


@pytest.fixture(scope="module")
def server(vl_dir, media_dir):
    from tests.conftest import Server
    s = Server(vl_dir, "--max-model-len", "512", "--max-num-seqs", "4", "--limit-mm-per-prompt.image", "2",
               "--allowed-local-media-path", str(media_dir / ""), "--mm-processor-cache-gb", "0.006",   # 6 MB: ~4 large images
               env={"LOOM_RUN_ID": RUN_ID})
    try:
        yield s.wait_healthy()
    finally:
        s.stop()
        assert not [n for n in os.listdir("/dev/shm") if RUN_ID in n], "segments left after SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          temperature=0, max_tokens=8, **kw)


def test_image_chat_matches_hf_and_streaming_equals_non_streaming(client, vl_dir):
    img = random_image(31, 100, 90)
    messages = image_message(png_url(img))
    full = chat(client, messages)
    stream = chat(client, messages, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    prompt = f"<|im_start|>user\n{IMG}Describe it.<|im_end|>\n<|im_start|>assistant\n"
    ids, ref = hf_qwen_vl_greedy(vl_dir, prompt, [img], 8)
    assert full.usage.prompt_tokens == len(ids)
    from transformers import AutoTokenizer
    assert full.choices[0].message.content == AutoTokenizer.from_pretrained(vl_dir).decode(ref, skip_special_tokens=True)


def test_a_large_image_with_a_short_text_takes_the_small_lane(client, server):
    # the chat template sees an image as one placeholder: a request of a 300 KB image and a short
    # text renders in the API server's small lane, with no tokenizer process to start (its start
    # held a VL benchmark's first requests for ~10 s on the H200)
    from tests.conftest import child_pids, is_tokenizer_process, serve_processes
    url = png_url(random_image(32, 320, 320))
    assert len(url) > 4 * 65536
    api = serve_processes(server)["api_server"]
    assert not any(is_tokenizer_process(k) for k in child_pids(api))
    assert chat(client, image_message(url)).usage.completion_tokens > 0
    assert not any(is_tokenizer_process(k) for k in child_pids(api))
    # a long text with it still goes to the tokenizer process (the lane is by the text's size)
    with pytest.raises(openai.BadRequestError, match="context"):   # (longer than --max-model-len)
        chat(client, image_message(url, text="Describe it. " * 6000))
    assert any(is_tokenizer_process(k) for k in child_pids(api))


def test_two_images_jpeg_webp_and_local_file(client, media_dir):
    out = chat(client, image_message(png_url(random_image(32, 60, 60), "JPEG"),
                                     png_url(random_image(33, 80, 60), "WEBP")))
    assert out.choices[0].finish_reason in ("stop", "length")
    out = chat(client, image_message(f"file://{media_dir}/ok.png"))
    assert out.usage.prompt_tokens > 10


def test_http_image_is_fetched(client):
    img_bytes = io.BytesIO()
    random_image(34, 56, 56).save(img_bytes, format="PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            data = img_bytes.getvalue()   # in two pieces: the fetch once kept only the first
            self.wfile.write(data[:100])
            self.wfile.flush()
            time.sleep(0.2)
            self.wfile.write(data[100:])

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/img.png"
        by_http = chat(client, image_message(url))
        by_data = chat(client, image_message(png_url(random_image(34, 56, 56))))
        assert by_http.choices[0].message.content == by_data.choices[0].message.content
    finally:
        httpd.shutdown()


def test_images_of_a_request_refused_for_its_header_go_back_to_the_store(client):
    """A bad X-data-parallel-rank is a 400 after the images were stored: they are released. The
    6 MB store holds about 4 of these images (1.5 MB each once processed), so a request after
    6 refused ones once met a store full of their images (503, for good)."""
    for seed in range(6):
        with pytest.raises(openai.BadRequestError, match="X-data-parallel-rank"):
            chat(client, image_message(png_url(random_image(60 + seed, 588, 588))),
                 extra_headers={"X-data-parallel-rank": "x"})
    assert chat(client, image_message(png_url(random_image(59, 588, 588)))).choices[0].finish_reason == "length"


def test_mm_processor_kwargs_max_pixels(server):
    img = png_url(random_image(35, 224, 224))
    model = requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": image_message(img), "max_tokens": 2, "temperature": 0}
    big = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    small = requests.post(server.url + "/v1/chat/completions",
                          json={**body, "mm_processor_kwargs": {"max_pixels": 28 * 28 * 4}}, timeout=60).json()
    assert small["usage"]["prompt_tokens"] < big["usage"]["prompt_tokens"]


@pytest.mark.parametrize("kwargs,needle", [
    ({"temporal_patch_size": 1}, "'temporal_patch_size' is not accepted"),  # killed the engine once
    ({"patch_size": 28}, "'patch_size' is not accepted"),
    ({"min_pixels": 10 ** 9}, "min_pixels is above max_pixels"),           # upscaled to OOM once
    ({"max_pixels": 10 ** 10}, "at most"),
    ({"max_pixels": "many"}, "positive integer"),
    ([1, 2], "mm_processor_kwargs"),
])
def test_bad_mm_processor_kwargs_are_400_and_the_server_keeps_serving(client, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, image_message(png_url(random_image(39, 56, 56))), extra_body={"mm_processor_kwargs": kwargs})
    assert needle in e.value.body["message"]
    assert chat(client, image_message(png_url(random_image(36, 56, 56)))).choices


def _oversized_png() -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("1", (9000, 8000)).save(buf, format="PNG")   # 72M pixels, a few kB
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("url,needle", [
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "not a PNG"),
    ("data:image/png;base64,@@@not-base64@@@", "base64"),
    ("ftp://example.com/cat.png", "scheme"),
    ("file:///etc/passwd", "outside"),
    ("oversized", "pixels"),
    ("fifo", "not a regular file"),  # opening it would block the image thread until a writer came
    ("file:///nul%00.png", "NUL"),
    ("host", "local path"),   # file://HOST/path: another machine's file (the host was ignored)
])
def test_bad_images_are_400_and_the_server_keeps_serving(client, media_dir, url, needle):
    if url == "oversized":
        url = _oversized_png()
    if url == "host":
        url = f"file://example.com{media_dir}/ok.png"
    if url == "fifo":
        if not (media_dir / "fifo").exists():
            os.mkfifo(media_dir / "fifo")
        url = f"file://{media_dir}/fifo"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, image_message(url))
    assert e.value.status_code == 400
    assert needle in e.value.body["message"] and e.value.body["type"] == "BadRequestError"
    assert chat(client, image_message(png_url(random_image(36, 56, 56)))).choices


def test_more_images_than_the_limit(client, server):
    url = png_url(random_image(37, 56, 56))
    with pytest.raises(openai.BadRequestError, match="At most 2 image"):
        chat(client, image_message(url, url, url))
    # /tokenize of the same messages too (it answered 200)
    r = requests.post(server.url + "/tokenize", timeout=30, json={"messages": image_message(url, url, url)})
    assert r.status_code == 400 and "At most 2 image" in r.json()["error"]["message"], r.text
    assert requests.post(server.url + "/tokenize", timeout=30,
                         json={"messages": image_message(url, url)}).status_code == 200


def test_mm_cache_metrics(client, server):
    url = png_url(random_image(38, 64, 64))
    chat(client, image_message(url))
    chat(client, image_message(url))
    text = requests.get(server.url + "/metrics", timeout=10).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:mm_cache_")}
    assert values["vllm:mm_cache_queries_total"] >= 2 and values["vllm:mm_cache_hits_total"] >= 1


def test_bench_serve_random_mm(server, tmp_path):
    """`loom bench serve --dataset-name random-mm`: chat requests with random images, all served."""
    import json
    import subprocess
    import sys
    out = tmp_path / "mm.json"
    r = subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", "bench", "serve", "--base-url", server.url,
                        "--dataset-name", "random-mm", "--num-prompts", "3", "--random-input-len", "16",
                        "--random-output-len", "4", "--random-mm-base-items-per-request", "2",
                        "--random-mm-bucket-config", "{(56, 56, 1): 0.5, (84, 112, 1): 0.5}",
                        "--result-file", str(out), "--disable-tqdm"],
                       cwd=os.path.dirname(os.path.dirname(__file__)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["endpoint"] == "/v1/chat/completions"
    assert min(result["input_lens"]) > 16   # the images' tokens count in the prompt


def test_random_mm_texts_hold_the_input_length_in_tokens(server):
    """random-mm's texts encode to --random-input-len tokens, as vLLM's: random ids (byte tokens
    here, which decode to broken UTF-8 that re-encodes longer) are decoded, re-encoded and cut
    or padded until they do."""
    import asyncio
    import random

    from bench.random_mm import texts_of_length
    model = requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    async def call(path, payload):
        return requests.post(server.url + path, json={"model": model, **payload}, timeout=30).json()

    def length(text):
        return len(asyncio.run(call("/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"])

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (16, 40, 7)]   # (0-2: special tokens)
    raw = [asyncio.run(call("/detokenize", {"tokens": p}))["prompt"] for p in prompts]
    assert all(length(t) > len(p) + 2 for t, p in zip(raw, prompts))   # decoded once, the texts run long
    # as vLLM's, a text whose cut lands inside a character of several tokens may stay a token or two off
    got = [length(t) for t in asyncio.run(texts_of_length(call, prompts))]
    assert got[:2] == [16, 40] and abs(got[2] - 7) <= 2, got


def test_images_past_the_context_stop_loading_at_once(vl_dir):
    """A chat whose first image already makes the prompt longer than the context fails there:
    the other images are not fetched, decoded and processed (16 large ones took 30 s of the
    image thread before the 400)."""
    import asyncio
    from ipc.config import EngineConfig
    from multimodal.media import MediaError
    from multimodal.processor import make_mm_processor
    from workers.models.registry import multimodal_info
    config = EngineConfig(model=vl_dir, max_model_len=64, mm_processor_cache_gb=0.01).resolve(multimodal_info)
    mm = make_mm_processor(config, 7, multimodal_info)
    try:
        prompt = [mm.image_token_id] * 3 + [11, 12]
        urls = [png_url(random_image(70, 588, 588))] + ["data:image/png;base64,not-an-image"] * 2
        with pytest.raises(MediaError, match="with 1 of its 3 images"):   # (not "cannot be decoded")
            asyncio.run(mm.process_urls(prompt, urls, None, None))
    finally:
        mm.close()


def test_a_request_cancelled_while_its_image_is_stored_gives_the_reference_back(vl_dir):
    """The client goes while the image thread processes its image (aiohttp cancels the handler):
    the thread still stores it and takes a reference, which must come back once it is done.
    A leaked one pins its entry, and once the ring wraps to it every new image is a 503."""
    import asyncio
    import threading
    from ipc.config import EngineConfig
    from multimodal.processor import make_mm_processor
    from workers.models.registry import multimodal_info
    config = EngineConfig(model=vl_dir, max_model_len=512, mm_processor_cache_gb=0.01).resolve(multimodal_info)
    mm = make_mm_processor(config, 8, multimodal_info)
    started, release = threading.Event(), threading.Event()
    store_image = mm.store_image

    def slow_store_image(image, kwargs):   # the real work, held until the request is cancelled
        started.set()
        release.wait(30)
        return store_image(image, kwargs)

    mm.store_image = slow_store_image

    async def cancel_midway():
        task = asyncio.ensure_future(mm.process_urls([mm.image_token_id, 11], [png_url(random_image(71, 56, 56))],
                                                     None, None))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(500):   # the thread finishes, then the reference goes back on the loop
            await asyncio.sleep(0.01)
            if mm.store.num_entries() == 1 and mm.store.num_in_use() == 0:
                return True
        return False

    try:
        assert asyncio.run(cancel_midway()), "the cancelled request's store reference was not given back"
    finally:
        mm.close()


def test_image_decoding_as_transformers_and_vllm():
    """Transparency is composited onto white (convert("RGB") made it black, so a model saw another
    picture than transformers' processor does); "DATA:" is a data URL (schemes are
    case-insensitive); an image past PIL's own bomb limit is refused for its size."""
    import base64
    import io

    from PIL import Image

    from multimodal.media import MediaError, as_image, decode_image, load_data_url

    def encoded(img, fmt="PNG") -> bytes:
        buf = io.BytesIO()
        img.save(buf, format=fmt)
        return buf.getvalue()
    clear = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    clear.putpixel((1, 1), (30, 60, 220, 255))
    for img in (decode_image(encoded(clear)), decode_image(encoded(clear.convert("LA"))), as_image(clear)):
        assert img.mode == "RGB" and img.getpixel((0, 0)) == (255, 255, 255)
    assert decode_image(encoded(clear)).getpixel((1, 1)) == (30, 60, 220)
    url = "DATA:IMAGE/PNG;BASE64," + base64.b64encode(encoded(clear)).decode()
    assert load_data_url(url).getpixel((0, 0)) == (255, 255, 255)
    with pytest.raises(MediaError, match="pixels"):
        decode_image(encoded(Image.new("1", (20000, 20000))))


def test_anthropic_and_responses_images_are_the_chat_images(client, server, media_dir):
    """/v1/messages image blocks (base64 and URL) and /v1/responses input_image parts go through
    the chat's image path: the same answer and prompt tokens as the chat request; the token
    count counts the image's tokens."""
    import anthropic
    img = random_image(33, 80, 60)
    url = png_url(img)
    full = chat(client, image_message(url))
    data = url.split(",", 1)[1]
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
              {"type": "text", "text": "Describe it."}]
    m = claude.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": blocks}],
                               extra_body={"temperature": 0})
    assert m.content[0].text == full.choices[0].message.content
    assert m.usage.input_tokens == full.usage.prompt_tokens
    counted = claude.messages.count_tokens(model=model, messages=[{"role": "user", "content": blocks}])
    assert counted.input_tokens == full.usage.prompt_tokens
    local = f"file://{media_dir}/ok.png"
    by_url = claude.messages.create(model=model, max_tokens=8, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": local}},
                                     {"type": "text", "text": "Describe it."}]}])
    assert by_url.content[0].text == chat(client, image_message(local)).choices[0].message.content
    r = client.responses.create(model=model, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                     {"type": "input_text", "text": "Describe it."}]}])
    assert r.output_text == full.choices[0].message.content and r.usage.input_tokens == full.usage.prompt_tokens


def test_audio_to_a_vision_model_is_400(client):
    part = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    with pytest.raises(openai.BadRequestError, match="does not take audio"):
        chat(client, [{"role": "user", "content": [part, {"type": "text", "text": "x"}]}])
