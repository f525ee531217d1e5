"""The streaming model the way mlx-lm users run a model: mlx-lm's generation API with its samplers and logits
processors, ``mlx-streaming chat`` and ``mlx-streaming serve`` (mlx-lm's OpenAI-compatible server)."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_streaming.config import StreamingConfig
from mlx_streaming.model import build_streaming_model

PROMPT = "def fibonacci(n):"


def _sampled(model, tokenizer, n=32):
    mx.random.seed(7)
    return [r.token for r in mlx_lm.stream_generate(
        model, tokenizer, PROMPT, max_tokens=n, sampler=make_sampler(temp=0.8, top_p=0.95),
        logits_processors=make_logits_processors(repetition_penalty=1.1))]


@pytest.fixture(scope="module")
def inmemory_sampled(model_dir):
    model, tokenizer = mlx_lm.load(str(model_dir))
    return _sampled(model, tokenizer)


@pytest.mark.parametrize("config", [StreamingConfig(), StreamingConfig(pool_slots=4),
                                    StreamingConfig(pool_slots=4, prefetch=True, verify=True),
                                    StreamingConfig(pool_slots=4, miss_check="layer")],
                         ids=["full", "minimum", "minimum-prefetch-verify", "minimum-layer-check"])
def test_stream_generate_samples_the_same_tokens_as_in_memory(model_dir, inmemory_sampled, config):
    """mlx-lm's generate_step evaluates one step ahead (async_eval) while our switch writes pool slots; the
    tokens still equal the in-memory model's, because a step's routing needs the previous step's token, so
    the previous graph has finished before any slot of this step is written (see the README)."""
    with build_streaming_model(model_dir, config) as sm:
        assert _sampled(sm.model, sm.tokenizer) == inmemory_sampled
        stats = sm.store.stats()
    if config.pool_slots:
        assert stats["misses"] > 0 and stats["evictions"] > 0
    if config.verify:
        assert stats["verify_calls"] == stats["misses"] and stats["verify_bad"] == 0


def test_chat_streams_answers_with_a_stats_line_per_answer(model_dir):
    done = subprocess.run([sys.executable, "-m", "mlx_streaming", "chat", "--max-tokens", "8", "--pool-slots", "12"],
                          input="def add(a, b):\nimport os\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    stats = [line for line in done.stderr.splitlines() if "tok/s" in line and "counters over this answer" in line]
    assert len(stats) == 2 and "read from disk" in stats[0]
    assert done.stdout.count(">> ") == 3  # two answers, then end of input


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, body=None):
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


@pytest.fixture(scope="module")
def server(model_dir):
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "mlx_streaming", "serve", "--port", str(port), "--pool-slots", "12"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            _get(f"{url}/v1/models")
            break
        except OSError:
            time.sleep(0.5)
    yield url
    process.terminate()
    process.wait(timeout=30)


def test_server_lists_its_model(server, model_dir):
    models = json.loads(_get(f"{server}/v1/models"))["data"]
    assert [m["id"] for m in models] == [str(model_dir.resolve())]


def test_server_greedy_completion_equals_in_memory_greedy(server, model_dir):
    model, tokenizer = mlx_lm.load(str(model_dir))
    expected = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=16)
    reply = json.loads(_get(f"{server}/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}))
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["completion_tokens"] == 16 and reply["usage"]["prompt_tokens"] == len(tokenizer.encode(PROMPT))


def test_server_streams_server_sent_events(server):
    body = _get(f"{server}/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "stream": True})
    events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 6 and chunks[-1]["choices"][0]["finish_reason"] == "length"
