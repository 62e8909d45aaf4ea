"""Frames on the wire: `[type byte, msgpack body, *raw buffers]`.

numpy arrays and torch tensors inside a message travel as msgpack Ext
`(dtype, shape, buffer index)` with the bytes as an extra frame, sent with
copy=False; the receiver wraps the frame without copying. Tiny arrays go inline.
"""
from __future__ import annotations

import sys
from typing import Any

import msgspec
import numpy as np

_EXT_ARRAY = 1
_EXT_TENSOR = 2
INLINE_LIMIT = 256  # bytes; smaller buffers are cheaper inline than as a frame


class Encoder:
    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self._buffers: list[Any] = []

    def encode(self, msg_type: bytes, obj: Any) -> list[Any]:
        self._buffers = []
        body = self._enc.encode(obj)
        frames = [msg_type, body, *self._buffers]
        self._buffers = []
        return frames

    def _hook(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")   # not imported here: the engine core has no other use for it
        if torch is not None and isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            arr = t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
            return msgspec.msgpack.Ext(_EXT_TENSOR, self._put(str(t.dtype).removeprefix("torch."), list(t.shape), arr))
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            return msgspec.msgpack.Ext(_EXT_ARRAY, self._put(arr.dtype.str, list(arr.shape), arr))
        raise TypeError(f"cannot serialize {type(obj).__name__}")

    def _put(self, dtype: str, shape: list[int], arr: np.ndarray) -> bytes:
        data = arr.view(np.uint8).reshape(-1)
        if data.nbytes <= INLINE_LIMIT:
            return msgspec.msgpack.encode((dtype, shape, -1, data.tobytes()))
        self._buffers.append(data.data)
        return msgspec.msgpack.encode((dtype, shape, len(self._buffers) + 1, b""))


class Decoder:
    """Decodes the body of one message type; `frames` are all frames of the message."""

    def __init__(self, msg_cls: Any) -> None:
        self._dec = msgspec.msgpack.Decoder(msg_cls, ext_hook=self._ext)
        self._frames: list[Any] = []

    def decode(self, frames: list[Any]) -> Any:
        self._frames = frames
        try:
            return self._dec.decode(frames[1])
        finally:
            self._frames = []

    def _ext(self, code: int, data: memoryview) -> Any:
        dtype, shape, index, inline = msgspec.msgpack.decode(data)
        buf = inline if index < 0 else self._frames[index]
        buf = buf.buffer if hasattr(buf, "buffer") else buf  # zmq.Frame -> memoryview
        if code == _EXT_ARRAY:
            return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
        if code == _EXT_TENSOR:
            import torch   # only where a tensor arrives (~2 s to import: the engine core starts without it)
            torch_dtype = getattr(torch, dtype)
            if len(buf) == 0:
                return torch.empty(shape, dtype=torch_dtype)
            return torch.frombuffer(bytearray(buf) if isinstance(buf, bytes) else buf,
                                    dtype=torch.uint8).view(torch_dtype).reshape(shape)
        raise ValueError(f"unknown msgpack extension {code}")
