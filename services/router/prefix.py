"""The prompt's prefix-block chain hashes, computed in the router the way the worker will.

Placement needs to know how many leading KV blocks of a prompt each worker already holds. The
workers announce chain hashes of their blocks (``KvEvent``); the router hashes the prompt the
same way: tokenize exactly like the worker's backend, then chain-hash every full block
(``blake2b(parent ‖ model id ‖ token ids as u32 LE)``, as ``libs/engine/hashing.py`` and the
fake backend do). The model id is the model name the workers report in their beats.

One ``PrefixHasher`` per (pool, model), built on first use by ``PrefixHashers``:

- pools on the fake backend: ``WordPrefixHasher`` (the fake's whitespace-word tokenizer);
- real models: ``TokenizerPrefixHasher`` — ``tokenizers`` + the model's chat template rendered
  with jinja2 from ``<models.dir>/<model>``; never ``transformers`` (it imports torch);
- anything else, or a tokenizer that cannot be loaded: ``NullPrefixHasher`` (no overlap; the
  router places by load alone).

Tokenization is cached per message (per prompt string): a conversation's earlier turns and a
shared system prompt are tokenized once. Chat templates separate messages with special tokens,
which the tokenizer never merges across, so tokenizing the pieces between special tokens one by
one gives the same ids as tokenizing the whole text; a probe checks this at load and turns the
per-piece cache off for a tokenizer where it does not hold.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from libs.backend.fake import fake_prompt_text, fake_token_ids
from libs.log import fields
from libs.protocol import ChatMessage, GenerateRequest
from libs.settings import Settings

log = logging.getLogger("strait.router")

ROOT_HASH = 0


def block_hash(parent: int, token_ids: Sequence[int], model_id: str) -> int:
    """Same function as ``libs.engine.hashing.block_hash`` (a unit test holds them equal)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=True))
    h.update(model_id.encode())
    h.update(array("I", token_ids).tobytes())  # NOTE: little-endian hosts (all we support)
    return int.from_bytes(h.digest(), "little", signed=True)


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    memo: dict[tuple[int, tuple[int, ...]], int] | None = None,
) -> list[int]:
    """Hashes of every full block of ``token_ids``. ``memo`` ((parent, block ids) → hash, kept
    by the caller) skips blake2b for blocks seen before: shared prefixes are hashed once."""
    out: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        key = (parent, block)
        h = memo.get(key) if memo is not None else None
        if h is None:
            h = block_hash(parent, block, model_id)
            if memo is not None:
                if len(memo) >= MEMO_BLOCKS:
                    memo.pop(next(iter(memo)))  # oldest first: dicts keep insertion order
                memo[key] = h
        parent = h
        out.append(h)
    return out


# Blocks whose hash each PrefixHashers remembers per (model, block size).
MEMO_BLOCKS = 65536


class PrefixHasher(Protocol):
    def token_ids(self, req: GenerateRequest) -> list[int] | None:
        """The prompt's token ids as the worker will see them; None: cannot tell."""
        ...


class _Lru:
    """A bounded str → token ids cache."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.data: OrderedDict[str, list[int]] = OrderedDict()

    def get(self, key: str, compute: Callable[[str], list[int]]) -> list[int]:
        hit = self.data.get(key)
        if hit is not None:
            self.data.move_to_end(key)
            return hit
        value = compute(key)
        self.data[key] = value
        if len(self.data) > self.entries:
            self.data.popitem(last=False)
        return value


class NullPrefixHasher:
    def token_ids(self, req: GenerateRequest) -> list[int] | None:
        return list(req.prompt_token_ids) if req.prompt_token_ids is not None else None


class WordPrefixHasher:
    """The fake backend's tokenizer: one id per whitespace-separated word."""

    def __init__(self, cache_entries: int = 4096) -> None:
        self._cache = _Lru(cache_entries)

    def token_ids(self, req: GenerateRequest) -> list[int] | None:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is None:
            return _word_ids(fake_prompt_text(req.prompt, None)) or [0]
        # "\n".join of the lines splits on whitespace exactly like the lines one by one.
        ids: list[int] = []
        for m in req.messages:
            ids += self._cache.get(f"{m.role}: {m.content}", _word_ids)
        return ids or [0]


def _word_ids(text: str) -> list[int]:
    return [_word_id(w) for w in text.split()]


@lru_cache(maxsize=65536)
def _word_id(word: str) -> int:
    return fake_token_ids(word)[0]


class TokenizerPrefixHasher:
    """A real model's tokenizer (``tokenizer.json``) and chat template, without transformers."""

    def __init__(self, model_dir: Path, cache_entries: int = 4096) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _read_json(model_dir / "tokenizer_config.json")
        template_file = model_dir / "chat_template.jinja"
        source = template_file.read_text() if template_file.exists() else None
        source = source or config.get("chat_template")
        self._template = _compile_template(source) if isinstance(source, str) else None
        self._special = {
            k: _token_text(v)
            for k, v in config.items()
            if k.endswith("_token") and _token_text(v) is not None
        }
        added = sorted(
            (t.content for t in self.tokenizer.get_added_tokens_decoder().values()),
            key=len,
            reverse=True,
        )
        self._added_ids = {t: self.tokenizer.token_to_id(t) for t in added}
        self._split = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        self._cache = _Lru(cache_entries)
        self.per_piece = self._split is not None and self._probe()
        self.per_line = self._probe_lines()

    def token_ids(self, req: GenerateRequest) -> list[int] | None:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.prompt is not None:
            if self.per_line:
                return self._encode_lines(req.prompt)
            return self._cache.get(req.prompt, self._encode_prompt)
        if self._template is None:
            return None
        return self.encode_text(self.render(req.messages or []))

    def render(self, messages: list[ChatMessage]) -> str:
        assert self._template is not None
        text: str = self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            **self._special,
        )
        return text

    def encode_text(self, text: str) -> list[int]:
        """Ids of templated text (no special tokens added), piece by piece when that is exact."""
        if not self.per_piece:
            return self._encode_plain(text)
        assert self._split is not None
        ids: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self._added_ids.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids += self._cache.get(piece, self._encode_plain)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def _encode_lines(self, text: str) -> list[int]:
        """A raw prompt line by line, each line cached: a shared document costs one lookup per
        line, only new lines are tokenized. Exact when ``_probe_lines`` says so (byte-level
        BPE pre-tokenizers never merge across a lone newline between two non-space
        characters)."""
        pieces = [p for p in _LINE_START.split(text) if p]
        if not pieces:
            return self._encode_prompt(text)
        ids = list(self._cache.get(pieces[0], self._encode_prompt))
        for piece in pieces[1:]:
            ids += self._cache.get(piece, self._encode_plain)
        return ids

    def _probe_lines(self) -> bool:
        """Line-wise encoding equals whole-text encoding on texts that stress the boundary."""
        probes = [
            "Read this.\nThe river\n  runs. Then\n\nwhat?\n \nok",
            "def f(x):\n    return x*2\nprint(f(3))\n",
            "Très bien\n12345\n<b>x</b>\n\t tab\nend",
        ]
        try:
            ok = all(self._encode_lines(t) == self._encode_prompt(t) for t in probes)
        except Exception:
            ok = False
        self._cache.data.clear()
        return ok

    def _probe(self) -> bool:
        probe = [
            ChatMessage("system", "You are terse.  Answer in French:\n"),
            ChatMessage("user", " Hello there!\n\n  How's it going? 12345 "),
            ChatMessage("assistant", "Très bien, merci."),
            ChatMessage("user", "def f(x):\n    return x*2"),
        ]
        try:
            text = self.render(probe) if self._template is not None else "a<b>c"
        except Exception:
            return False
        self.per_piece = True
        ok = self.encode_text(text) == self._encode_plain(text)
        self._cache.data.clear()
        return ok


# Where a raw prompt is cut for line-wise caching: after a single newline that ends a non-blank
# line, before a non-space (a run of newlines at a piece's end would tokenize as one token).
_LINE_START = re.compile(r"(?<=\S\n)(?=\S)")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_text(v: object) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def _compile_template(source: str) -> Any:
    """The template environment transformers uses for chat templates."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class PrefixHashers:
    """The hasher of each (pool, model), built on first use; chain hashes per request."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._by_key: dict[tuple[str, str], PrefixHasher] = {}
        self._memos: dict[tuple[str, int], dict[tuple[int, tuple[int, ...]], int]] = {}

    def hasher(self, pool: str, model: str) -> PrefixHasher:
        key = (pool, model)
        h = self._by_key.get(key)
        if h is None:
            h = self._by_key[key] = self._build(pool, model)
        return h

    def chain(self, ids: Sequence[int], block_size: int, model: str) -> list[int]:
        memo = self._memos.setdefault((model, block_size), {})
        return chain_hashes(ids, block_size, model, memo)

    def _build(self, pool: str, model: str) -> PrefixHasher:
        entries = self.settings.router.tokenize_cache_entries
        cfg = self.settings.pool(pool)
        if cfg is not None and cfg.backend == "fake":
            return WordPrefixHasher(entries)
        model_dir = Path(self.settings.models.dir) / model
        try:
            return TokenizerPrefixHasher(model_dir, entries)
        except Exception as e:
            log.warning(
                "no tokenizer for prefix overlap; placing by load only",
                extra=fields(pool=pool, model=model, model_dir=str(model_dir), error=repr(e)),
            )
            return NullPrefixHasher()
