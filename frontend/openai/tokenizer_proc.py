"""Large inputs are tokenized in a tokenizer process, so that the work of a client that has gone
can be stopped (a thread cannot be).

The API server starts the process (`python -m frontend.openai.tokenizer_proc PATH PARENT_PID`) the first
time an input above the small lane's size arrives, and keeps it: it loads the tokenizer once
(AutoTokenizer.from_pretrained(PATH), as the API server does) and never tokenizes itself. Each
job runs in a child it forks (copy-on-write: the loaded tokenizer comes for free, in ~10 ms), so
cancelling a job is SIGKILL of that child and the next job starts at once, with no reload
(killing and restarting the whole process would cost an import of transformers, 4-12 s of a
2-core box, during which large inputs would wait). It starts at the first large input, not with
the API server, for the same cost: that first input waits for it (a few seconds, once).

Pipes, no pickle: each frame is a 4-byte little-endian length and a msgpack message (msgspec).
API server -> process: EncodeJob | ChatJob, then possibly Cancel while it runs.
Process -> API server: Ready once, then exactly one Ids or Failed per job (Failed "cancelled"
after a Cancel). Token ids travel as raw int32 arrays.

Every exit path leaves nothing: the process and each job child die with their parent
(PR_SET_PDEATHSIG: the API server's os._exit, SIGKILL, a crash), and on EOF of their input.
"""
from __future__ import annotations

import array
import asyncio
import ctypes
import logging
import os
import select
import signal
import struct
import sys
import time

import msgspec

from frontend.chat_utils import render_chat
from frontend.openai.protocol import APIError
from frontend.processing import tokenize_prompt
from ipc.validation import RequestError

logger = logging.getLogger(__name__)
_LEN = struct.Struct("<I")
_RETRY_S = 30.0            # a tokenizer process that failed to start is not tried again for this long
_CANCEL_TIMEOUT_S = 5.0    # no answer to Cancel in this time: the process is replaced


class EncodeJob(msgspec.Struct, tag="encode", array_like=True):
    texts: list[str]
    add_special_tokens: bool = True
    limit: int | None = None   # a text surely longer is refused before it is tokenized in full
    prompt_index: list[int] = []   # each text's place in the request's prompt list (errors name prompt[i])


class ChatJob(msgspec.Struct, tag="chat", array_like=True):
    """render_chat()'s arguments (frontend/chat_utils.py); the messages parsed already."""
    messages: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list | None = None
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = False
    chat_template: str | None = None
    limit: int | None = None


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    pass


class Ready(msgspec.Struct, tag="ready", array_like=True):
    pass


class Ids(msgspec.Struct, tag="ids", array_like=True):
    ids: list[bytes]       # per text, int32 native order


class Failed(msgspec.Struct, tag="failed", array_like=True):
    message: str
    status: int = 500
    param: str | None = None
    error_type: str | None = None


_ENCODER = msgspec.msgpack.Encoder()
_TO_PROCESS = msgspec.msgpack.Decoder(EncodeJob | ChatJob | Cancel)
_FROM_PROCESS = msgspec.msgpack.Decoder(Ready | Ids | Failed)


def _frame(msg) -> bytes:
    payload = _ENCODER.encode(msg)
    return _LEN.pack(len(payload)) + payload


def _int32(ids: list[int]) -> bytes:
    return array.array("i", ids).tobytes()


def _ids(raw: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(raw)
    return a.tolist()


# ------------------------------------------------------------------ the process

def _die_with_parent(parent: int) -> None:
    """SIGKILL when `parent` goes (Linux); gone already: exit now."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass   # not Linux: EOF on stdin still ends us
    if os.getppid() != parent:
        os._exit(1)


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame(fd: int) -> bytes | None:
    head = _read_exact(fd, _LEN.size)
    return None if head is None else _read_exact(fd, _LEN.unpack(head)[0])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _run(tokenizer, job: EncodeJob | ChatJob) -> Ids | Failed:
    try:
        if isinstance(job, EncodeJob):   # the API server's own path (frontend/processing.py), in this process
            ids = []
            for k, t in enumerate(job.texts):
                try:
                    ids.append(_int32(tokenize_prompt(tokenizer, t, job.add_special_tokens, job.limit)[1]))
                except RequestError as e:
                    i = job.prompt_index[k] if k < len(job.prompt_index) else k
                    raise (RequestError(f"prompt[{i}]: {e}", e.param) if i > 0 else e) from None
            return Ids(ids)
        _, ids = render_chat(tokenizer, job.messages, **{f: getattr(job, f) for f in job.__struct_fields__
                                                           if f != "messages"})
        return Ids([_int32(ids)])
    except RequestError as e:   # the client's mistake: the same 400 as in-process
        return Failed(str(e), 400, e.param)
    except Exception as e:  # noqa: BLE001  (the API server logs it; the client gets a 500)
        return Failed(f"tokenization failed: {type(e).__name__}: {e}")


def _run_forked(tokenizer, job: EncodeJob | ChatJob, inp: int) -> bytes | None:
    """The job's reply frame, from a forked child; a Cancel on `inp` kills it. None: `inp` closed."""
    r, w = os.pipe()
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:   # a job that fails (MemoryError, ...) writes nothing: the process answers Failed
            os.close(r)
            _die_with_parent(me)
            _write_all(w, _frame(_run(tokenizer, job)))
        finally:
            os._exit(0)
    os.close(w)
    out = bytearray()
    try:
        while True:
            ready, _, _ = select.select([r, inp], [], [])
            if inp in ready:   # while a job runs the API server sends only Cancel
                frame = _read_frame(inp)
                os.kill(pid, signal.SIGKILL)
                return None if frame is None else _frame(Failed("cancelled", 499))
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            out += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    if len(out) < _LEN.size or _LEN.unpack_from(out)[0] != len(out) - _LEN.size:
        return _frame(Failed("the tokenization job died"))
    return bytes(out)


def _close_inherited_descriptors() -> None:
    """The API server's loop (uvloop) starts us without closing its inheritable descriptors:
    a pipe that tells `loom serve` the API server is alive until every holder has gone, and the
    listening socket multiprocessing handed it. Ours from Python are never inheritable (PEP 446)."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if fd > 2 and os.get_inheritable(fd):
                os.close(fd)
        except OSError:   # the listing's own descriptor, closed by now
            pass


def main(path: str, parent: int, trust_remote_code: bool = False) -> None:
    _close_inherited_descriptors()
    _die_with_parent(parent)
    # Ctrl-C and SIGTERM are `loom serve`'s to handle (a SIGTERM to the process group must not cut
    # a drain short); we die with our parent (SIGKILL), or when the API server kills us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    inp, out = sys.stdin.fileno(), sys.stdout.fileno()
    _write_all(out, _frame(Ready()))
    while True:
        frame = _read_frame(inp)
        if frame is None:
            os._exit(0)   # the API server closed our input
        job = _TO_PROCESS.decode(frame)
        if isinstance(job, Cancel):
            continue      # its job had answered already
        reply = _run_forked(tokenizer, job, inp)
        if reply is None:
            os._exit(0)
        _write_all(out, reply)


# ------------------------------------------------------------------ the API server's side

class TokenizerProcess:
    """One lane: jobs run one at a time, in order. run() returns None when no tokenizer process
    can be had (the caller then tokenizes in-process)."""

    def __init__(self, path: str, trust_remote_code: bool = False):
        self.path, self.trust_remote_code = path, trust_remote_code
        self.proc: asyncio.subprocess.Process | None = None
        self._starting: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._retry_at = 0.0
        self._tasks: set[asyncio.Task] = set()
        self.closed = False

    async def run(self, job: EncodeJob | ChatJob, budget: float | None = None) -> list[list[int]] | None:
        """The token ids per text (one list for a ChatJob); a Failed reply raises its APIError.
        Cancelling the caller cancels the job: its child is killed and the lane is free at once.
        `budget`: seconds the job may run (once the process is up); past it, it is killed and the
        request gets a 400 (a request's own chat template: its loops are the caller's)."""
        await self._lock.acquire()
        try:
            proc = await self._ready()
        except BaseException:
            self._lock.release()
            raise
        if proc is None:
            self._lock.release()
            return None
        exchange = self._spawn(self._exchange(proc, job))   # releases the lock once the reply is in
        try:
            reply = await asyncio.wait_for(asyncio.shield(exchange), budget)
        except asyncio.TimeoutError:
            self._cancel(proc, exchange)
            raise APIError(f"The chat template did not render within {budget:g} s; it was stopped.", 400,
                           "chat_template") from None
        except asyncio.CancelledError:
            self._cancel(proc, exchange)
            raise
        if reply is None:   # the process died under the job
            raise APIError("The tokenizer process died; please retry.", 503)
        if isinstance(reply, Failed):
            if reply.status >= 500:
                logger.error("tokenizer process: %s", reply.message)
                raise APIError("Internal server error (see the server log)", 500)
            raise APIError(reply.message, reply.status, reply.param, reply.error_type)
        return [_ids(raw) for raw in reply.ids]

    @staticmethod
    def _cancel(proc, exchange: asyncio.Task) -> None:
        """Kill the running job's child (the process answers Failed "cancelled", freeing the lane)."""
        if not exchange.done() and proc.returncode is None:
            try:
                proc.stdin.write(_frame(Cancel()))
            except (ConnectionError, RuntimeError):
                pass   # the process is gone: _exchange sees it

    async def _exchange(self, proc, job) -> Ids | Failed | None:
        try:
            proc.stdin.write(_frame(job))
            await proc.stdin.drain()
            return await self._read(proc)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
            self._lost(proc)
            return None
        finally:
            self._lock.release()

    async def _ready(self) -> asyncio.subprocess.Process | None:
        """The running process; started (and waited for) the first time. A waiter that is
        cancelled does not stop the start."""
        if self.proc is not None and self.proc.returncode is None:
            return self.proc
        if self.closed or time.monotonic() < self._retry_at:
            return None
        if self._starting is None:
            self._starting = self._spawn(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> asyncio.subprocess.Process | None:
        proc = None
        try:
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false")   # no thread pool to fork with
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "frontend.openai.tokenizer_proc", self.path, str(os.getpid()),
                str(int(self.trust_remote_code)),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
            if not isinstance(await self._read(proc), Ready):
                raise RuntimeError("no READY")
        except Exception as e:  # noqa: BLE001
            logger.error("cannot start the tokenizer process (%s); large inputs are tokenized in-process "
                         "for %.0fs", e, _RETRY_S)
            if proc is not None and proc.returncode is None:
                proc.kill()
            self._retry_at = time.monotonic() + _RETRY_S
            return None
        finally:
            self._starting = None
        if self.closed:
            proc.kill()
            return None
        self.proc = proc
        self._spawn(self._watch(proc))
        logger.info("tokenizer process %d ready", proc.pid)
        return proc

    async def _watch(self, proc) -> None:
        """A tokenizer process that dies is replaced at once (it had been needed)."""
        code = await proc.wait()
        if self.proc is proc and not self.closed:
            logger.warning("tokenizer process %d exited with code %s; starting another", proc.pid, code)
            self.proc = None
            if self._starting is None:
                self._starting = self._spawn(self._start())

    def _lost(self, proc) -> None:
        if proc.returncode is None:
            proc.kill()

    @staticmethod
    async def _read(proc) -> Ready | Ids | Failed:
        head = await proc.stdout.readexactly(_LEN.size)
        return _FROM_PROCESS.decode(await proc.stdout.readexactly(_LEN.unpack(head)[0]))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def close(self) -> None:
        self.closed = True
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        for task in list(self._tasks):
            task.cancel()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["1"])
