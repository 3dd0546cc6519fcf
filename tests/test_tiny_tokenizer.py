"""The bundled tiny Llama's tokenizer (scripts/make_tiny_tokenizer.py): it loads
with transformers, covers exactly the model's vocabulary, round-trips text, has
a chat template, and rebuilds byte-identically; and a real worker serves text
prompts, chat and /tokenize, /detokenize with it (the `vllm` part)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from pd_helpers import ROOT

MODEL_DIR = ROOT / "prefill" / "models" / "tiny-llama"
SCRIPT = ROOT / "scripts" / "make_tiny_tokenizer.py"
FILES = ("tokenizer.json", "tokenizer_config.json")
CONFIG = json.loads((MODEL_DIR / "config.json").read_text())
TEXTS = ["Hello, ProServe!", "SlideBatching orders the queue by deadline.\n\tKV  cache -> decode",
         "Ünïcødé — ≥ 0.5 s, 你好 ✓", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))


def test_vocabulary_is_the_models(tok):
    assert CONFIG["vocab_size"] == 1024
    assert len(tok) == CONFIG["vocab_size"]
    assert tok.bos_token_id == CONFIG["bos_token_id"] and tok.eos_token_id == CONFIG["eos_token_id"]
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 4, 5]) == [
        "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    assert tok.model_max_length == CONFIG["max_position_embeddings"]
    # every id the model can emit decodes to a string; ordinary ids to something non-empty
    for i in range(CONFIG["vocab_size"]):
        assert isinstance(tok.decode([i]), str)
        if i >= 6:
            assert tok.decode([i]) != ""


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips(tok, text):
    ids = tok.encode(text)
    assert ids[0] == CONFIG["bos_token_id"] and ids.count(CONFIG["bos_token_id"]) == 1
    assert all(0 <= i < CONFIG["vocab_size"] for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_bpe_merges_shorten_text(tok):
    text = "The prefill worker pushes the KV cache to the decode worker."
    assert len(tok.encode(text, add_special_tokens=False)) < len(text.encode()) / 2


def test_chat_template_renders_roles_and_generation_prompt(tok):
    pytest.importorskip("jinja2", reason="transformers renders chat templates with jinja2 (in the [test] extra)")
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    assert tok.apply_chat_template(CHAT, tokenize=False).endswith("Hi there</s>\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [1, 3] and ids[-2:] == [5, tok.encode("\n", add_special_tokens=False)[0]]
    with pytest.raises(Exception, match="unknown chat role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def _build(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_script_is_deterministic(tmp_path):
    for d in ("a", "b"):
        r = _build(tmp_path / d, "--rev", "worktree")
        assert r.returncode == 0, r.stderr
    for name in FILES:
        a, b = (tmp_path / "a" / name).read_bytes(), (tmp_path / "b" / name).read_bytes()
        assert a == b, name
        assert 0 < len(a) < 64_000, f"{name} is {len(a)} bytes"


def test_committed_files_match_a_fresh_build():
    """The committed tokenizer is what the script builds from its pinned revision."""
    spec = importlib.util.spec_from_file_location("make_tiny_tokenizer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    have = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{mod.PINNED_REV}^{{commit}}"],
                          capture_output=True)
    if have.returncode != 0:
        pytest.skip(f"git history lacks the pinned corpus revision {mod.PINNED_REV[:10]} (shallow clone?)")
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_script_rejects_config_it_cannot_serve(tmp_path):
    cfg = dict(CONFIG, eos_token_id=7)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = _build(tmp_path / "out", "--rev", "worktree", "--model-dir", str(tmp_path))
    assert r.returncode == 2
    assert "eos_token_id is 7" in r.stderr
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_worker_uses_the_tokenizer_by_default():
    from proserve.prefill import worker

    def argv(*flags):
        return worker.vllm_argv("prefill", worker.build_parser("prefill").parse_args(list(flags)))[0]

    assert "--skip-tokenizer-init" not in argv()
    assert "--skip-tokenizer-init" in argv("--skip-tokenizer-init")
    assert "--skip-tokenizer-init" not in argv("--no-skip-tokenizer-init")


def test_package_data_ships_the_tokenizer():
    tomllib = pytest.importorskip("tomllib")     # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["proserve.prefill"]
    pkg = ROOT / "prefill"
    shipped = {p for pat in patterns for p in pkg.glob(pat)}
    for name in ("config.json", *FILES):
        assert MODEL_DIR / name in shipped, name


# ---- a real worker -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker(shared_colocated):
    """The session's shared colocated worker (tests/conftest.py): the bundled tiny model
    with this tokenizer (not --skip-tokenizer-init), idle."""
    return shared_colocated


def post(w, path: str, body: dict, raw: bool = False):
    req = urllib.request.Request(w.url + path, data=json.dumps({"model": str(MODEL_DIR), **body}).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read().decode()
            return r.status, (data if raw else json.loads(data))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sse(text: str) -> list[dict]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-500:]
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.vllm
def test_text_completions(worker, tok):
    clean = 0
    for prompt in ("Hello, ProServe", "The scheduler orders the queue", "Prefill and decode workers"):
        status, out = post(worker, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                        "ignore_eos": True, "return_token_ids": True})
        assert status == 200, out
        c = out["choices"][0]
        assert c["prompt_token_ids"] == tok.encode(prompt)            # the server tokenized with this tokenizer
        assert len(c["token_ids"]) == 6 and isinstance(c["text"], str)
        want = tok.decode(c["token_ids"], skip_special_tokens=True)
        if "\ufffd" not in want:    # random weights may emit lone UTF-8 bytes, which vLLM holds back
            assert c["text"] == want
            clean += c["text"] != ""
    assert clean >= 1
    status, out = post(worker, "/v1/completions", {"prompt": "Hello, ProServe", "max_tokens": 2, "echo": True})
    assert status == 200 and out["choices"][0]["text"].startswith("Hello, ProServe")


@pytest.mark.vllm
def test_token_id_prompts_still_work(worker):
    status, out = post(worker, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True,
                                                    "temperature": 0, "return_token_ids": True})
    assert status == 200, out
    assert out["choices"][0]["prompt_token_ids"] == [5, 6, 7, 8] and len(out["choices"][0]["token_ids"]) == 4


@pytest.mark.vllm
def test_chat_completions(worker, tok):
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    n_prompt = len(tok.encode(rendered, add_special_tokens=False))
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    status, out = post(worker, "/v1/chat/completions", body)
    assert status == 200, out
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert out["usage"]["prompt_tokens"] == n_prompt and out["usage"]["completion_tokens"] == 5

    status, text = post(worker, "/v1/chat/completions",
                        {**body, "stream": True, "stream_options": {"include_usage": True}}, raw=True)
    assert status == 200
    chunks = sse(text)
    streamed = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert streamed == msg["content"]                     # same greedy reply, streamed
    assert chunks[-1]["usage"]["prompt_tokens"] == n_prompt


@pytest.mark.vllm
def test_chat_rejects_unknown_role(worker):
    status, out = post(worker, "/v1/chat/completions",
                       {"messages": [{"role": "tool", "content": "x", "tool_call_id": "t"}], "max_tokens": 2})
    assert status == 400 and "unknown chat role tool" in out["error"]["message"]


@pytest.mark.vllm
def test_tokenize_and_detokenize(worker, tok):
    status, out = post(worker, "/tokenize", {"prompt": "Hello, ProServe"})
    assert status == 200, out
    assert out["tokens"] == tok.encode("Hello, ProServe") and out["count"] == len(out["tokens"])

    # what the dispatcher's OpenAI front end does with chat messages: count and token ids
    status, out = post(worker, "/tokenize", {"messages": CHAT, "add_generation_prompt": True})
    assert status == 200, out
    want = tok.encode(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)
    assert out["tokens"] == want and out["count"] == len(want)
    assert out["tokens"].count(CONFIG["bos_token_id"]) == 1   # the template's <s>, not a second one

    status, back = post(worker, "/detokenize", {"tokens": want})
    assert status == 200, back
    assert back["prompt"] == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
