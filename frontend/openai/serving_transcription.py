"""POST /v1/audio/transcriptions and POST /v1/audio/translations (OpenAI's, as vLLM serves them):
a multipart form with `file`, `model`, `language`, `prompt`, `response_format` (json, text,
verbose_json), `temperature`, `max_completion_tokens` and `stream`.

The file is decoded and resampled off the event loop (multimodal/audio.py), cut with
split_audio at low-energy points into clips of the model's window (30 s), and each clip runs as
one request of the model's transcription prompt (its MultiModalInfo's `transcription_prompt`),
through the same store and encoder path as chat audio; the clips' texts are joined with a
space. Streamed, each clip's text deltas are SSE chunks in order (vLLM's `transcription.chunk`,
which also carries OpenAI's `transcript.text.delta` fields), then a done event and [DONE]."""
from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from frontend.openai.protocol import APIError, dumps, now, random_id
from frontend.openai.serving import sse_response
from ipc.sampling_params import SamplingParams
from multimodal.audio import MAX_AUDIO_BYTES, MAX_AUDIO_SECONDS, Audio, decode_audio
from multimodal.audio_split import split_audio
from multimodal.media import MediaError

FORMATS = ("json", "text", "verbose_json")
SSE_DONE = b"data: [DONE]\n\n"


class TranscriptionForm(msgspec.Struct):
    data: bytes
    model: str | None
    language: str | None
    prompt: str
    response_format: str
    temperature: float
    max_completion_tokens: int | None
    stream: bool
    ignore_eos: bool = False   # (vLLM's sampling parameter, as an extra field: benchmarks decode fixed lengths)


def _bool(value: str, name: str) -> bool:
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0", ""):
        return False
    raise APIError(f"{name} must be true or false", 400, name)


async def read_form(request: web.Request) -> TranscriptionForm:
    if not request.content_type.startswith("multipart/"):
        raise APIError("the request must be multipart/form-data with a 'file' part", 400, "file")
    fields, data = {}, None
    reader = await request.multipart()
    async for part in reader:
        if part.name == "file":
            data = bytearray()
            while chunk := await part.read_chunk(1 << 16):
                data += chunk
                if len(data) > MAX_AUDIO_BYTES:
                    raise APIError(f"the file is larger than {MAX_AUDIO_BYTES} bytes", 400, "file")
        elif part.name:
            fields[part.name] = (await part.read(decode=True)).decode("utf-8", "replace")[:65536]
    if not data:
        raise APIError("'file' is required (an audio file)", 400, "file")
    fmt = fields.get("response_format", "json")
    if fmt not in FORMATS:
        raise APIError(f"response_format must be one of {', '.join(FORMATS)}, got {fmt!r}", 400, "response_format")
    try:
        temperature = float(fields.get("temperature", 0) or 0)
        mct = fields.get("max_completion_tokens")
        max_tokens = int(mct) if mct else None
    except ValueError:
        raise APIError("temperature must be a number and max_completion_tokens an integer", 400) from None
    if not 0 <= temperature <= 2:
        raise APIError("temperature must be in [0, 2]", 400, "temperature")
    if max_tokens is not None and max_tokens < 1:
        raise APIError("max_completion_tokens must be at least 1", 400, "max_completion_tokens")
    language = fields.get("language") or None
    if language is not None and not (language.isalpha() and 2 <= len(language) <= 3):
        raise APIError(f"language must be an ISO-639-1 code such as 'en', got {language[:16]!r}", 400, "language")
    return TranscriptionForm(bytes(data), fields.get("model"), language, fields.get("prompt", ""), fmt,
                             temperature, max_tokens, _bool(fields.get("stream", "false"), "stream"),
                             _bool(fields.get("ignore_eos", "false"), "ignore_eos"))


async def deltas(i: int, gen):
    """The text deltas of clip i's request (closed at the end); a clip after the first starts
    with one space, so that the clips' texts join as words."""
    started = False
    try:
        async for out in gen:
            delta = out.outputs[0].text
            if i and not started and delta:
                delta = " " + delta.lstrip()
            if delta:
                started = True
                yield delta
    finally:
        await gen.aclose()


class TranscriptionAPI:
    def __init__(self, server):
        self.server = server

    def routes(self) -> list[tuple[str, str, object]]:
        return [("POST", "/v1/audio/transcriptions", self.transcriptions),
                ("POST", "/v1/audio/translations", self.translations)]

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self._create(request, "transcribe")

    async def translations(self, request: web.Request) -> web.StreamResponse:
        return await self._create(request, "translate")

    def _mm(self):
        mm = getattr(self.server.llm, "mm", None)
        if mm is None or mm.modality != "audio" or not hasattr(mm.info, "transcription_prompt"):
            raise APIError("this model does not support transcriptions", 400, "model")
        return mm

    async def _clips(self, mm, form: TranscriptionForm) -> list[Audio]:
        from multimodal.audio_info import sampling_rate, window_seconds
        rate, window = sampling_rate(mm.config.model), window_seconds(mm.config.model)
        try:
            audio = await mm.off_loop(decode_audio, form.data, rate, MAX_AUDIO_SECONDS)
        except MediaError as e:
            raise APIError(str(e), 400, "file") from None
        return [Audio(c, rate) for c in split_audio(audio.samples, rate, max_audio_clip_s=window,
                                                    overlap_chunk_second=1.0, min_energy_split_window_size=rate // 10)]

    async def _prompt(self, mm, task: str, form: TranscriptionForm, clip: Audio) -> tuple[list[int], list]:
        server = self.server
        text = mm.info.transcription_prompt(task, form.language, form.prompt)
        [(_, ids)] = await server.tokenizers.encode(len(text), [text], False)
        mm.check_prompt(ids, 1)
        stored = await mm._store_off_loop(clip, {})
        return mm.expand(ids, [stored])

    async def _create(self, request: web.Request, task: str) -> web.StreamResponse:
        server = self.server
        form = await read_form(request)
        server._check_model(form.model)
        mm = self._mm()
        server.check_alive()
        clips = await self._clips(mm, form)
        rid, created = random_id("trsc-"), now()
        model_len = server.config.max_model_len

        async def run(i: int, clip: Audio):
            try:
                ids, items = await self._prompt(mm, task, form, clip)
            except MediaError as e:
                raise APIError(str(e), 400, "file") from None
            max_tokens = min(form.max_completion_tokens or model_len, model_len - len(ids))
            if max_tokens < 1:
                mm.unref(items)
                raise APIError("the clip's prompt fills the model's context", 400, "file")
            params = SamplingParams(temperature=form.temperature, max_tokens=max_tokens, ignore_eos=form.ignore_eos)
            # (an async generator: its store reference is the engine's once it is first iterated)
            return server.llm.generate(ids, params, f"{rid}-{i}", mm_items=items), items

        if form.stream:
            return await self._stream(request, mm, rid, created, clips, run)
        texts = []
        for i, clip in enumerate(clips):   # one at a time: the store holds one clip of this request
            gen, _ = await run(i, clip)
            texts.append("".join([d async for d in deltas(i, gen)]))
        text = "".join(texts)
        duration = sum(c.seconds for c in clips)
        if form.response_format == "text":
            return web.Response(text=text, content_type="text/plain")
        body = {"text": text, "usage": {"type": "duration", "seconds": int(duration + 0.999)}}
        if form.response_format == "verbose_json":
            start, segments = 0.0, []
            for i, (clip, t) in enumerate(zip(clips, texts)):
                segments.append({"id": i, "seek": int(start * 100), "start": round(start, 3),
                                 "end": round(start + clip.seconds, 3), "text": t.strip(),
                                 "temperature": form.temperature})
                start += clip.seconds
            body = {"task": task, "language": form.language or "", "duration": round(duration, 3), "text": text,
                    "segments": segments, "usage": body["usage"]}
        return web.Response(body=dumps(body), content_type="application/json")

    async def _stream(self, request, mm, rid: str, created: int, clips: list[Audio], run) -> web.StreamResponse:
        model = self.server.model_name
        # the first clip's prompt before the 200: a bad request is still a 400
        first, items = await run(0, clips[0])
        try:
            resp = await sse_response(request)
        except BaseException:   # (the client went) its request never started: the clip's reference goes back
            mm.unref(items)
            raise

        def chunk(delta: str, finish: str | None = None) -> bytes:
            event = {"id": rid, "object": "transcription.chunk", "created": created, "model": model,
                     "choices": [{"delta": {"content": delta}, "finish_reason": finish, "stop_reason": None}],
                     "type": "transcript.text.delta", "delta": delta}
            return b"data: " + dumps(event) + b"\n\n"
        texts, gen = [], first
        try:
            for i in range(len(clips)):
                if i:
                    gen = (await run(i, clips[i]))[0]
                parts = []
                async for delta in deltas(i, gen):
                    parts.append(delta)
                    await resp.write(chunk(delta))
                texts.append("".join(parts))
            done = {"id": rid, "object": "transcription.chunk", "created": created, "model": model,
                    "choices": [{"delta": {"content": ""}, "finish_reason": "stop", "stop_reason": None}],
                    "type": "transcript.text.done", "text": "".join(texts)}
            await resp.write(b"data: " + dumps(done) + b"\n\n" + SSE_DONE)
        except (APIError, asyncio.CancelledError, ConnectionResetError) as e:
            if isinstance(e, APIError):
                await resp.write(b"data: " + dumps({"error": {"message": str(e), "type": "BadRequestError",
                                                              "code": 400}}) + b"\n\n" + SSE_DONE)
            else:
                raise
        return resp
