"""Issue 49 item 7, serving overhead: the stream's chunk bytes made from a prebuilt frame are the
bytes of the plain encoding, and `loom bench serve` finds this host's API-server processes and
their CPU time (bench/server_cpu.py)."""
import os
import socket
import time

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
