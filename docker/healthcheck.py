# SPDX-License-Identifier: Apache-2.0
"""The images' HEALTHCHECK: exit 0 when the server's ``/health`` answers 200, else 1.

The port (and host) are read from the running ``vllm serve`` command line (``--port N``,
``--port=N``, ``--host H``), so a server moved to another port stays checked; default 8000. Only
the standard library: slim images have no curl.
"""

from __future__ import annotations

import os
import sys
import urllib.request


def _serve_args() -> list[str]:
    """The arguments of the first process whose command line is ``... vllm serve ...``."""
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if os.path.basename(arg) == "vllm" and argv[i + 1] == "serve":
                return argv[i + 2 :]
    return []


def _option(args: list[str], name: str) -> str | None:
    value = None
    for i, arg in enumerate(args):  # the last one wins, as in argparse
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def main() -> int:
    args = _serve_args()
    port = _option(args, "--port") or "8000"
    host = _option(args, "--host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return 0 if r.status == 200 else 1
    except OSError as e:
        print(f"healthcheck: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
