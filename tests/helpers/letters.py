"""A tokenizer of letters for the engine's text and stop-string tests: token id i is chr(97 + i % 26).

    model.tokenizer = LetterTokenizer()
    LetterTokenizer().decode([0, 1, 2]) == "abc"
"""

from __future__ import annotations


class LetterTokenizer:
    """Token id i is the letter chr(97 + i % 26): enough to test text and stop strings."""

    class _Encoding:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text):
        return self._Encoding([ord(c) - 97 for c in text])

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)
