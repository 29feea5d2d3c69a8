"""GPT-2's byte-level alphabet: the reversible byte <-> printable character table in which
byte-level BPE vocabularies (GGUF "gpt2" vocabularies, tokenizer.json ByteLevel, tiktoken's
tokens as `id_to_token` spells them) write their tokens."""
from __future__ import annotations


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies:
    printable Latin-1 bytes stand for themselves, the other 68 bytes map to U+0100 onward."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


# Read-only by convention: shared by the vocabulary rebuilding, nanochat's tokenizer and the
# server's logprob bytes.
BYTE_TO_UNICODE: dict[int, str] = _byte_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}
