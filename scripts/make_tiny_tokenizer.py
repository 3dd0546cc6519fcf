#!/usr/bin/env python3
"""Build the tokenizer of the bundled tiny Llama (prefill/models/tiny-llama).

A byte-level BPE (the ``tokenizers`` library, installed with vLLM) trained on
this repository's own documentation, with exactly the model's ``vocab_size``
(1024) entries, so that every token id the random-weight model can emit
decodes. Ids 0-2 are ``<pad>``, ``<s>``, ``</s>`` (``<s>`` / ``</s>`` must sit
at config.json's ``bos_token_id`` / ``eos_token_id``: checked), 3-5 the chat
role markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``; every byte has a
token of its own, so any text encodes. ``<s>`` is prepended to encoded text
(as Llama does); the chat template writes it itself.

Writes ``tokenizer.json`` and ``tokenizer_config.json`` (PreTrainedTokenizerFast,
chat template, model_max_length) into the model directory.

The corpus is read from a pinned git revision (``--rev``), not from the working
tree, so that editing the README does not change the tokenizer: the same
revision always gives byte-identical files (BPE ties are broken by the trainer
deterministically; nothing here is random). ``--rev worktree`` reads the files
as they are on disk instead.

    python scripts/make_tiny_tokenizer.py                 # writes prefill/models/tiny-llama/tokenizer*.json
    python scripts/make_tiny_tokenizer.py --check         # exit 1 if the committed files differ from a fresh build
    python scripts/make_tiny_tokenizer.py --out /tmp/tok --rev worktree
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "prefill" / "models" / "tiny-llama"
# the revision whose documentation the committed tokenizer was trained on
PINNED_REV = "fa414e9684b0c6027b81c1055f17558fe6247eeb"
CORPUS = ("README.md", "docs/latency_model.md", "docs/results.md")
WORKTREE = "worktree"

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLES = ("system", "user", "assistant")
SPECIALS = (PAD, BOS, EOS) + tuple(f"<|{r}|>" for r in ROLES)

# Role-tagged messages, each ended by </s>, then the assistant tag when a reply is wanted:
#   <s><|user|>\nHello</s>\n<|assistant|>\n
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unknown chat role ' ~ message['role'] ~ ': use system, user or assistant') -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ eos_token ~ '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


class BuildError(Exception):
    pass


def read_corpus(rev: str) -> list[str]:
    texts = []
    for rel in CORPUS:
        if rev == WORKTREE:
            try:
                texts.append((ROOT / rel).read_text(encoding="utf-8"))
            except OSError as e:
                raise BuildError(f"cannot read corpus file {ROOT / rel}: {e.strerror}")
            continue
        try:
            r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"],
                               capture_output=True, check=False)
        except FileNotFoundError:
            raise BuildError("git is not installed: it is needed to read the corpus at the pinned "
                             f"revision (or pass --rev {WORKTREE} to use the files on disk)")
        if r.returncode != 0:
            raise BuildError(f"cannot read {rel} at revision {rev} ({r.stderr.decode(errors='replace').strip()}); "
                             f"a shallow clone may lack it: fetch the history or pass --rev {WORKTREE}")
        texts.append(r.stdout.decode("utf-8"))
    return texts


def model_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except OSError as e:
        raise BuildError(f"cannot read {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        raise BuildError(f"{path} is not valid JSON (line {e.lineno}): {e.msg}")
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "max_position_embeddings"):
        if not isinstance(cfg.get(key), int):
            raise BuildError(f"{path}: {key} missing or not an integer")
    want = {"bos_token_id": SPECIALS.index(BOS), "eos_token_id": SPECIALS.index(EOS)}
    for key, tid in want.items():
        if cfg[key] != tid:
            raise BuildError(f"{path}: {key} is {cfg[key]}, but this tokenizer puts that token at id {tid}")
    return cfg


def build(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise BuildError(f"trained vocabulary has {got} tokens, the model needs exactly {vocab_size} "
                         "(a corpus too small for that many merges?)")
    for i, s in enumerate(SPECIALS):
        if tok.token_to_id(s) != i:
            raise BuildError(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    # prepend <s> to encoded text (add_special_tokens=True), as Llama tokenizers do
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, SPECIALS.index(BOS))])
    return tok


def tokenizer_config(cfg: dict) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write(out: Path, rev: str, model_dir: Path) -> list[Path]:
    cfg = model_config(model_dir)
    tok = build(read_corpus(rev), cfg["vocab_size"])
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": tok.to_str(pretty=False) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config(cfg), indent=2, ensure_ascii=False) + "\n",
    }
    paths = []
    for name, text in files.items():
        p = out / name
        p.write_text(text, encoding="utf-8")
        paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=MODEL_DIR,
                    help=f"directory to write the tokenizer files to (default {MODEL_DIR.relative_to(ROOT)})")
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR,
                    help="model directory whose config.json gives vocab size and bos/eos ids")
    ap.add_argument("--rev", default=PINNED_REV,
                    help=f"git revision to read the corpus ({', '.join(CORPUS)}) at (default: the pinned "
                         f"{PINNED_REV[:10]}); '{WORKTREE}' reads the files on disk")
    ap.add_argument("--check", action="store_true",
                    help="build into a temporary directory and compare with --out: exit 1 if they differ")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                differ = []
                for p in write(Path(tmp), args.rev, args.model_dir):
                    old = args.out / p.name
                    if not old.exists() or old.read_bytes() != p.read_bytes():
                        differ.append(str(old))
            if differ:
                print(f"differs from a fresh build: {', '.join(differ)}", file=sys.stderr)
                return 1
            print("tokenizer files match a fresh build")
            return 0
        for p in write(args.out, args.rev, args.model_dir):
            print(f"wrote {p} ({p.stat().st_size} bytes)")
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
