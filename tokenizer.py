"""Tokenizers, as Megatron's megatron/training/tokenizer: GPT-2's byte-level BPE (vocab.json +
merges.txt, byte for byte the Hugging Face tokenizer's ids), a null tokenizer (text is
space-separated ids) and a byte tokenizer. Pure Python; files that are not what they should be
raise ConfigError naming the file and line."""
import functools
import json
import re
import sys
import unicodedata

from settings.config import ConfigError


def read_lines(path):
    """The lines of a UTF-8 text file; a byte that is not UTF-8 raises ConfigError naming its
    line."""
    # surrogateescape: a byte that is not UTF-8 is read as a lone surrogate, U+DC80..U+DCFF
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for n, line in enumerate(f, 1):
            bad = re.search("[\udc80-\udcff]", line)
            if bad:
                byte = ord(bad.group()) - 0xdc00
                raise ConfigError(f"{path}:{n}: byte {byte:#04x} is not UTF-8: save the file as "
                                  "UTF-8")
            yield line


def _bytes_to_unicode():
    """GPT-2's reversible byte -> printable unicode char table (openai/gpt-2 encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # mapped to chr(256), chr(257), ...
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


@functools.lru_cache(maxsize=None)
def _gpt2_pattern():
    r"""openai/gpt-2's pre-tokenization regex written for the stdlib `re`.

    \p{L} = word chars minus digits, '_' and the non-decimal numbers (Nl, No);
    \p{N} = decimal digits (\d is Unicode Nd) plus Nl and No.
    """
    nl_no = "".join(re.escape(chr(c)) for c in range(sys.maxunicode + 1)
                    if unicodedata.category(chr(c)) in ("Nl", "No"))
    letter, number, other = rf"[^\W\d_{nl_no}]", rf"[\d{nl_no}]", rf"(?:[^\s\w{nl_no}]|_)"
    return re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?{letter}+| ?{number}+| ?{other}+|\s+(?!\S)|\s+")


class GPT2BPETokenizer:
    """Megatron's GPT2BPETokenizer: GPT-2 byte-level BPE (same algorithm as openai/gpt-2
    encoder.py)."""

    def __init__(self, vocab_file, merge_file):
        try:
            self.encoder = json.loads("".join(read_lines(vocab_file)))
            self.eod = self.encoder["<|endoftext|>"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{vocab_file}: not a JSON object of token ids with "
                              "\"<|endoftext|>\": give GPT-2's vocab.json (--vocab-file)") from None
        self.decoder = {i: t for t, i in self.encoder.items()}
        # line 1 is the "#version" header; each other line is two tokens whose join is in the vocab
        merges = [(n, tuple(line.split())) for n, line in enumerate(read_lines(merge_file), 1)
                  if n > 1 and line.strip()]
        for n, pair in merges:
            if len(pair) != 2 or "".join(pair) not in self.encoder:
                raise ConfigError(f"{merge_file}:{n}: {' '.join(pair)!r} is not two tokens of "
                                  f"{vocab_file} joined: give the merges.txt of this vocab "
                                  "(--merge-file)")
        if not merges:
            raise ConfigError(f"{merge_file}: no merges after line 1: give GPT-2's merges.txt "
                              "(--merge-file)")
        self.bpe_ranks = {pair: i for i, (_, pair) in enumerate(merges)}
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.pattern = _gpt2_pattern()
        self.cache = {}
        self.vocab_size = len(self.encoder)

    def _bpe(self, word):
        """Merge the lowest-ranked adjacent pair until no known merge is left; returns ids."""
        parts = list(word)
        while len(parts) > 1:
            pairs = set(zip(parts, parts[1:]))
            best = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return [self.encoder[p] for p in parts]

    def encode(self, text):
        ids = []
        for word in self.pattern.findall(text):
            if word not in self.cache:
                # the word's UTF-8 bytes as GPT-2's printable characters
                chars = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
                self.cache[word] = self._bpe(chars)
            ids.extend(self.cache[word])
        return ids

    def decode(self, ids):
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


class NullTokenizer:
    """Megatron's NullTokenizer: text is space-separated ids; eod is the id after the last one."""

    def __init__(self, vocab_size):
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def encode(self, text):
        """Space-separated ids -> ids, each below vocab_size (the .bin's dtype holds no other:
        data.optimal_dtype)."""
        ids = [int(x) for x in text.split()]
        wrong = [i for i in ids if not 0 <= i < self.vocab_size]
        if wrong:
            raise ValueError(f"id {wrong[0]} is not in 0..{self.vocab_size - 1}")
        return ids

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, eod = 256 (handy for tests and tiny runs)."""

    eod, vocab_size = 256, 257

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


def build_tokenizer(tokenizer_type, vocab_file=None, merge_file=None, vocab_size=None):
    """Megatron's build_tokenizer for the three supported --tokenizer-type values."""
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise ConfigError("GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ConfigError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    raise ConfigError(f"unknown --tokenizer-type {tokenizer_type!r}: use one of "
                      "GPT2BPETokenizer, NullTokenizer, ByteTokenizer")


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: tokenizer.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
