"""The CPU time of the API-server processes behind a local --base-url, for `loom bench serve`'s
"API server CPU per request" (issue 49: one API server's ceiling is its CPU per request).

The API servers are the processes that hold a listening socket on the URL's port (every API
server of `--api-server-count N` listens on it with SO_REUSEPORT): found through /proc/net/tcp
and the processes' fds, so nothing in the server has to report it and a benchmark of any
server (vLLM's too) on this host gets the number. Their utime + stime are read from
/proc/<pid>/stat before and after the run. A server on another host: None (not measured).
"""
from __future__ import annotations

import os
from urllib.parse import urlparse

_LISTEN = "0A"   # TCP_LISTEN in /proc/net/tcp's st column


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def api_server_pids(base_url: str) -> list[int]:
    """The pids of this host's processes listening on base_url's port ([] where none can be seen)."""
    url = urlparse(base_url)
    if url.hostname not in ("localhost", "127.0.0.1", "0.0.0.0", "::1") and url.hostname != os.uname().nodename:
        return []
    port = url.port or (443 if url.scheme == "https" else 80)
    targets = {f"socket:[{i}]" for i in _listening_inodes(port)}
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc") if targets else ()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in targets for fd in fds):
                pids.append(int(pid))
        except OSError:   # gone, or not ours to read
            continue
    return sorted(pids)


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes, in seconds (a process that has ended counts 0)."""
    hz = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()   # after "(comm)", which may hold spaces
            total += int(fields[11]) + int(fields[12])   # utime, stime: fields 14 and 15 of stat(5)
        except OSError:
            continue
    return total / hz
