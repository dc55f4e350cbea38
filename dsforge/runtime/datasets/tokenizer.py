"""The job's tokenizer (model.pretrained's own, or one named by path), loaded with `tokenizers`; chat
rendering through transformers' chat template, with the character spans of the assistant's replies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsforge.compiler.frontend.data_files import (
    DataFileError,
    TokenizerFiles,
    read_tokenizer,
    tokenizer_digest,
)
from dsforge.runtime.errors import DataError

#: End-of-text tokens of common tokenizers, tried in order when no configuration names one.
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class JobTokenizer:
    """A tokenizer.json with its EOS id and a digest of every file that changes its output (the cache key)."""

    def __init__(self, files: TokenizerFiles, pretrained: str | None = None) -> None:
        from tokenizers import Tokenizer

        self.files = files
        self.tok = Tokenizer.from_file(str(files.file))
        self.vocab = files.vocab
        self.eos = self._eos(pretrained)
        self.digest = tokenizer_digest(files)
        self._hf: Any = None

    def _eos(self, pretrained: str | None) -> int:
        """The id documents end with: tokenizer_config's eos_token, config.json's eos_token_id, or a known
        name."""
        config = _json(self.files.directory / "tokenizer_config.json")
        token = config.get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and self.tok.token_to_id(token) is not None:
            return int(self.tok.token_to_id(token))
        for directory in (self.files.directory, Path(pretrained) if pretrained else None):
            if directory is not None:
                eid = _json(directory / "config.json").get("eos_token_id")
                eid = eid[0] if isinstance(eid, list) and eid else eid
                if isinstance(eid, int):
                    return eid
        for name in _EOS_NAMES:
            if self.tok.token_to_id(name) is not None:
                return int(self.tok.token_to_id(name))
        raise DataError(f"{self.files.file}: no end-of-text token (tokenizer_config.json names no eos_token "
                        f"and none of {', '.join(_EOS_NAMES)} is in the "
                        f"vocabulary); packing puts one between documents")

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with the tokenizer's own special tokens (a BOS where it adds one)."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=True)]

    def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of a chat-rendered text (its template already wrote the special
        tokens)."""
        e = self.tok.encode(text, add_special_tokens=False)
        return e.ids, e.offsets

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        """The conversation through the tokenizer's chat template (transformers' apply_chat_template)."""
        if self._hf is None:
            template = self.files.chat_template
            if template is None:
                raise DataError(f"training.data.format is chat but {self.files.directory} has no chat "
                                f"template (DSF624)")
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            if (self.files.directory / "tokenizer_config.json").is_file():
                self._hf = AutoTokenizer.from_pretrained(str(self.files.directory))
            else:
                self._hf = PreTrainedTokenizerFast(tokenizer_file=str(self.files.file))
            self._hf.chat_template = template
        return str(self._hf.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=generation_prompt))


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_tokenizer(tokenizer: str, pretrained: str | None) -> JobTokenizer:
    """The job's tokenizer; DataError (naming the rule validate reports) when it cannot be read."""
    try:
        return JobTokenizer(read_tokenizer(tokenizer, pretrained), pretrained)
    except DataFileError as exc:
        raise DataError(f"{exc.message} ({exc.rule}); fix: {exc.fix}") from exc
