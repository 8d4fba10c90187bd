"""Data commands that fail cleanly (issue 22, item 7): preprocess stopped by Ctrl-C, and training
over a damaged GPTDataset index cache. To be folded into test_all.py's data section."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import data
import train
from cli import load_config
from config import ConfigError
from tokenizer import build_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------- Ctrl-C in preprocess


def _interrupted_line(*prefixes):
    names = ", ".join(f"{p}_document.bin/.idx" for p in prefixes)
    return f"preprocess: interrupted; nothing written ({names} not created)"


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_ctrl_c_is_one_line_exit_130_and_leaves_nothing(tmp_path, workers):
    """Ctrl-C as a terminal sends it, to the parent and its pool workers, while documents are
    being written: one line, exit 130, no .bin/.idx/temporary file, no worker left running."""
    src = tmp_path / "in.jsonl"
    src.write_text((json.dumps({"text": "to be, or not to be " * 20}) + "\n") * 40000)  # seconds
    out = tmp_path / "out"
    # its own process group, and SIGINT's default action even when this runner ignores it (a
    # shell's background job does, and children inherit that)
    job = subprocess.Popen([sys.executable, "train.py", "preprocess", "--input", str(src),
                            "--output-prefix", str(out / "p"), "--tokenizer-type", "ByteTokenizer",
                            "--workers", str(workers), "--log-interval", "1000000"],
                           cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    partial = out / f"p_text_document.bin.tmp{job.pid}"
    try:
        deadline = time.time() + 60
        while not (partial.exists() and partial.stat().st_size > 0):  # tokens on their way
            assert job.poll() is None and time.time() < deadline, "preprocess did not start"
            time.sleep(0.01)
        os.killpg(job.pid, signal.SIGINT)
        stdout, stderr = job.communicate(timeout=60)
        with pytest.raises(ProcessLookupError):  # the group is empty: the workers stopped too
            os.killpg(job.pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what a failed run left: a hung pool
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 130, stderr
    assert stderr.splitlines() == [_interrupted_line(out / "p_text")], stderr
    assert "Traceback" not in stdout
    assert os.listdir(out) == []


@pytest.mark.parametrize("at", [1, 2, 3, 4])
def test_preprocess_interrupted_while_placing_files_takes_them_back(tmp_path, monkeypatch, at):
    """Two keys, four renames (.bin and .idx of each): Ctrl-C at any of them leaves no pair
    incomplete and neither key's files."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i}", "title": f"t{i}"}) + "\n"
                           for i in range(5)))
    renames, replace = [], os.replace

    def interrupted_replace(a, b):
        renames.append(b)
        if len(renames) == at:
            raise KeyboardInterrupt
        replace(a, b)
    monkeypatch.setattr(os, "replace", interrupted_replace)
    prefix = str(tmp_path / "out" / "p")
    with pytest.raises(data.Interrupted) as e:
        data.preprocess_main(["--input", str(src), "--output-prefix", prefix,
                              "--json-keys", "text", "title", "--tokenizer-type", "ByteTokenizer"])
    assert str(e.value) == _interrupted_line(prefix + "_text", prefix + "_title")
    assert os.listdir(tmp_path / "out") == []


# ------------------------------------------------------------------------- damaged index caches


def _toy_indexed(folder):
    """30 documents of random length ending in an EOD-like id 99."""
    rng = np.random.RandomState(0)
    b = data.IndexedDatasetBuilder(str(folder / "toy.bin"), dtype=np.int32)
    for d in range(30):
        b.add_document(list(np.arange(rng.randint(1, 15)) + 1000 * d) + [99])
    b.finalize(str(folder / "toy.idx"))
    return data.IndexedDataset(str(folder / "toy"))


def _is_warning(lines, path, reason=".+"):
    """One line: the damaged file named, then rebuilt."""
    line = rf"warning: {re.escape(str(path))}: damaged GPTDataset index cache \({reason}\); "
    return len(lines) == 1 and re.fullmatch(line + "rebuilt", lines[0])


DAMAGES = {  # name: cached file -> what is left of it
    "truncated": lambda path: path.write_bytes(path.read_bytes()[:-7]),
    "header cut": lambda path: path.write_bytes(path.read_bytes()[:60]),
    "emptied": lambda path: path.write_bytes(b""),
    "overwritten": lambda path: path.write_bytes(b"\0" * len(path.read_bytes())),
    "another array": lambda path: np.save(path, np.arange(5, dtype=np.int32)),
    "another dtype": lambda path: np.save(path, np.load(path).astype(np.float64)),
}


@pytest.mark.parametrize("index", ["document", "sample", "shuffle"])
@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_index_cache_is_rebuilt_with_one_warning(tmp_path, capfd, index, damage):
    ds, cache = _toy_indexed(tmp_path), tmp_path / "cache"
    build = lambda: data.GPTDataset(ds, np.arange(30), 20, 8, seed=5, eod=99, cache_dir=str(cache))
    first = build()
    (path,) = cache.glob(f"*-GPTDataset-train-{index}_index.npy")
    DAMAGES[damage](path)
    capfd.readouterr()
    second = build()
    err = capfd.readouterr().err.splitlines()
    assert _is_warning(err, path), err
    assert second.built_anew and len(os.listdir(cache)) == 4  # no temporary file left
    for i in range(len(first)):
        np.testing.assert_array_equal(first[i]["tokens"], second[i]["tokens"])
    third = build()
    assert not third.built_anew and capfd.readouterr().err == ""
    np.testing.assert_array_equal(third.shuffle_index, first.shuffle_index)


def test_damaged_index_cache_that_cannot_be_rebuilt_is_one_error(tmp_path, monkeypatch, capfd):
    """A read-only cache folder, simulated: the suite may run as root, whom chmod does not stop."""
    ds, cache = _toy_indexed(tmp_path), tmp_path / "cache"
    build = lambda: data.GPTDataset(ds, np.arange(30), 20, 8, seed=5, eod=99, cache_dir=str(cache))
    build()
    (path,) = cache.glob("*-sample_index.npy")
    path.write_bytes(b"")

    def read_only(target, write):
        raise PermissionError(13, "Permission denied", target)
    monkeypatch.setattr(data, "_save_atomic", read_only)
    with pytest.raises(ConfigError) as e:
        build()
    assert str(e.value) == (f"{path}: damaged GPTDataset index cache (No data left in file) that "
                            "cannot be rebuilt here (Permission denied): delete it, or give a "
                            "writable --data-cache-path")
    assert capfd.readouterr().err == ""


def test_training_over_a_damaged_cache_warns_once_and_trains(tmp_path):
    """Through train.py: before, a truncated sample index ended the run in a traceback."""
    b = data.IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    rng = np.random.RandomState(0)
    for _ in range(40):
        b.add_document(list(rng.randint(0, 255, size=rng.randint(20, 80))) + [256])
    b.finalize(str(tmp_path / "d.idx"))
    flags = ["--data-path", str(tmp_path / "d"), "--tokenizer-type", "ByteTokenizer",
             "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
             "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--eval-iters", "0", "--train-iters", "1"]
    train.build_data(load_config(os.path.join(HERE, "config.yaml"), flags),
                     build_tokenizer("ByteTokenizer"))  # the cache this run reads, as it writes it
    (path,) = (tmp_path / "cache").glob("*-GPTDataset-train-sample_index.npy")
    good = path.read_bytes()
    path.write_bytes(good[:100])
    result = subprocess.run([sys.executable, "train.py", *flags, "--save", str(tmp_path / "out")],
                            cwd=HERE, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert _is_warning(result.stderr.splitlines(), path, "EOF: .+"), result.stderr
    assert path.read_bytes() == good
