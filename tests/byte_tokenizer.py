"""A real byte-level tokenizer (the tokenizers library's BPE with no merges) for tests without a model.

Every byte is one token, and a byte's id is its value, so an ASCII character's id is its code point and a
multi-byte character (say "é") takes several tokens, of which the first decodes to nothing complete.
EOS is the special token "<eos>" (id 256).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS = 256


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in character for each byte value (what byte-level BPE vocabularies use)."""
    ranges = (("!", "~"), ("¡", "¬"), ("®", "ÿ"))
    printable = {byte for low, high in ranges for byte in range(ord(low), ord(high) + 1)}
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


def byte_tokenizer() -> Tokenizer:
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids
