"""Tokenizers: text <-> token ids, chat prompts, streaming detokenization and stop strings.

The public interface, what code outside this package imports:

* `TokenizerLike`: the members the engine, the server, the tools and the detokenizer use;
  both tokenizers below satisfy it.
* `Tokenizer` (tokenizer.py): GGUF vocabularies (rebuilt in gguf_vocab.py) and tokenizer.json,
  Jinja chat templates (rendered within bounds in chat_template.py).
* `NanochatTokenizer` (nanochat.py): nanochat's tiktoken tokenizer and conversation rendering.
* `IncrementalDetokenizer`, `StopMatcher` (detokenizer.py): ids to streamed text, stop strings.
* `BYTE_TO_UNICODE`, `UNICODE_TO_BYTE` (byte_level.py): GPT-2's byte-level alphabet, for turning
  a vocabulary entry back into its bytes.
* `byte_level_pre_tokenizer` (gguf_vocab.py): the pre-tokenizer for a GGUF `tokenizer.ggml.pre`.

This package sits at the bottom with the loaders: it imports nothing of nanoinfer but
`nanoinfer.errors`.
"""
from .byte_level import BYTE_TO_UNICODE, UNICODE_TO_BYTE
from .detokenizer import IncrementalDetokenizer, StopMatcher
from .gguf_vocab import byte_level_pre_tokenizer
from .nanochat import NanochatTokenizer
from .protocol import TokenizerLike
from .tokenizer import Tokenizer

__all__ = [
    "BYTE_TO_UNICODE", "UNICODE_TO_BYTE", "IncrementalDetokenizer", "NanochatTokenizer", "StopMatcher",
    "Tokenizer", "TokenizerLike", "byte_level_pre_tokenizer",
]
