"""Data pipeline for Megatron-style GPT pretraining: pure Python + numpy, no MindSpore.

tokenizer -> tools/preprocess_data.py (.bin/.idx indexed dataset) -> GPTDataset
(document/sample/shuffle indices) -> BlendedDataset of several corpora (blending indices) ->
MegatronPretrainingSampler or MegatronPretrainingRandomSampler (micro-batches per dp rank).
"""
import collections
import contextlib
import functools
import glob
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
import signal
import stat
import struct
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import numpy as np

from settings.cli import REQUIRED, parse_command
from settings.config import PER_SPLIT_PATHS, ConfigError, parse_blend, parse_split
from tokenizer import build_tokenizer, read_lines


PROC_STATUS = "/proc/self/status"     # "Umask:", read without setting it (proc(5): Linux 4.7 on)
_UMASK = threading.Lock()             # two threads setting it at once could leave it set


def _new_file_mode():
    """The mode open() gives a new file: 0o666 less the umask. os.umask reads the umask only by
    setting it, for the whole process; where /proc does not tell it, it is set to 0o077 for that
    moment, so a file another thread creates meanwhile is more private, never less."""
    try:
        with open(PROC_STATUS) as f:
            masks = [line.split()[1] for line in f if line.startswith("Umask:")]
    except OSError:
        masks = []
    if masks:
        return 0o666 & ~int(masks[0], 8)
    with _UMASK:
        mask = os.umask(0o077)
        os.umask(mask)
    return 0o666 & ~mask


def _open_temporary(path):
    """(binary file open for writing, its name): a new file beside `path` that os.replace moves
    over it, named `<path>.tmp<pid>.<random>` by tempfile.mkstemp: O_EXCL, so never a file or
    symlink planted there, and one name per call, so threads and processes writing `path` at once
    each have their own. Its mode is that of the file at `path`, or a new file's. The temporary
    files of this user's writes of `path` that a kill cut short (their process gone) go first."""
    folder, name = os.path.split(os.path.abspath(path))
    _remove_cut_writes(folder, name)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = _new_file_mode()
    fd, tmp = tempfile.mkstemp(prefix=f"{name}.tmp{os.getpid()}.", dir=folder)     # mode 0600
    try:
        os.fchmod(fd, mode)
        return os.fdopen(fd, "wb"), tmp
    except BaseException:
        os.close(fd)
        os.remove(tmp)
        raise


def _remove_cut_writes(folder, name):
    """Remove `folder`/`name`.tmp<pid>.<random>, the temporary file of a write whose process was
    killed before its rename (kill -9, SIGTERM's default), when it is this user's regular file and
    process <pid> has ended; anything else of that name is left alone."""
    for path in glob.glob(os.path.join(glob.escape(folder), glob.escape(name) + ".tmp*.*")):
        pid = os.path.basename(path)[len(name) + 4:].split(".")[0]
        try:
            info = os.lstat(path)
            if not (pid.isdigit() and stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()):
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        except (FileNotFoundError, PermissionError):
            continue


def fsync_folder(folder):
    """A folder's entries to disk: a file created, renamed or removed in it survives a power loss
    only once its folder is synced (fsync of the file keeps its bytes, not its name)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, content, durable=True):
    """Write `path` whole or not at all, the project's one way to write a file in place (data
    caches, checkpoints, torch_format, Hugging Face files): `content`, a str (UTF-8), bytes, or a
    function that writes to a binary file, goes to a temporary file beside it (_open_temporary),
    which is synced to disk and renamed over `path` (os.replace), then the folder is synced.
    Readers never see a half-written file, a crash or a power loss leaves the old one or the new
    one, and a failed write leaves nothing behind. Not `durable` (what a run rewrites as it goes
    and only watches it with: the curves, the flight records), nothing is synced: a crash of the
    process still leaves the old file or the new one, a power loss may leave neither."""
    if isinstance(content, str):
        content = content.encode()
    f, tmp = _open_temporary(path)
    try:
        with f:
            if isinstance(content, bytes):
                f.write(content)
            else:
                content(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    if durable:
        fsync_folder(os.path.dirname(os.path.abspath(path)))


# ----------------------------------------------------------------------------- indexed dataset

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}
_CODES = {np.dtype(t): c for c, t in _DTYPES.items()}


def optimal_dtype(vocab_size):
    """Megatron's DType.optimal_dtype: the token dtype of the .bin file."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetBuilder:
    """Megatron's IndexedDatasetBuilder: appends token arrays to .bin, writes the .idx at finalize.

    Both files are written under temporary names (_open_temporary) and moved into place by
    finalize(), synced to disk first (ensure_preprocessed's sidecar, written after them, says
    they are complete); discard() removes them instead, or takes back what finalize placed.
    """

    def __init__(self, bin_path, dtype=np.uint16):
        self.bin_path, self.dtype = bin_path, np.dtype(dtype)
        self._bin, self._bin_tmp = _open_temporary(bin_path)
        self._idx_tmp = None
        self.sequence_lengths, self.document_indices = [], [0]
        self._placed = []

    def add_document(self, tokens, lengths=None):
        """One document made of len(lengths) sequences (one sequence if lengths is None)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend([len(arr)] if lengths is None else lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path):
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)  # byte offset of each sequence in .bin
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        # magic, version 1, dtype code, sequence count, document count (34 bytes), then the arrays
        header = _INDEX_HEADER + struct.pack("<QBQQ", 1, _CODES[self.dtype], len(lengths),
                                             len(self.document_indices))
        documents = np.asarray(self.document_indices, dtype=np.int64)
        f, self._idx_tmp = _open_temporary(idx_path)
        with f:
            f.write(header + lengths.tobytes() + pointers.tobytes() + documents.tobytes())
            f.flush()
            os.fsync(f.fileno())
        # both files complete before either moves, so the window for a .bin without its .idx
        # is two renames; noted before each, so discard() can take back a pair left incomplete
        for tmp, path in ((self._bin_tmp, self.bin_path), (self._idx_tmp, idx_path)):
            self._placed.append(path)
            os.replace(tmp, path)
        fsync_folder(os.path.dirname(os.path.abspath(idx_path)))

    def discard(self):
        self._bin.close()
        for path in [self._bin_tmp, self._idx_tmp, *self._placed]:
            if path and os.path.exists(path):
                os.remove(path)


CHUNK = 1 << 20   # index entries checked at once: 8 MB per temporary array, whatever the corpus


def _check_sequences(lengths, pointers, itemsize, where):
    """Each sequence's length and pointer as Megatron's _IndexWriter writes them: lengths
    [n_seq] int32 not negative, pointers [n_seq] int64 back to back (pointer 0 is 0, each next
    one is the last plus its length * itemsize), the last ending within the .bin. Checked in
    chunks, vectorised: the first wrong sequence is one ConfigError. Returns the byte after the
    last sequence."""
    end = 0                                   # where the next sequence starts
    for start in range(0, len(lengths), CHUNK):
        n = lengths[start:start + CHUNK].astype(np.int64) * itemsize     # [chunk] bytes
        ends = end + np.cumsum(n)             # no overflow: |n| < 2**34, end <= the .bin's size
        starts = np.concatenate([[end], ends[:-1]])
        bad = (n < 0) | (pointers[start:start + CHUNK] != starts) | (ends > where.size)
        if bad.any():
            k = int(np.argmax(bad))
            i = start + k
            raise ConfigError(_sequence_error(i, int(lengths[i]), int(pointers[i]),
                                              int(starts[k]), int(ends[k]), where))
        end = int(ends[-1])
    return end


def _sequence_error(i, length, pointer, start, end, where):
    """The line for sequence i, the first that is wrong (those before it are right)."""
    if length < 0:
        return f"{where.idx}: sequence {i} has a negative length, {length}: {where.fix}"
    if pointer != start:
        after = f"where sequence {i - 1} ends" if i else "the start of the file"
        return (f"{where.idx}: sequence {i} starts at byte {pointer} of {where.bin}, not at "
                f"byte {start}, {after} (Megatron writes them back to back): {where.fix}")
    return (f"{where.bin}: truncated, {where.size} bytes, but sequence {i} of {where.idx} ends "
            f"at byte {end}: {where.fix}")


def _check_documents(documents, n_seq, where):
    """The document index [n_doc] int64 as Megatron writes it: 0, then the sequence each document
    ends before, never going back nor past the n_seq sequences; and no more documents than
    sequences: GPTDataset reads document k as sequence k (preprocess writes one sequence per
    document)."""
    if len(documents) == 0 or documents[0] != 0:
        first = documents[0] if len(documents) else "missing"
        raise ConfigError(f"{where.idx}: the document index starts at {first}, not 0: "
                          f"{where.fix}")
    for start in range(1, len(documents), CHUNK):
        ends = documents[start:start + CHUNK]
        before = documents[start - 1:start - 1 + len(ends)]
        bad = (ends < before) | (ends > n_seq)
        if bad.any():
            k = int(np.argmax(bad))
            wrong = (f"before its start, sequence {before[k]}" if ends[k] < before[k]
                     else f"past the {n_seq} sequences")
            raise ConfigError(f"{where.idx}: document {start + k - 1} ends at sequence "
                              f"{ends[k]}, {wrong}: {where.fix}")
    if len(documents) - 1 > n_seq:
        raise ConfigError(f"{where.idx}: {len(documents) - 1} documents in {n_seq} sequences; "
                          f"this reader takes one sequence per document: {where.fix}")


class IndexedDataset:
    """Megatron's (mmap) IndexedDataset read from `<path_prefix>.bin` and `<path_prefix>.idx`."""

    def __init__(self, path_prefix):
        self.path_prefix = path_prefix
        idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
        fix = f"re-run preprocess to rebuild {path_prefix}.bin/.idx"
        with open(idx_path, "rb") as f:
            header = f.read(34)
        if len(header) < 34 or header[:9] != _INDEX_HEADER:
            raise ConfigError(f"{idx_path}: bad magic or truncated header, not a Megatron MMIDIDX "
                              f"index: {fix}")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[9:])
        if version != 1 or code not in _DTYPES:
            raise ConfigError(f"{idx_path}: unsupported version {version} or dtype code {code}: "
                              f"{fix}")
        self.dtype = np.dtype(_DTYPES[code])
        need = 34 + n_seq * 12 + n_doc * 8
        if os.path.getsize(idx_path) < need:
            raise ConfigError(f"{idx_path}: truncated, {os.path.getsize(idx_path)} bytes but the "
                              f"header implies {need}: {fix}")
        idx = np.memmap(idx_path, mode="r", order="C")
        # after the header: int32 lengths [n_seq], int64 byte pointers [n_seq], int64 [n_doc]
        self.sequence_lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=34)
        self.sequence_pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq,
                                               offset=34 + n_seq * 4)
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=n_doc,
                                              offset=34 + n_seq * 12)
        bin_size = os.path.getsize(bin_path)
        where = SimpleNamespace(idx=idx_path, bin=bin_path, size=bin_size, fix=fix)
        # the byte after the last sequence: every length and pointer is trusted from here on
        self.end = _check_sequences(self.sequence_lengths, self.sequence_pointers,
                                    self.dtype.itemsize, where)
        _check_documents(self.document_indices, n_seq, where)
        self._bin = np.memmap(bin_path, mode="r", order="C") if bin_size else np.zeros(0, np.uint8)

    def __len__(self):
        return len(self.sequence_lengths)

    def check_token_ids(self, vocab_size, tokenizer):
        """Every token id of the sequences below `vocab_size`, the vocabulary of `tokenizer` (its
        name), and not negative: one pass over the .bin, chunked (docs/training.md gives its
        cost). A corpus tokenized with another tokenizer is one ConfigError naming the largest
        id, not an embedding lookup failing deep in MindSpore."""
        tokens = np.frombuffer(self._bin, dtype=self.dtype, count=self.end // self.dtype.itemsize)
        low, high = 0, -1
        for start in range(0, len(tokens), 64 * CHUNK):
            chunk = tokens[start:start + 64 * CHUNK]
            high = max(high, int(chunk.max()))
            if self.dtype.kind != "u":
                low = min(low, int(chunk.min()))
        if high >= vocab_size or low < 0:
            which = f"{high}, the largest," if high >= vocab_size else f"{low}, the smallest,"
            raise ConfigError(f"{self.path_prefix}.bin: token id {which} is outside the "
                              f"vocabulary of {tokenizer}, {vocab_size} ids: preprocess the "
                              f"corpus with {tokenizer}, or train with the tokenizer that made it")

    def get(self, i, offset=0, length=None):
        """Tokens of sequence i from `offset`, `length` of them (default: to the end)."""
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    __getitem__ = get


# ----------------------------------------------------------------------------- preprocessing

def _encode_document(tokenizer, document, append_eod):
    """("path:line", one string per json key) -> one token list per key, and the bytes read.
    The tokenizer is the run's own, never the module's: two runs at once in one process (the
    suite's threads) would encode with each other's."""
    where, texts = document
    eod = [tokenizer.eod] if append_eod else []
    try:
        ids = [tokenizer.encode(text) + eod for text in texts]
        return ids, sum(len(t.encode("utf-8")) for t in texts)
    except ValueError as e:
        # NullTokenizer: a word that is not an integer id
        message = f"{where}: {e}: NullTokenizer reads space-separated integer ids"
        raise ConfigError(message) from None


def _json_texts(line, keys, where):
    """One jsonl line -> its strings under `keys`; anything else raises ConfigError naming the
    line."""
    try:
        # without the newline, a value missing at the end is named by its column, not by
        # "line 2 column 1"
        obj = json.loads(line.rstrip("\n"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: invalid JSON ({e.msg}, column {e.colno}): write one JSON "
                          "object per line") from None
    missing = [k for k in keys if not isinstance(obj, dict) or not isinstance(obj.get(k), str)]
    if missing:
        raise ConfigError(f"{where}: no string under {missing[0]!r} in {line.strip()[:60]}: fix "
                          "the line or name the keys to read with --json-keys")
    return [obj[k] for k in keys]


def _read_documents(path, keys):
    """Yield ("path:line", one string per key) per document: jsonl, or blank-line separated
    text."""
    if path.endswith((".json", ".jsonl")):
        for n, line in enumerate(read_lines(path), 1):
            if line.strip():
                yield f"{path}:{n}", _json_texts(line, keys, f"{path}:{n}")
        return
    n = 1
    # split at blank lines, keeping them: documents and the separators between them alternate
    for piece in re.split(r"(\n\s*\n)", "".join(read_lines(path))):
        if piece.strip():  # not a separator nor an empty document
            yield f"{path}:{n}", [piece.strip("\n")]
        n += piece.count("\n")


PREPROCESS_FLAGS = {  # Megatron's tools/preprocess_data.py flags
    "--input": (REQUIRED, list, "jsonl, or text with blank-line separated documents; several "
                                "files or a glob ('data/*.txt'): one prefix each"),
    "--output-prefix": (REQUIRED, str, "writes <prefix>_<key>_document.bin/.idx (several "
                                       "inputs: <prefix>_<input name>_<key>_document)"),
    "--json-keys": (["text"], list, "jsonl keys to tokenize"),
    "--tokenizer-type": (REQUIRED, str, "GPT2BPETokenizer, NullTokenizer or ByteTokenizer"),
    "--vocab-file": (None, str, "GPT-2 vocab.json"),
    "--merge-file": (None, str, "GPT-2 merges.txt"),
    "--vocab-size": (None, int, "NullTokenizer: ids below it"),
    "--append-eod": (None, bool, "end every document with the EOD token"),
    "--workers": (1, int, "tokenizing processes"),
    "--log-interval": (1000, int, "documents between progress lines"),
}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C in preprocess, its files removed; str() is the line to print (train.py exits 130)."""


def _inputs(patterns, output_prefix):
    """(input file, output prefix) per input: the files and globs given, in order, each once;
    several inputs name their outputs after the input files (Megatron's own tool takes one)."""
    files = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not found:
            raise ConfigError(f"preprocess: --input {pattern} matches no file: give existing "
                              "files or a glob that matches some")
        files += [f for f in found if f not in files]
    if len(files) == 1:
        return [(files[0], output_prefix)]
    stems = [os.path.splitext(os.path.basename(f))[0] for f in files]
    for stem in stems:
        if stems.count(stem) > 1:
            twins = [f for f, s in zip(files, stems) if s == stem]
            raise ConfigError(f"preprocess: --input {twins[0]} and {twins[1]} would both write "
                              f"{output_prefix}_{stem}_*: give them different file names or "
                              "preprocess them apart")
    return [(f, f"{output_prefix}_{stem}") for f, stem in zip(files, stems)]


def preprocess_main(argv):
    """Megatron's tools/preprocess_data.py: text -> `<prefix>_<key>_document.{bin,idx}`, for each
    input file (each its own corpus, as a blend names them: --data-path 0.3 A 0.7 B).

    Each document becomes one sequence. Returns the list of written data prefixes; each input's
    files are written whole or not at all.
    """
    options, _ = parse_command("preprocess", argv, PREPROCESS_FLAGS,
                               about="Tokenize text into Megatron .bin/.idx files.")
    args = SimpleNamespace(**options)
    written = []
    for path, output_prefix in _inputs(args.input, args.output_prefix):
        keys = args.json_keys if path.endswith((".json", ".jsonl")) else ["text"]
        prefixes = [f"{output_prefix}_{k}_document" for k in keys]
        try:
            _tokenize(args, path, output_prefix, keys, prefixes)
        except KeyboardInterrupt:
            names = ", ".join(f"{pre}.bin/.idx" for pre in prefixes)
            message = f"preprocess: interrupted; nothing written ({names} not created)"
            if written:
                message += f"; complete: {', '.join(written)}"
            raise Interrupted(message) from None
        written += prefixes
    return written


def _tokenizing_worker(pipe, tokenizer_kwargs, append_eod):
    """One preprocess worker: lists of documents in, their [(ids, bytes)] out, until None.
    Ctrl-C reaches the whole process group; only the parent acts on it (it ends the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tokenizer = build_tokenizer(**tokenizer_kwargs)      # Megatron's Encoder.initializer
    for chunk in iter(pipe.recv, None):
        try:
            pipe.send([_encode_document(tokenizer, document, append_eod) for document in chunk])
        except Exception as e:                    # raised in the parent, as Pool.imap does
            pipe.send(e)


class TokenizingWorkers:
    """`n` tokenizing processes, each with a pipe of its own: chunk k of the documents goes to
    worker k % n and the results come back in order.

    No lock is shared between processes, so the workers can be killed at any point (Ctrl-C, a bad
    line). multiprocessing.Pool cannot be: its terminate() hangs when it stops a worker that holds
    the result queue's lock. One chunk in flight per worker: the parent sends to a worker only
    after reading its result, so neither can wait on the other behind a full pipe.
    """

    def __init__(self, n, tokenizer_kwargs, append_eod):
        self.processes, self.pipes = [], []
        for _ in range(n):
            pipe, worker_end = multiprocessing.Pipe()
            process = multiprocessing.Process(target=_tokenizing_worker, daemon=True,
                                              args=(worker_end, tokenizer_kwargs, append_eod))
            process.start()
            worker_end.close()
            self.processes.append(process)
            self.pipes.append(pipe)

    def encode(self, documents, chunk_size=32):
        """Yield (ids per key, bytes read) for each of `documents`, in their order."""
        chunks = iter(lambda: list(itertools.islice(documents, chunk_size)), [])
        busy = collections.deque()                # the pipes of the workers holding a chunk
        for pipe, chunk in zip(self.pipes, chunks):
            pipe.send(chunk)
            busy.append(pipe)
        while busy:
            pipe = busy.popleft()
            results = pipe.recv()
            if isinstance(results, Exception):
                raise results
            chunk = next(chunks, None)
            if chunk is not None:                 # its next chunk, to the back of the line
                pipe.send(chunk)
                busy.append(pipe)
            yield from results

    def close(self):
        """Kill and reap every worker: each waits for a chunk or works on one no longer needed."""
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.join()
        for pipe in self.pipes:
            pipe.close()


def _tokenize(args, path, output_prefix, keys, prefixes):
    """preprocess_main's work for the input `path`: `<prefix>.bin/.idx` for every prefix, or none
    of them."""
    tok_kwargs = dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, vocab_size=args.vocab_size)
    tokenizer = build_tokenizer(**tok_kwargs)
    dtype = optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    docs = _read_documents(path, keys)
    encode = functools.partial(_encode_document, tokenizer, append_eod=args.append_eod)
    workers, builders = None, []
    t0, total_bytes, n = time.time(), 0, 0
    try:
        if args.workers > 1:
            workers = TokenizingWorkers(args.workers, tok_kwargs, args.append_eod)
        for pre in prefixes:
            builders.append(IndexedDatasetBuilder(pre + ".bin", dtype))
        results = workers.encode(docs) if workers else map(encode, docs)
        for n, (doc_ids, n_bytes) in enumerate(results, 1):
            total_bytes += n_bytes
            for builder, ids in zip(builders, doc_ids):
                builder.add_document(ids)
            if n % args.log_interval == 0:
                dt = time.time() - t0
                print(f"Processed {n} documents ({n / dt:.1f} docs/s, "
                      f"{total_bytes / dt / 2**20:.2f} MB/s).", flush=True)
        if n == 0:
            raise ConfigError(f"{path}: no documents: give jsonl (one JSON object per line) "
                              "or text (documents separated by blank lines)")
        for builder, pre in zip(builders, prefixes):
            builder.finalize(pre + ".idx")
    except BaseException:                         # a bad line, Ctrl-C: keep no half file
        for builder in builders:
            builder.discard()
        raise
    finally:
        if workers:
            workers.close()


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def ensure_preprocessed(input_path, output_prefix, tokenizer_type, vocab_file=None,
                        merge_file=None, vocab_size=None, append_eod=True, workers=1):
    """Run preprocess_main unless `<prefix>_text_document.{bin,idx}` already match the source.

    The sidecar `<prefix>_text_document.src.json` holds the sha256 of the source and the
    tokenizer identity; it is written last, so an interrupted run is redone. Returns the prefix.
    """
    prefix = f"{output_prefix}_text_document"
    sidecar = prefix + ".src.json"
    identity = {"source_sha256": _sha256(input_path), "tokenizer_type": tokenizer_type,
                "vocab_sha256": _sha256(vocab_file) if vocab_file else None,
                "merge_sha256": _sha256(merge_file) if merge_file else None,
                "vocab_size": vocab_size, "append_eod": bool(append_eod)}
    try:
        with open(sidecar) as f:
            up_to_date = json.load(f) == identity
    except (OSError, ValueError):
        up_to_date = False
    if up_to_date and os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
        return prefix
    if os.path.exists(sidecar):
        os.remove(sidecar)
    argv = ["--input", input_path, "--output-prefix", output_prefix,
            "--tokenizer-type", tokenizer_type, "--workers", str(workers)]
    optional = (("--vocab-file", vocab_file), ("--merge-file", merge_file),
                ("--vocab-size", vocab_size))
    for flag, value in optional:
        if value is not None:
            argv += [flag, str(value)]
    preprocess_main(argv + (["--append-eod"] if append_eod else []))
    write_atomic(sidecar, json.dumps(identity, indent=2))
    return prefix


# ----------------------------------------------------------------------------- GPT dataset


def split_document_ranges(num_documents, split="949,50,1"):
    """Megatron's split bookends: 3 contiguous (start, end) document ranges, from the fractions of
    config.parse_split."""
    bookends = [0.0] + np.cumsum(parse_split(split)).tolist()
    return [(int(round(b * float(num_documents))), int(round(e * float(num_documents))))
            for b, e in zip(bookends[:-1], bookends[1:])]


def build_sample_index(sequence_lengths, document_index, seq_length):
    """helpers.cpp build_sample_idx (drop_last_partial_sequence, one extra token), vectorised.

    Sample i starts at token i*seq_length of the stream of documents in document_index order;
    row i = (position in document_index, token offset in that document). [num_samples+1, 2] int32.
    """
    doc_lengths = sequence_lengths[document_index].astype(np.int64)
    doc_starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]])
    num_samples = (int(doc_lengths.sum()) - 1) // seq_length
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # the last document starting at or before each sample's start
    pos = np.searchsorted(doc_starts, starts, side="right") - 1
    sample_index = np.stack([pos, starts - doc_starts[pos]], axis=1).astype(np.int32)
    sample_index[0] = 0  # the C++ loop starts at (0, 0) even if document 0 is empty
    return sample_index


def _shuffle(array, rng):
    """In place, from rng; rng None keeps the order (dataset_config.shuffle false)."""
    if rng is not None:
        rng.shuffle(array)


def _build_document_index(documents, num_epochs, rng, separate_final_epoch):
    """gpt_dataset._build_document_index: document ids tiled num_epochs times, shuffled (int32)."""
    if not separate_final_epoch or num_epochs == 1:
        doc_idx = np.tile(documents, num_epochs).astype(np.int32)
        _shuffle(doc_idx, rng)
        return doc_idx
    first = _build_document_index(documents, num_epochs - 1, rng, False)
    return np.concatenate([first, _build_document_index(documents, 1, rng, False)])


def _build_shuffle_index(num_samples, total_size, rng):
    """gpt_dataset._build_shuffle_index: shuffle [0, num_samples) and [num_samples, total_size)
    apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    _shuffle(first, rng)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    _shuffle(last, rng)
    return np.concatenate([first, last])


def _read_index_cache(paths, num_documents, num_samples):
    """The cached (document, sample, shuffle) indices as _build_indices makes them, or
    (None, (path, what is wrong)) for the first damaged file: cut short by a full disk or a
    copy, or another file written over it."""
    indices = []
    for path in paths:
        try:
            indices.append(np.load(path, mmap_mode="r"))
        except (ValueError, EOFError, OSError) as e:  # a truncated or overwritten .npy
            return None, (path, str(e).splitlines()[0] if str(e) else type(e).__name__)
    document, sample, shuffle = indices
    n, need = (sample.shape[0] - 1 if sample.ndim == 2 else 0), max(1, num_samples or 0)
    expected = (  # the shapes and dtypes _build_indices gives; any other file is not this cache's
        (document.dtype == np.int32 and document.ndim == 1 and document.size > 0
         and document.size % num_documents == 0, f"int32 [epochs * {num_documents}]"),
        (sample.dtype == np.int32 and sample.ndim == 2 and sample.shape[1] == 2 and n >= need,
         f"int32 [n + 1, 2] with n >= {need}"),
        (shuffle.dtype in (np.uint32, np.int64) and shuffle.shape == (n,), f"uint32 [{n}]"),
    )
    for path, arr, (ok, want) in zip(paths, indices, expected):
        if not ok:
            return None, (path, f"{arr.dtype} {list(arr.shape)}, expected {want}")
    return indices, None


def get_ltor_masks_and_position_ids(tokens, eod, reset_position_ids, reset_attention_mask,
                                    eod_mask_loss):
    """Megatron's get_ltor_masks_and_position_ids for one sample. tokens: [s].

    Returns loss_mask float32 [s], position_ids int32 [s], attention_mask bool [1, s, s]
    (True = masked out) or None when reset_attention_mask is off (plain causal mask).
    A document ends at its EOD token (inclusive); positions after it start again at 0.
    """
    s = len(tokens)
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    after_eod = np.zeros(s, dtype=np.int64)
    after_eod[1:] = tokens[:-1] == eod
    segment = np.cumsum(after_eod)  # [s] document number within the sample
    position_ids = np.arange(s, dtype=np.int32)
    if reset_position_ids:
        seg_start = np.flatnonzero(np.concatenate([[1], after_eod[1:]]))
        position_ids = (position_ids - seg_start[segment]).astype(np.int32)
    attention_mask = None
    if reset_attention_mask:
        attention_mask = (causal_mask(s) | (segment[:, None] != segment[None, :]))[None]
    return loss_mask, position_ids, attention_mask


def causal_mask(s):
    """bool [s, s], True where token i may not see token j, j > i (Megatron's convention: True =
    masked out)."""
    return np.triu(np.ones((s, s), dtype=bool), 1)


class GPTDataset:
    """Megatron-core GPTDataset over the documents `document_ids` of an IndexedDataset.

    Three indices (Megatron's doc_idx / sample_idx / shuffle_idx):
      document_index [epochs * docs] int32: document ids repeated per epoch and shuffled;
      sample_index [n + 1, 2] int32: (position in document_index, offset) where sample i starts;
      shuffle_index [n] uint32: the order in which samples are served.
    Sample i holds seq_length + 1 tokens, so consecutive samples share one boundary token.
    With cache_dir set, the indices are saved as .npy there (named by an md5 of the
    description, like Megatron) and reloaded by later runs, or rebuilt with a warning when a file
    is damaged; cache_dir=None keeps them in memory.
    """

    def __init__(self, indexed_dataset, document_ids, num_samples, seq_length, seed, eod,
                 name="train", cache_dir=None, reset_position_ids=False,
                 reset_attention_mask=False, eod_mask_loss=False, shuffle=True):
        self.dataset, self.seq_length, self.eod, self.name = indexed_dataset, seq_length, eod, name
        self.shuffle = shuffle
        self.documents = np.asarray(document_ids, dtype=np.int64)
        self.mask_options = (reset_position_ids, reset_attention_mask, eod_mask_loss)
        self.description = json.dumps({
            "class": "GPTDataset", "dataset_path": getattr(indexed_dataset, "path_prefix", None),
            "split": name, "documents_md5": hashlib.md5(self.documents.tobytes()).hexdigest(),
            "num_documents": len(self.documents), "num_samples": num_samples,
            "sequence_length": seq_length, "random_seed": seed,
            **({} if shuffle else {"shuffle": False}),     # Megatron's own description otherwise
        }, indent=4)
        # {hash}-GPTDataset-{split}-{document,sample,shuffle}_index.npy, description.txt last
        paths = []
        if cache_dir is not None:
            digest = hashlib.md5(self.description.encode()).hexdigest()
            base = os.path.join(cache_dir, f"{digest}-GPTDataset-{name}")
            paths = [f"{base}-{k}_index.npy" for k in ("document", "sample", "shuffle")]
            paths.append(base + "-description.txt")
        indices, damage = None, None
        if paths and all(map(os.path.isfile, paths)):
            indices, damage = _read_index_cache(paths[:3], len(self.documents), num_samples)
        self.built_anew = indices is None
        if self.built_anew:
            indices = self._build_indices(num_samples, seed)
            if paths:
                _save_indices(cache_dir, paths, indices, self.description, damage)
        self.document_index, self.sample_index, self.shuffle_index = indices

    def _build_indices(self, num_samples, seed):
        """gpt_dataset._build_document_sample_shuffle_indices."""
        lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int32)
        tokens_per_epoch = int(lengths[self.documents].sum())
        if tokens_per_epoch < self.seq_length + 1:
            raise ConfigError(f"{self.dataset.path_prefix}.bin: the {self.name} split has "
                              f"{tokens_per_epoch} tokens in {len(self.documents)} documents, "
                              f"fewer than seq_length+1={self.seq_length + 1}: lower --seq-length, "
                              "add data or change --split")
        if num_samples is None:
            num_epochs = 1
        else:
            # the epochs that hold num_samples samples of seq_length tokens and the extra token
            needed = num_samples * self.seq_length + 1
            num_epochs = max(1, -(-needed // tokens_per_epoch))
        separate_final_epoch = False
        # separate the last epoch if it supplies < 80% of an epoch's samples
        if num_epochs > 1:
            samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // self.seq_length
            samples_per_epoch = (tokens_per_epoch - 1) // self.seq_length
            separate_final_epoch = num_samples - samples_sans_final < int(0.80 * samples_per_epoch)
        rng = np.random.RandomState(seed) if self.shuffle else None
        document_index = _build_document_index(self.documents, num_epochs, rng,
                                               separate_final_epoch)
        sample_index = build_sample_index(lengths, document_index, self.seq_length)
        total = len(sample_index) - 1
        # a separate last epoch's samples are shuffled among themselves
        shuffled_apart = samples_sans_final if separate_final_epoch else total
        shuffle_index = _build_shuffle_index(shuffled_apart, total, rng)
        return document_index, sample_index, shuffle_index

    def __len__(self):
        return len(self.sample_index) - 1

    def get_text(self, j):
        """The seq_length + 1 tokens of sample j in sample_index order (before the shuffle)."""
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        if d0 == d1:
            tokens = self.dataset.get(self.document_index[d0], offset=o0, length=o1 - o0 + 1)
            return np.asarray(tokens, dtype=np.int64)
        parts = [self.dataset.get(self.document_index[d0], offset=o0)]
        parts += [self.dataset.get(self.document_index[d]) for d in range(d0 + 1, d1)]
        parts.append(self.dataset.get(self.document_index[d1], length=o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i):
        text = self.get_text(int(self.shuffle_index[i]))  # [s + 1]
        return _make_sample(text, self.eod, *self.mask_options)


def _save_indices(cache_dir, paths, indices, description, damage):
    """Write a dataset's index arrays, then its description (paths[-1]); a damaged file replaced
    is one warning naming the dataset's class."""
    kind = json.loads(description)["class"]
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for path, arr in zip(paths, indices):
            write_atomic(path, lambda f, a=arr: np.save(f, a))
        write_atomic(paths[-1], description)
    except OSError as e:
        if damage is None:
            raise  # nothing damaged: the OSError as before, one line from train.py
        raise ConfigError(f"{damage[0]}: damaged {kind} index cache ({damage[1]}) that "
                          f"cannot be rebuilt here ({e.strerror or e}): delete it, or give a "
                          "writable --data-cache-path") from None
    if damage is not None:
        print(f"warning: {damage[0]}: damaged {kind} index cache ({damage[1]}); rebuilt",
              file=sys.stderr, flush=True)


def _make_sample(text, eod, reset_position_ids=False, reset_attention_mask=False,
                 eod_mask_loss=False):
    """[s + 1] tokens -> dict of tokens, labels, loss_mask and position_ids, each [s] (and
    attention_mask [1, s, s] with reset_attention_mask)."""
    tokens, labels = text[:-1].astype(np.int32), text[1:].astype(np.int32)
    loss_mask, position_ids, attention_mask = get_ltor_masks_and_position_ids(
        tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss)
    sample = dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)
    if attention_mask is not None:
        sample["attention_mask"] = attention_mask
    return sample


class MockGPTDataset:
    """Megatron's --mock-data: random token ids, deterministic per (seed, index)."""

    def __init__(self, num_samples, seq_length, vocab_size, seed):
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.seed = vocab_size, seed

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        rng = np.random.RandomState([self.seed, i])
        return _make_sample(rng.randint(0, self.vocab_size, size=self.seq_length + 1), eod=-1)


def data_prefixes(path):
    """The .bin/.idx prefixes `path` names: itself, or, for a folder (MindSpore Transformers'
    dataset_dir), every tokenized corpus in it, sorted by name (a blend weighed by their
    samples)."""
    if not os.path.isdir(path):
        return [path]
    prefixes = sorted(f[:-4] for f in os.listdir(path)
                      if f.endswith(".bin") and os.path.isfile(os.path.join(path, f[:-4] + ".idx")))
    if not prefixes:
        raise ConfigError(f"dataset_config.data_path={path} is a folder holding no .bin/.idx "
                          "pair: give the prefix of a tokenized corpus (bash run.sh preprocess "
                          "writes them)")
    return [os.path.join(path, p) for p in prefixes]


# ----------------------------------------------------------------------------- blends

def data_blends(dataset_cfg):
    """(blend, per_split) for data.build_gpt_datasets: the blend of --data-path, or one blend (or
    None) per split."""
    if dataset_cfg.train_data_path is None:
        return parse_blend(dataset_cfg.data_path), None
    return None, [None if getattr(dataset_cfg, key) is None
                  else parse_blend(getattr(dataset_cfg, key), "dataset_config." + key)
                  for key in PER_SPLIT_PATHS]


def blend_lines(blend, per_split, split, num_samples):
    """What a run draws from its corpora, from the config alone (bash run.sh plan): per split,
    the samples asked, each corpus with its weight, the samples drawn (ceil(size * weight)) and
    built (with Megatron's surplus)."""
    lines = []
    for i, name in enumerate(SPLITS):
        prefixes, weights = blend if per_split is None else per_split[i] or (None, None)
        if not num_samples[i] or prefixes is None:
            continue
        where = f" (split {split})" if per_split is None else ""
        if weights is None and len(prefixes) > 1:
            parts = ", ".join(prefixes) + " weighed by their samples (one epoch each)"
        elif len(prefixes) == 1 and (weights is None or per_split is not None):
            parts = prefixes[0]
        else:
            weights = normalize(weights)
            drawn = size_per_dataset(weights, num_samples)
            built = size_per_dataset(weights, num_samples, SURPLUS)
            parts = ", ".join(f"{p} weight {w:.3f} ({d[i]} drawn, {b[i]} built)"
                              for p, w, d, b in zip(prefixes, weights, drawn, built))
        lines.append(f"{name} {num_samples[i]} samples{where}: {parts}")
    return lines


def describe(name, dataset):
    """The log's line for a built split: its corpus, or each corpus of its blend with its
    weight and the samples the blend draws of those built."""
    if isinstance(dataset, GPTDataset):
        return (f"data: {name} {len(dataset)} samples of {dataset.dataset.path_prefix} "
                f"({len(dataset.documents)} documents)")
    counts = np.bincount(dataset.dataset_index, minlength=len(dataset.datasets))
    parts = ", ".join(f"{d.dataset.path_prefix} weight {w:.3f} ({c} of {len(d)} samples)"
                      for d, w, c in zip(dataset.datasets, dataset.weights, counts))
    return f"data: {name} blend of {len(dataset)} samples: {parts}"


SPLITS = ("train", "valid", "test")
SURPLUS = 0.005   # BlendedMegatronDatasetConfig.mid_level_dataset_surplus


def normalize(weights):
    """megatron/core/datasets/utils.py normalize: the weights over their sum, in float64 as
    Megatron rounds them (the builder normalises a blend's weights, BlendedDataset once more)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def size_per_dataset(weights, sizes, surplus=0.0):
    """blended_megatron_dataset_builder._get_size_per_split_per_dataset: samples to draw (surplus
    0) or to build (the surplus keeps the blend from running dry) per corpus per split:
    [corpus][split] = ceil(ceil(size * weight) * (1 + surplus))."""
    return [[int(math.ceil(math.ceil(n * w) * (1 + surplus))) for n in sizes] for w in weights]


def build_blending_indices(weights, size):
    """helpers.cpp build_blending_indices: global sample i comes from the corpus furthest below
    its share, weight * max(i, 1) - samples taken so far (the first on a tie). Returns
    dataset_index int16 [size] and dataset_sample_index int64 [size] (the corpus's i-th sample)."""
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    counts = [0] * len(weights)
    for i in range(size):
        t = max(float(i), 1.0)
        best, best_error = 0, weights[0] * t - counts[0]
        for d in range(1, len(weights)):
            error = weights[d] * t - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i], dataset_sample_index[i] = best, counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


def _read_blend_cache(paths, size):
    """The cached (dataset_index, dataset_sample_index), or (None, (path, what is wrong))."""
    indices = []
    for path, dtype in zip(paths, (np.int16, np.int64)):
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, EOFError, OSError) as e:
            return None, (path, str(e).splitlines()[0] if str(e) else type(e).__name__)
        if arr.dtype != dtype or arr.shape != (size,):
            return None, (path, f"{arr.dtype} {list(arr.shape)}, expected "
                                f"{np.dtype(dtype).name} [{size}]")
        indices.append(arr)
    return indices, None


class BlendedDataset:
    """Megatron-core BlendedDataset (blended_dataset.py): `size` samples drawn from `datasets` in
    proportion to `weights` (normalised here, as Megatron does with a size). Global sample i is
    sample dataset_sample_index[i] of datasets[dataset_index[i]]. With cache_dir set, the two
    indices are saved there as .npy (named by an md5 of the description, as Megatron names them),
    each written atomically and the description last."""

    def __init__(self, datasets, weights, size, name, cache_dir=None):
        self.datasets, self.weights, self.size, self.name = datasets, normalize(weights), size, name
        self.description = json.dumps({
            "class": "BlendedDataset", "datasets": [json.loads(d.description) for d in datasets],
            "split": name, "weights": self.weights, "size": size}, indent=4)
        paths = []
        if cache_dir is not None:
            digest = hashlib.md5(self.description.encode()).hexdigest()
            base = os.path.join(cache_dir, f"{digest}-BlendedDataset-{name}")
            paths = [f"{base}-{k}.npy" for k in ("dataset_index", "dataset_sample_index")]
            paths.append(base + "-description.txt")
        indices, damage = None, None
        if paths and all(map(os.path.isfile, paths)):
            indices, damage = _read_blend_cache(paths[:2], size)
        if indices is None:
            indices = build_blending_indices(self.weights, size)
            self._check_sizes(indices[0])
            if paths:
                _save_indices(cache_dir, paths, indices, self.description, damage)
        self.dataset_index, self.dataset_sample_index = indices

    def _check_sizes(self, dataset_index):
        """Megatron's IndexError: a corpus asked for more samples than it was built with."""
        counts = np.bincount(dataset_index, minlength=len(self.datasets))
        for dataset, count in zip(self.datasets, counts):
            if count > len(dataset):
                raise ConfigError(f"{dataset.dataset.path_prefix}: the {self.name} blend draws "
                                  f"{count} samples from it, more than its {len(dataset)}: give "
                                  "it a smaller weight or more data")

    def __len__(self):
        return len(self.dataset_index)

    def __getitem__(self, i):
        return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]


def _corpus_splits(prefix, split, num_samples, make):
    """_build_megatron_dataset_splits: the train, valid and test GPTDatasets of one corpus, its
    documents split by `split`; a split with no documents (but train) or 0 samples is None."""
    indexed = IndexedDataset(prefix)
    ranges = split_document_ranges(len(indexed.document_indices) - 1, split)
    datasets = []
    for name, (begin, end), n in zip(SPLITS, ranges, num_samples):
        empty = name != "train" and end <= begin
        datasets.append(None if n == 0 or empty else
                        make(indexed, np.arange(begin, end, dtype=np.int32), n, name))
    return datasets


def _build_blend(blend, split, num_samples, make, cache_dir, single_is_plain):
    """The three splits of one blend (prefixes, weights or None): BlendedMegatronDatasetBuilder's
    cases. One prefix: its GPTDatasets. Weights: each corpus built with its share plus the
    surplus, the blend of size sum(ceil(size * weight)). No weights: each corpus one epoch, the
    blend weighed by their samples, of at most `num_samples`."""
    prefixes, weights = blend
    if len(prefixes) == 1 and (weights is None or single_is_plain):
        return _corpus_splits(prefixes[0], split, num_samples, make)
    if weights is None:
        wanted = [[None if n else 0 for n in num_samples]] * len(prefixes)   # one epoch each
    else:
        weights = normalize(weights)
        target = size_per_dataset(weights, num_samples)
        wanted = size_per_dataset(weights, num_samples, SURPLUS)
    corpora = [_corpus_splits(p, split, n, make) for p, n in zip(prefixes, wanted)]
    blended = []
    for i, name in enumerate(SPLITS):
        parts = [corpus[i] for corpus in corpora]
        if not num_samples[i] or None in parts:
            blended.append(None)
            continue
        if weights is None:
            shares = [len(part) for part in parts]
            size = min(num_samples[i], sum(shares))
        else:
            shares, size = weights, sum(t[i] for t in target)
        blended.append(BlendedDataset(parts, shares, size, name, cache_dir))
    return blended


def build_gpt_datasets(blend, split, seq_length, seed, num_samples, eod, cache_dir=None,
                       per_split=None, **gpt_options):
    """BlendedMegatronDatasetBuilder: (train, valid, test), each a GPTDataset, a BlendedDataset
    or None (a valid or test split with no documents or 0 samples).

    blend: (prefixes, weights or None) (config.parse_blend), every corpus split by `split`; or
    per_split: one blend (or None) per split (Megatron's blend_per_split), each corpus whole.
    num_samples: (train, valid, test) samples wanted. A train split without enough tokens raises
    ConfigError.
    """
    def make(indexed, documents, n, name):
        return GPTDataset(indexed, documents, n, seq_length, seed, eod, name, cache_dir,
                          **gpt_options)

    if per_split is None:
        return tuple(_build_blend(blend, split, num_samples, make, cache_dir, False))
    datasets = []
    for i, one in enumerate(per_split):
        only = [n if j == i else 0 for j, n in enumerate(num_samples)]
        whole = ",".join("1" if j == i else "0" for j in range(3))   # all documents in split i
        datasets.append(one and _build_blend(one, whole, only, make, cache_dir, True)[i])
    return tuple(datasets)


# ----------------------------------------------------------------------------- batch sampler


class MicroBatchIterator:
    """MegatronPretrainingSampler + collate: micro-batches of this data-parallel rank.

    Global step k covers samples [c, c + mbs*dp) with c = consumed_samples; rank r takes
    [c + r*mbs, c + (r+1)*mbs). Each yield is a dict of stacked arrays [mbs, s]. The last
    incomplete global batch is dropped; there is no wrap-around.
    """

    def __init__(self, dataset, micro_batch_size, data_parallel_rank=0, data_parallel_size=1,
                 consumed_samples=0):
        if micro_batch_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"bad sampler setup: micro_batch_size={micro_batch_size}, "
                             f"data_parallel_rank={data_parallel_rank}, "
                             f"data_parallel_size={data_parallel_size}")
        self.dataset, self.micro_batch_size = dataset, micro_batch_size
        self.rank, self.dp = data_parallel_rank, data_parallel_size
        self.consumed_samples = consumed_samples

    def __iter__(self):
        return self

    @property
    def epoch(self):
        return self.consumed_samples // len(self.dataset)

    def indices(self):
        """This rank's samples of the next global batch (None when the dataset is used up)."""
        if self.consumed_samples + self.micro_batch_size * self.dp > len(self.dataset):
            return None
        start = self.consumed_samples + self.rank * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def __next__(self):
        indices = self.indices()
        if indices is None:
            raise StopIteration
        samples = [self.dataset[int(i)] for i in indices]
        self.consumed_samples += self.micro_batch_size * self.dp
        return {k: np.stack([s[k] for s in samples]) for k in samples[0]}


def randperm(n, seed):
    """torch.randperm(n, generator=torch.Generator().manual_seed(seed)) without torch: the CPU
    kernel's swaps (aten randperm_cpu: z = mt19937() % (n - i)), the mt19937 draws from numpy's
    RandomState, the same generator seeded the same way. int64 [n]."""
    draws = np.random.RandomState(seed).randint(0, 2**32, size=max(n - 1, 0), dtype=np.uint32)
    perm = np.arange(n, dtype=np.int64)
    for i, draw in enumerate(draws.tolist()):
        z = i + draw % (n - i)
        perm[i], perm[z] = perm[z], perm[i]
    return perm


class RandomMicroBatchIterator(MicroBatchIterator):
    """--dataloader-type cyclic: Megatron's MegatronPretrainingRandomSampler wrapped in
    cyclic_iter (megatron/training/datasets/data_samplers.py). With data_sharding (its default)
    each rank owns a bucket of (len // (mbs*dp)) * mbs samples, served in the order of
    torch.randperm seeded by the epoch; everything follows from consumed_samples, so a resumed run
    takes the same next batch. --no-data-sharding: one permutation of (len // mbs) * mbs samples
    an epoch, its rest from the pass's consumed count dealt to the ranks in turn (rank r takes
    every dp-th from r); a pass ends at this rank's first incomplete micro-batch and the next one
    starts from the consumed count, as Megatron's does (a run resumes with a new pass)."""

    def __init__(self, dataset, micro_batch_size, data_parallel_rank=0, data_parallel_size=1,
                 consumed_samples=0, data_sharding=True):
        super().__init__(dataset, micro_batch_size, data_parallel_rank, data_parallel_size,
                         consumed_samples)
        self.data_sharding = data_sharding
        self._pass = None       # without sharding: this rank's samples of the current pass [n]

    @property
    def epoch(self):
        return self.consumed_samples // self._active()

    def _active(self):
        """Samples per epoch: the dataset less its last partial global batch."""
        global_batch = self.micro_batch_size * self.dp
        if len(self.dataset) < global_batch:
            raise ConfigError(f"--dataloader-type cyclic: {len(self.dataset)} samples, fewer "
                              f"than one global batch of {global_batch}")
        return len(self.dataset) - len(self.dataset) % global_batch

    def indices(self):
        if not self.data_sharding:
            return self._unsharded_indices()
        epoch, in_epoch = divmod(self.consumed_samples, self._active())
        bucket = (len(self.dataset) // (self.micro_batch_size * self.dp)) * self.micro_batch_size
        if getattr(self, "_perm_epoch", None) != epoch:         # one permutation per epoch
            self._perm, self._perm_epoch = randperm(bucket, epoch), epoch
        offset = in_epoch // self.dp
        return self.rank * bucket + self._perm[offset:offset + self.micro_batch_size]

    def _unsharded_indices(self):
        """The next micro-batch of the pass, a new pass once this one has no whole one left."""
        if self._pass is None or len(self._pass) < self.micro_batch_size:
            epoch, in_epoch = divmod(self.consumed_samples, self._active())
            whole = (len(self.dataset) // self.micro_batch_size) * self.micro_batch_size
            self._pass = randperm(whole, epoch)[in_epoch:][self.rank::self.dp]
        batch, self._pass = np.split(self._pass, [self.micro_batch_size])
        return batch


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: data.py is a library: run `bash run.sh preprocess ...`"
                     " (bash run.sh --help lists the commands)")
