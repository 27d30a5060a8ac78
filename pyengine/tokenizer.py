"""Tokenizer: HF `tokenizers` from tokenizer.json, or rebuilt from a GGUF's vocabulary and merges,
plus chat-template rendering (jinja2) and incremental detokenization for streaming."""
from __future__ import annotations

import itertools
import json
import operator
import os
import re
from functools import lru_cache
from collections.abc import Iterator
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# Split regexes for GGUF `tokenizer.ggml.pre` values whose merges were learned on a custom split
# (public facts from the models' tokenizer.json files). Others use GPT-2's ByteLevel regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_CONTROL = 3  # llama.cpp token types
_USER_DEFINED = 4


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _in_byte_alphabet(tokens: list[str]) -> list[bool]:
    """Per token: whether it is spelled in the byte alphabet only. One regex search over all the
    tokens first: in a byte-level BPE vocabulary they all are."""
    outside = re.compile("[^" + re.escape("".join(_byte_alphabet().values())) + "]")
    if outside.search("".join(tokens)) is None:
        return [True] * len(tokens)
    return [outside.search(t) is None for t in tokens]


def _merge_pairs(merges: list[str]) -> list[tuple[str, ...]]:
    """Each "left right" merge split at its first space, as tuple(m.split(" ", 1)) gives it. Where
    every merge holds exactly one space and no newline (a byte-level vocabulary spells both as
    other characters), the pairs come from one split of the joined text: no Python step per merge."""
    text = "\n".join(merges)
    if (merges and text.count(" ") == len(merges) and text.count("\n") == len(merges) - 1
            and all(map(operator.contains, merges, itertools.repeat(" ")))):
        halves = text.replace(" ", "\n").split("\n")
        return list(zip(halves[0::2], halves[1::2]))
    return [tuple(m.split(" ", 1)) for m in merges]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_messages(messages: Any) -> None:
    """A conversation is a non-empty list of {"role": str, "content": str | list | None} dicts;
    anything else is refused here, by position, instead of failing inside the template."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}] has no 'role' string")
        if "content" not in m:
            raise ValueError(f"messages[{i}] has no 'content'")
        if m["content"] is not None and not isinstance(m["content"], (str, list)):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(m['content']).__name__}")


def _token_text(token: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: list[int],
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self._template: jinja2.Template | None = None

    # ---- construction ----
    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """tokenizer.json (+ tokenizer_config.json for chat_template and bos/eos) of a HF directory."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(f"no tokenizer.json in {path}")
        try:
            backend = HFTokenizer.from_file(tok_file)
        except Exception as exc:  # the tokenizers library raises a bare Exception on malformed files
            raise ValueError(f"not a valid tokenizer file: {tok_file} ({_first_line(exc)})") from None
        cfg: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            try:
                with open(cfg_file, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise ValueError(f"cannot read {cfg_file}: {_first_line(exc)}") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{cfg_file} must hold a JSON object, got a JSON {type(cfg).__name__}")
        template = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            try:
                with open(jinja_file, encoding="utf-8") as f:
                    template = f.read()
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read {jinja_file}: {_first_line(exc)}") from None
        if isinstance(template, list):  # named templates: take the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{cfg_file}: chat_template must be a string, got {type(template).__name__}")

        def token_id(key: str) -> int | None:
            text = _token_text(cfg.get(key))
            return None if text is None else backend.token_to_id(text)

        eos = token_id("eos_token")
        return cls(backend, template, token_id("bos_token"), [] if eos is None else [eos])

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> "Tokenizer":
        """Byte-level BPE (tokenizer.ggml.model == "gpt2") from GGUF metadata values."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        in_alphabet = _in_byte_alphabet(tokens)
        spell = _byte_alphabet()
        # Tokens the file wrote as raw text (outside the byte alphabet) are re-spelled byte-wise.
        spelled = tokens if all(in_alphabet) else [t if ok else "".join(spell[b] for b in t.encode("utf-8"))
                                                   for t, ok in zip(tokens, in_alphabet)]
        vocab = dict(zip(spelled, range(len(tokens))))
        merges = _merge_pairs(list(fields.get("tokenizer.ggml.merges", [])))
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))  # ~60 ms in Rust, GIL held
        split = _PRE_SPLITS.get(fields.get("tokenizer.ggml.pre", ""))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        backend.decoder = decoders.ByteLevel()
        types = list(fields.get("tokenizer.ggml.token_type", []))
        # Control tokens (<|im_start|>...) must match whole and count as special; a control token
        # spelled outside the byte alphabet is a converter mislabel and is left alone.
        def of_type(kind: int) -> Iterator[int]:  # the ids of `kind`, found without a Python step per token
            return itertools.compress(range(len(tokens)), map(operator.eq, types, itertools.repeat(kind)))

        backend.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                                    for i in of_type(_CONTROL) if in_alphabet[i]])
        backend.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in of_type(_USER_DEFINED)])
        bos = fields.get("tokenizer.ggml.bos_token_id")
        bos = None if bos is None else int(bos)
        if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
            backend.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)])
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eos_ids = [] if eos is None else [int(eos)]
        eot = fields.get("tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos_ids.append(int(eot))
        return cls(backend, fields.get("tokenizer.chat_template"), bos, eos_ids)

    # ---- encode / decode ----
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def incremental_detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)

    # ---- chat ----
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(message: str) -> None:
                raise ValueError(f"chat template error: {message}")

            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise ValueError(f"the model's chat template does not parse: {_first_line(exc)}") from None
        _check_messages(messages)
        special = {
            "bos_token": "" if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id),
            "eos_token": "" if not self.eos_token_ids else self.backend.id_to_token(self.eos_token_ids[0]),
        }
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special,
                                         **kwargs)
        except jinja2.TemplateError as exc:  # e.g. a field the template reads and these messages lack
            raise ValueError(f"chat template error: {_first_line(exc)}") from None


class IncrementalDetokenizer:
    """Streams text from token ids. Only a short window of recent tokens is re-decoded each step
    (so a byte-level token boundary or a leading-space rule is resolved in context), and text that
    ends in an incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoded context, already emitted
        self.read_offset = 0  # tokens before this are fully emitted

    def add(self, new_ids: list[int] | int) -> str:
        """Feed token ids; return the newly finished text (may be empty)."""
        self.ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """The text not returned yet, an incomplete character at the end included: the request is
        over, so nothing completes it. The final text then equals the decode of all ids, however
        they were fed."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
