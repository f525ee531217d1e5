"""The streaming model the way mlx-lm users run a model: mlx-lm's generation API with its samplers and logits
processors, ``mlx-streaming chat`` and ``mlx-streaming serve`` (mlx-lm's OpenAI-compatible server)."""

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.utils import load_tokenizer
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


def _post(url, raw: bytes):
    """(HTTP status, body) of a POST of ``raw``, error statuses included."""
    request = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("serve") / "stderr.txt"


@pytest.fixture(scope="module")
def server(model_dir, server_log):
    port = _free_port()
    log = server_log.open("w")
    process = subprocess.Popen([sys.executable, "-m", "mlx_streaming", "serve", "--port", str(port), "--pool-slots", "12"],
                               stdout=subprocess.DEVNULL, stderr=log, text=True)
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
    log.close()


@pytest.fixture(scope="module")
def inmemory_greedy(model_dir):
    """``text(prompt, n)``: mlx-lm's in-memory greedy continuation, the server's reference."""
    model, tokenizer = mlx_lm.load(str(model_dir))
    return lambda prompt, n: mlx_lm.generate(model, tokenizer, prompt, max_tokens=n)


def test_server_lists_its_model(server, model_dir):
    models = json.loads(_get(f"{server}/v1/models"))["data"]
    assert [m["id"] for m in models] == [str(model_dir.resolve())]


def _speculative_requests(server_log) -> list:
    """The server's line per greedy request that ran MTP speculation: (steps, accepted drafts)."""
    return [tuple(map(int, m)) for m in re.findall(r"speculative: (\d+) steps, (\d+) accepted drafts", server_log.read_text())]


def test_server_greedy_completion_equals_in_memory_greedy_and_speculates(server, server_log, model_dir, inmemory_greedy):
    tokenizer = load_tokenizer(model_dir)
    expected = inmemory_greedy(PROMPT, 16)
    before = len(_speculative_requests(server_log))
    reply = json.loads(_get(f"{server}/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}))
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["completion_tokens"] == 16 and reply["usage"]["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    runs = _speculative_requests(server_log)
    # the engine's speculation ran it: K auto, whose chooser, kept across requests, may settle on steps without drafts
    # where a verify does not pay (tests/test_exact_mtp.py shows the kept chooser's requests committing drafts)
    assert len(runs) == before + 1 and 0 < runs[-1][0] <= 15


def test_server_samples_as_mlx_lm_does_without_speculation(server, server_log, model_dir):
    """A sampled request (temperature 0.8, seed 7) gets mlx-lm's in-memory sample, token for token, and no
    speculation (exact speculative sampling is not built)."""
    model, tokenizer = mlx_lm.load(str(model_dir))
    mx.random.seed(7)
    expected = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=12, sampler=make_sampler(temp=0.8))
    before = len(_speculative_requests(server_log))
    reply = json.loads(_get(f"{server}/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": 7}))
    assert reply["choices"][0]["text"] == expected
    assert len(_speculative_requests(server_log)) == before


def test_server_streams_server_sent_events(server):
    body = _get(f"{server}/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "stream": True})
    events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 6 and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_server_answers_bad_requests_with_a_4xx_and_a_message(server, server_log, model_dir):
    url = f"{server}/v1/completions"
    status, body = _post(url, b'{"prompt": "def f(", "max_tok')
    assert status == 400 and "Invalid JSON" in body
    for bad in (0, -1):
        status, body = _post(url, json.dumps({"prompt": PROMPT, "max_tokens": bad}).encode())
        assert status == 400 and "max_tokens" in json.loads(body)["error"]
    status, body = _post(url, json.dumps({"prompt": PROMPT, "max_tokens": 2, "model": "some/other-model"}).encode())
    assert status == 404 and "'some/other-model' is not served here" in json.loads(body)["error"]
    status, _ = _post(url, json.dumps({"prompt": PROMPT, "max_tokens": 2, "model": model_dir.name}).encode())
    assert status == 200
    assert "Traceback" not in server_log.read_text()


def test_server_chat_completion_and_stop_string(server):
    status, body = _post(f"{server}/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}).encode())
    reply = json.loads(body)
    assert status == 200 and reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 4
    assert reply["choices"][0]["message"]["role"] == "assistant" and reply["choices"][0]["finish_reason"] == "length"
    # mlx-lm's server (in memory too) ends the answer at a stop string after the first token, and leaves it out;
    # (it matches the stop string's token ids): this prompt's greedy answer is a function name, then "(" alone
    status, body = _post(f"{server}/v1/completions", json.dumps(
        {"prompt": "import os\n\n\ndef ", "max_tokens": 24, "temperature": 0, "stop": ["("]}).encode())
    reply = json.loads(body)
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] < 24
    assert reply["choices"][0]["text"].strip() and "(" not in reply["choices"][0]["text"]


def test_server_goes_on_after_a_client_disconnects_mid_stream(server, inmemory_greedy):
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 48, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=120) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while b"data: " not in received:  # read until the first token arrives, then hang up
            chunk = s.recv(4096)
            assert chunk, received
            received += chunk
    status, reply = _post(f"{server}/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode())
    assert status == 200 and json.loads(reply)["choices"][0]["text"] == inmemory_greedy(PROMPT, 16)


def test_server_answers_two_clients_at_once_each_its_own(server, inmemory_greedy):
    prompts = [PROMPT, "import os\n"]
    answers = {}

    def ask(prompt):
        _, body = _post(f"{server}/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 12, "temperature": 0}).encode())
        answers[prompt] = json.loads(body)["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert answers == {p: inmemory_greedy(p, 12) for p in prompts}


def test_server_answers_the_official_openai_client(server, model_dir, inmemory_greedy):
    import openai  # the test extra: pip install -e '.[test]'

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="not-needed", timeout=120)
    assert [m.id for m in client.models.list()] == [str(model_dir.resolve())]
    completion = client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=16, temperature=0)
    assert completion.choices[0].text == inmemory_greedy(PROMPT, 16) and completion.usage.completion_tokens == 16
    stream = client.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="some/other-model", prompt=PROMPT, max_tokens=2)
    assert "is not served here" in refused.value.response.text


def test_the_server_integration_refuses_an_mlx_lm_it_was_not_tested_with():
    from mlx_streaming.integrations import UntestedMlxLmError, require_tested_mlx_lm

    require_tested_mlx_lm("serve", "0.32.2")
    with pytest.raises(UntestedMlxLmError, match=r"serve uses mlx-lm's internals .* mlx-lm 0\.33\.0 is installed"):
        require_tested_mlx_lm("serve", "0.33.0")
