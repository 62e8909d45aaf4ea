"""Issue 49 item 7, serving overhead: the stream's chunk bytes made from a prebuilt frame are the
bytes of the plain encoding, and `loom bench serve` finds this host's API-server processes and
their CPU time (bench/server_cpu.py)."""
import os
import socket
import time

import msgspec
import pytest

from bench import server_cpu
from frontend.openai.protocol import ChunkFrame, chat_chunk, chat_chunk_choice, completion_choice, \
    completion_chunk, sse, usage


@pytest.mark.parametrize("usage_", [None, usage(7, 3), usage(7, 3, 2)])
def test_chunk_frame_bytes_equal_plain_encoding(usage_):
    rid, model = 'cmpl-"x\\y', "m\u00e9/\u4e2d"
    choices = [completion_choice(0, "a\n\"b\" \u00e9", None), completion_choice(1, "", "stop", "</s>")]
    frame = ChunkFrame(rid, "text_completion", 1700000000, model)
    assert frame.sse(choices, usage_) == sse(completion_chunk(rid, 1700000000, model, choices, usage_))
    assert frame.sse([], usage_) == sse(completion_chunk(rid, 1700000000, model, [], usage_))
    chat = [chat_chunk_choice(0, {"content": "hi"}, "length", None)]
    frame = ChunkFrame(rid, "chat.completion.chunk", 5, model)
    assert frame.sse(chat, usage_) == sse(chat_chunk(rid, 5, model, chat, usage_))



@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("options", [{}, {"n": 2}, {"logprobs": 1}, {"return_token_ids": True},
                                     {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                                     {"echo": True}])
def test_stream_events_equal_the_plain_encoding_of_their_choices(chat, options):
    """completion_events / chat_events (a text-only chunk spliced into its choice's template) give the
    bytes of each choice dict of completion_delta / chat_delta encoded as its own chunk, for a
    stream's first, middle (text, empty text) and last outputs."""
    from frontend.openai.protocol import ChatCompletionRequest, CompletionRequest, build_sampling_params, \
        stream_usage
    from frontend.openai.serving import GenerationContext, Prompt
    from frontend.outputs import CompletionOutput, Logprob, RequestOutput
    from ipc.validation import Limits

    if chat and "echo" in options:
        options = {"echo": True, "messages": [{"role": "user", "content": "x"}]}
    body = {"model": "m", "stream": True, **options}
    body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": [1, 2, 3]})
    if chat and "logprobs" in options:
        body.update(logprobs=True, top_logprobs=1)
    req = msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest if chat else CompletionRequest)
    params = build_sampling_params(req, chat=chat, limits=Limits(1000, 1024))
    steps = [(" a\u00e9\"", None), ("", None), (" b</", None), ("c", "length")]

    def contexts():
        include, continuous = stream_usage(req)
        return [GenerationContext(request=None, req=req, chat=chat, rid="cmpl-\"x", created=5, model="m/\u4e2d",
                                  params=params, prompts=[Prompt(None, [1, 2, 3])], include_usage=include,
                                  continuous_usage=continuous, echo_texts=["x y z"], decode=str)
                for _ in range(2)]

    def output(j, text, finish):
        lp = [{7 + j: Logprob(-0.5, 1, text)}] if params.logprobs is not None else None
        return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(i, text, [7 + j], finish, None, lp)
                                                   for i in range(params.n)])

    fast, plain = contexts()
    for j, (text, finish) in enumerate(steps):
        item = (0, output(j, text, finish))
        if chat:
            want = [plain.chat_chunk([c], plain.usage(k) if plain.continuous_usage else None)
                    for k, c, _ in plain.chat_delta(item[1])]
            got = fast.chat_events((0, output(j, text, finish)))
        else:
            want = [plain.completion_chunk([c], plain.usage(k) if plain.continuous_usage else None)
                    for k, c, _ in plain.completion_delta(0, item[1])]
            got = fast.completion_events((0, output(j, text, finish)))
        assert got == b"".join(want)
    assert fast.usage() == plain.usage()
    assert [c.text for c in fast.choices] == [c.text for c in plain.choices]


def test_server_cpu_finds_the_listening_process_and_its_cpu():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        port = s.getsockname()[1]
        pids = server_cpu.api_server_pids(f"http://127.0.0.1:{port}")
        assert pids == [os.getpid()]
        before = server_cpu.cpu_seconds(pids)
        end = time.process_time() + 0.3
        while time.process_time() < end:   # burn CPU in this (the "server") process
            pass
        assert server_cpu.cpu_seconds(pids) - before >= 0.2
    finally:
        s.close()
    assert server_cpu.api_server_pids(f"http://127.0.0.1:{port}") == []
    assert server_cpu.api_server_pids("http://example.invalid:8000") == []


def test_images_of_many_requests_are_processed_at_once_and_stored_as_one_at_a_time(tmp_path, monkeypatch):
    """Issue 49 item 6: an API server's image work runs on LOOM_MEDIA_LOADING_THREAD_COUNT threads
    (one thread held a Qwen2.5-VL server at ~8 images/s). Requests processed together (two of them
    the same image) store what one at a time stores: the same hashes, token counts and arrays."""
    import asyncio
    import threading

    import numpy as np

    from ipc.config import EngineConfig
    from multimodal.processor import make_mm_processor
    from shm.object_store import ObjectStoreReader
    from tests.test_multimodal_api import png_url
    from tests.tiny_vl_models import make_tiny_qwen2_5_vl, random_image
    from workers.models.registry import multimodal_info

    vl_dir = make_tiny_qwen2_5_vl(str(tmp_path / "vl"))
    urls = [png_url(random_image(80 + i % 5, 56 + 28 * (i % 3), 84)) for i in range(6)]

    def run(threads: int):
        monkeypatch.setenv("LOOM_MEDIA_LOADING_THREAD_COUNT", str(threads))
        config = EngineConfig(model=vl_dir, max_model_len=512, mm_processor_cache_gb=0.01).resolve(multimodal_info)
        mm = make_mm_processor(config, 60 + threads, multimodal_info)
        seen = set()
        process_image = mm.process_image

        def spy(img, kwargs):
            seen.add(threading.current_thread().name)
            return process_image(img, kwargs)

        mm.process_image = spy

        async def all_requests():
            return await asyncio.gather(*(mm.process_urls([mm.image_token_id, 11], [u], None, None) for u in urls))

        try:
            out = asyncio.run(all_requests())
            reader = ObjectStoreReader(0)
            arrays = [{k: np.array(v) for k, v in reader.get(it.store_name, it.store_addr).items()}
                      for _, items in out for it in items]
            reader.close()
            return [(ids, [(it.hash, it.length) for it in items]) for ids, items in out], arrays, seen
        finally:
            mm.close()

    one, one_arrays, one_threads = run(1)
    many, many_arrays, many_threads = run(4)
    assert len(one_threads) == 1 and len(many_threads) >= 1
    assert many == one
    for a, b in zip(one_arrays, many_arrays):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("pushed", [False, True])
@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_gathers_tokens_into_fewer_deltas(tiny_model_dir, interval, pushed):
    """--stream-interval N: the consumer is woken (or the sink handed an output) with the first token,
    then once N tokens wait, and at the end; the text and ids are the same as token by token."""
    import asyncio

    from transformers import AutoTokenizer

    from frontend.async_llm import _Collector, _merge
    from frontend.detokenizer import TokenTexts
    from frontend.output_processor import RequestState
    from ipc.messages import EngineCoreOutput
    from ipc.sampling_params import SamplingParams
    from metrics.request_metrics import RequestMetrics

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("the quick brown fox jumps over the lazy dog again and again", add_special_tokens=False)[:11]
    params = SamplingParams(max_tokens=len(ids))

    async def stream() -> list[tuple[str, list[int]]]:
        st = RequestState("r", 0, [1, 2, 3], params, tok, TokenTexts(tok))
        req = _Collector("r", [1, 2, 3], {"r": st}, {"r": RequestMetrics(None, 3, params, 0.0, True)},
                         interval=interval)
        got = []

        async def consume():
            while True:
                merged = _merge(await req.take())[0]
                got.append((merged.text, list(merged.token_ids)))
                if merged.finish_reason is not None:
                    return

        async def pushed_to():   # the sink takes every output; the consumer wakes at the end
            while await req.take():
                pass

        if pushed:
            req.sink = lambda out: got.append((out.outputs[0].text, list(out.outputs[0].token_ids))) or True
        task = asyncio.ensure_future(pushed_to() if pushed else consume())
        for j, t in enumerate(ids):   # one engine step per token, the consumer runs in between
            last = j == len(ids) - 1
            req.process(EngineCoreOutput("r", [t], "length" if last else None), 0.0)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.wait_for(task, 5)
        return got

    got = asyncio.run(stream())
    assert "".join(t for t, _ in got) == tok.decode(ids)
    assert [i for _, ii in got for i in ii] == ids
    sizes = [len(ii) for _, ii in got]
    if interval == 1:
        assert sizes == [1] * len(ids)
    else:   # 11 tokens: the first alone, then 4, 4, and the last 2 at the end
        assert sizes == [1, 4, 4, 2]



@pytest.mark.parametrize("refuse", ["never", "some", "error"])
def test_pushed_outputs_are_the_taken_ones(tiny_model_dir, refuse):
    """RequestStream.push: a sink gets each step's output in the step's own turn (n=2: both choices
    in one output); what it refuses (a full socket) the consumer takes, in order, and the consumer
    is woken for the end; an exception in the sink is the consumer's to raise."""
    import asyncio

    from transformers import AutoTokenizer

    from frontend.async_llm import RequestStream, _Collector
    from frontend.detokenizer import TokenTexts
    from frontend.output_processor import RequestState
    from ipc.messages import EngineCoreOutput
    from ipc.sampling_params import SamplingParams
    from metrics.request_metrics import RequestMetrics

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("the quick brown fox jumps over the lazy dog again and again", add_special_tokens=False)[:9]
    params = SamplingParams(max_tokens=len(ids), n=2)

    async def run():
        rids = ("r-0", "r-1")
        states = {rid: RequestState(rid, i, [1, 2, 3], params, tok, TokenTexts(tok)) for i, rid in enumerate(rids)}
        rms = {rid: RequestMetrics(None, 3, params, 0.0, i == 0) for i, rid in enumerate(rids)}
        ready = []
        req = _Collector("r", [1, 2, 3], states, rms, ready=ready)
        stream = RequestStream()
        stream.collector = req
        got, calls = [], [0]

        def sink(out) -> bool:
            calls[0] += 1
            if refuse == "error" and calls[0] == 3:
                raise RuntimeError("the client's socket broke")
            if refuse == "some" and calls[0] % 3 == 0:
                return False
            got.append(("pushed", out))
            return True

        async def consume():   # as AsyncLLM._generate does
            while req.unfinished:
                deltas = await req.take()
                if deltas:
                    got.append(("taken", req.output(deltas)))

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)
        assert stream.push(sink)
        for j, t in enumerate(ids):   # one engine step per token: both choices, then the hand-over
            last = j == len(ids) - 1
            for rid in rids:
                req.process(EngineCoreOutput(rid, [t], "length" if last else None), 0.0)
            for r in ready:
                r.hand_over()
            ready.clear()
            await asyncio.sleep(0)
        await asyncio.wait_for(task, 5)
        return got

    if refuse == "error":
        with pytest.raises(RuntimeError, match="socket broke"):
            asyncio.run(run())
        return
    got = asyncio.run(run())
    kinds = [k for k, _ in got]
    assert kinds.count("pushed") == (len(ids) if refuse == "never" else len(ids) - len(ids) // 3)
    assert "taken" in kinds if refuse == "some" else "taken" not in kinds
    for index in (0, 1):
        outs = [c for _, o in got for c in o.outputs if c.index == index]
        assert "".join(c.text for c in outs) == tok.decode(ids)
        assert [i for c in outs for i in c.token_ids] == ids
        assert [c.finish_reason for c in outs][-1] == "length"
    assert all(len(o.outputs) == 2 for _, o in got)   # one output per step, both choices in it
    assert got[-1][1].finished and not any(o.finished for _, o in got[:-1])


def test_api_server_process_computes_media_on_one_intra_op_thread():
    """An API server's torch runs one intra-op thread (its media threads are the parallelism: with one
    OpenMP team per core, a log-mel beside busy processes took 12x the CPU and 17x the time), unless OMP_NUM_THREADS
    says otherwise: as the process starts, before torch is imported."""
    import subprocess
    import sys
    code = ("from frontend.openai.api_server_proc import one_intra_op_thread; one_intra_op_thread(); "
            "import torch; print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run = lambda env: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,  # noqa: E731
                                     check=True).stdout.split()[-1]
    assert run(env) == "1"
    assert run(dict(env, OMP_NUM_THREADS="2")) == "2"


def test_a_client_that_reads_late_gets_every_pushed_and_refused_chunk_in_order(tiny_model_dir, monkeypatch,
                                                                               tmp_path):
    """A real AsyncLLM stream (the engine's outputs handed to _on_outputs one step at a time) through
    pump_sse to a client that reads nothing for a while, on small socket buffers: the writer refuses
    once the connection's buffer is over its high-water mark, the handler's task writes those
    chunks and waits for the connection, then pushing resumes; the client gets every token's text,
    in order, then the usage and [DONE]."""
    import asyncio
    import json

    from aiohttp import web

    from frontend.async_llm import AsyncLLM
    from frontend.openai import serving
    from frontend.openai.protocol import CompletionRequest, build_sampling_params, stream_usage
    from frontend.openai.serving import GenerationContext, Prompt, first_output, merged, pump_sse, sse_response
    from ipc.config import EngineConfig
    from ipc.messages import EngineCoreOutput, EngineCoreOutputs
    from ipc.validation import Limits

    n_tokens = 400
    refused = []
    push = serving.SSEResponse.push

    def counting_push(self, emit, item):
        ok = push(self, emit, item)
        refused.append(not ok)
        return ok

    monkeypatch.setattr(serving.SSEResponse, "push", counting_push)

    async def scenario():
        llm = AsyncLLM(EngineConfig(model=tiny_model_dir), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")

        async def add_request(ecr, engine=None):   # no engine: this test hands the outputs over itself
            pass

        llm.client.add_request = add_request
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": n_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        req = msgspec.json.decode(msgspec.json.encode(body), type=CompletionRequest)
        params = build_sampling_params(req, chat=False, limits=Limits(1000, 4096))
        vocab = llm.tokenizer.vocab_size
        tokens = [(7 * j + 5) % (vocab - 10) + 5 for j in range(n_tokens)]

        async def handler(request):
            include, continuous = stream_usage(req)
            ctx = GenerationContext(request=request, req=req, chat=False, rid="cmpl-x", created=1, model="m",
                                    params=params, prompts=[Prompt(None, [1, 2, 3])], include_usage=include,
                                    continuous_usage=continuous)
            stream = merged([llm.generate([1, 2, 3], params, "r0")])
            try:
                first = await first_output(stream)
                resp = await sse_response(request)
                sock = request.transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                request.transport.set_write_buffer_limits(high=512)
                return await pump_sse(resp, stream, first, ctx.completion_events,
                                      lambda: ctx.completion_chunk([], ctx.usage()))
            finally:
                await stream.aclose()

        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]

        async def engine():   # one token a step, once the request is in
            while "r0" not in llm._requests:
                await asyncio.sleep(0.001)
            for j, t in enumerate(tokens):
                llm._on_outputs(EngineCoreOutputs([EngineCoreOutput("r0", [t], "length" if j == n_tokens - 1
                                                                    else None)]))
                await asyncio.sleep(0)

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        payload = json.dumps(body).encode()
        await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                      b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(payload), payload))
        await asyncio.wait_for(engine(), 30)   # every output produced before the client reads a byte
        raw = b""
        while piece := await asyncio.wait_for(loop.sock_recv(sock, 65536), 30):
            raw += piece
        sock.close()
        await runner.cleanup()
        llm.close()
        return raw, tokens, llm.tokenizer

    raw, tokens, tok = asyncio.run(scenario())
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    data = b""
    while True:   # the chunked body, unframed
        size, _, body = body.partition(b"\r\n")
        if int(size, 16) == 0:
            break
        data, body = data + body[:int(size, 16)], body[int(size, 16) + 2:]
    events = [e[6:] for e in data.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == len(tokens) and chunks[-1]["choices"] == []
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == tok.decode(tokens)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert any(refused) and not all(refused)   # pushed, refused (the socket was full), then pushed again
