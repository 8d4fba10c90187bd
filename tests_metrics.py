"""Tests of metrics.py: metrics.jsonl, loss.svg and the TensorBoard event file.

The event file is read back by a reader written here from the specification alone (TFRecord
framing with masked CRC-32C, tensorflow/core/lib/io/record_reader.cc; protobuf wire format,
https://protobuf.dev/programming-guides/encoding/; field numbers of event.proto and
summary.proto), with a CRC-32C computed bit by bit rather than by metrics.py's table.
`pytest tests_metrics.py`.
"""
import json
import math
import os
import re
import struct
from xml.etree import ElementTree

import pytest

import metrics

SVG_NS = {"s": "http://www.w3.org/2000/svg"}


def fake_run(folder, steps=6, log_interval=2, eval_interval=4, resume_step=None, tb=None):
    """A run's calls: a train record every log_interval steps, validation every eval_interval."""
    m = metrics.Metrics(folder, tensorboard_dir=tb, resume_step=resume_step)
    for step in range((resume_step or 0) + 1, steps + 1):
        if step % log_interval == 0:
            m.train(step, loss=10.0 - 0.01 * step, lr=1e-4 * step, grad_norm=None,
                    loss_scale=4096.0, skipped_iterations=0, tokens_per_s=2048.0, tflops=0.5)
        if step % eval_interval == 0:
            m.evaluation(step, "validation", 10.5 - 0.01 * step)
    return m


def refuse_bare_constant(name):
    """json.loads's hook for NaN, Infinity, -Infinity: none may appear."""
    pytest.fail(f"bare {name} in metrics.jsonl: not JSON")


# ----------------------------------------------------------------------------- metrics.jsonl
def test_jsonl_records_of_a_short_run(tmp_path):
    fake_run(tmp_path).close()
    records = metrics.read_records(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["split"]) for r in records] == [
        (2, "train"), (4, "train"), (4, "validation"), (6, "train")]
    train = records[1]
    assert {k: train[k] for k in train if k != "time"} == {
        "step": 4, "split": "train", "loss": 10.0 - 0.04, "lr": 1e-4 * 4, "loss_scale": 4096.0,
        "skipped_iterations": 0, "tokens_per_s": 2048.0, "tflops": 0.5}
    assert "grad_norm" not in train and isinstance(train["skipped_iterations"], int)
    assert records[2]["loss"] == 10.5 - 0.04
    assert set(records[2]) == {"step", "split", "time", "loss"}
    assert all(abs(r["time"] - records[0]["time"]) < 60 for r in records)


def test_jsonl_is_strict_json_with_nonfinite_values_as_strings(tmp_path):
    m = metrics.Metrics(tmp_path)
    m.train(1, loss=math.nan, grad_norm=math.inf)
    m.evaluation(1, "test", -math.inf)
    m.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    raw = [json.loads(line, parse_constant=refuse_bare_constant) for line in lines]
    assert (raw[0]["loss"], raw[0]["grad_norm"], raw[1]["loss"]) == ("nan", "inf", "-inf")
    back = metrics.read_records(tmp_path / "metrics.jsonl")
    assert math.isnan(back[0]["loss"]) and back[0]["grad_norm"] == math.inf
    assert back[1]["loss"] == -math.inf and back[1]["split"] == "test"


def test_jsonl_holds_whole_lines_while_the_run_goes(tmp_path):
    m = metrics.Metrics(tmp_path)
    for step in range(1, 4):
        m.train(step, loss=float(step))
        text = (tmp_path / "metrics.jsonl").read_text()     # what a killed run would leave
        assert text.endswith("\n") and len(text.splitlines()) == step
        assert [json.loads(line)["step"] for line in text.splitlines()] == list(range(1, step + 1))
    m.close()


def test_resume_keeps_records_up_to_the_resumed_step_then_appends(tmp_path):
    fake_run(tmp_path, steps=8).close()                     # records at 2, 4, 4v, 6, 8, 8v
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 9, "split": "tra')                # killed in mid-write
    fake_run(tmp_path, steps=6, resume_step=4).close()
    records = metrics.read_records(path)
    assert [(r["step"], r["split"]) for r in records] == [
        (2, "train"), (4, "train"), (4, "validation"), (6, "train")]
    assert path.read_text().endswith("}\n")


def test_fresh_run_starts_metrics_over(tmp_path):
    fake_run(tmp_path).close()
    m = metrics.Metrics(tmp_path)
    m.train(1, loss=3.0)
    m.close()
    assert [r["step"] for r in metrics.read_records(tmp_path / "metrics.jsonl")] == [1]


def test_a_damaged_line_before_the_last_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train"}\n{"step": 2, "spl\n{"step": 3}\n')
    with pytest.raises(ValueError, match=":2: not a JSON record"):
        metrics.read_records(path)
    assert metrics.read_records(tmp_path / "absent.jsonl") == []


def test_unknown_scalar_or_split_refused(tmp_path):
    m = metrics.Metrics(tmp_path)
    with pytest.raises(ValueError, match="unknown training scalars \\['los'\\]"):
        m.train(1, los=1.0)
    with pytest.raises(ValueError, match="split 'valid'"):
        m.evaluation(1, "valid", 1.0)
    m.close()


# ----------------------------------------------------------------------------- loss.svg
def parse_svg(path):
    """The drawing's root, its texts by class, and its polylines' points by id."""
    root = ElementTree.parse(path).getroot()
    texts = {t.get("class"): [] for t in root.iterfind("s:text", SVG_NS)}
    for t in root.iterfind("s:text", SVG_NS):
        texts[t.get("class")].append(t.text)
    lines = {p.get("id"): [tuple(map(float, xy.split(","))) for xy in p.get("points").split()]
             for p in root.iterfind("s:polyline", SVG_NS)}
    return root, texts, lines


def test_svg_curves_axes_and_legend(tmp_path):
    m = fake_run(tmp_path, steps=12)
    m.train(13, loss=math.nan)
    m.close()
    root, texts, lines = parse_svg(tmp_path / "loss.svg")
    assert root.get("font-family") == "monospace"
    assert len(lines["train"]) == 6 and len(lines["validation"]) == 3
    assert len(root.findall("s:circle", SVG_NS)) == 3            # a dot per validation point
    assert texts["xtitle"] == ["step"] and texts["ytitle"] == ["lm loss"]
    assert texts[None][0] == "lm loss against step"
    assert texts["legend"] == ["training loss (step 12: 9.8800), 1 non-finite not drawn",
                               "validation loss (step 12: 10.3800)"]
    x_ticks, y_ticks = ([float(v) for v in texts[k]] for k in ("xtick", "ytick"))
    assert x_ticks[0] <= 2 and x_ticks[-1] >= 12 and all(t == int(t) for t in x_ticks)
    assert y_ticks[0] <= 9.88 and y_ticks[-1] >= 10.46
    points = lines["train"] + lines["validation"]
    assert all(metrics.LEFT <= x <= metrics.RIGHT and metrics.TOP <= y <= metrics.BOTTOM
               for x, y in points)
    xs = [x for x, _ in lines["train"]]
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    assert min(gaps) > 0 and max(gaps) - min(gaps) <= 0.2            # 0.1 px rounding
    assert not os.path.exists(tmp_path / "loss.svg.tmp")


def test_svg_one_point_flat_curve_and_no_finite_loss(tmp_path):
    one = tmp_path / "one.svg"
    one.write_text(metrics.loss_svg([{"step": 1, "split": "train", "loss": 10.9}]))
    root, texts, lines = parse_svg(one)
    assert len(lines["train"]) == 1 and len(root.findall("s:circle", SVG_NS)) == 1
    y_ticks = [float(v) for v in texts["ytick"]]
    assert y_ticks[0] < 10.9 < y_ticks[-1] and len(set(y_ticks)) == len(y_ticks)
    flat = tmp_path / "flat.svg"
    flat.write_text(metrics.loss_svg([{"step": s, "split": "train", "loss": 0.0}
                                      for s in range(1, 5)]))
    _, texts, lines = parse_svg(flat)
    assert len({y for _, y in lines["train"]}) == 1 and "0.00" in texts["ytick"]
    nothing = tmp_path / "nothing.svg"
    nothing.write_text(metrics.loss_svg([{"step": 1, "split": "train", "loss": math.inf}]))
    _, texts, lines = parse_svg(nothing)
    assert lines == {} and "no finite loss yet" in texts[None]
    assert texts["legend"] == ["training loss (no finite value), 1 non-finite not drawn"]


@pytest.mark.parametrize("lo, hi, integer", [(0.0, 1.0, False), (4.7, 10.9, False),
                                            (5.0, 5.0, False), (1e-4, 3.3e-4, False),
                                            (-2.0, 7.5, False), (10, 200, True), (7, 7, True),
                                            (1, 123456, True)])
def test_ticks_are_round_and_cover_the_range(lo, hi, integer):
    ticks = metrics._ticks(lo, hi, integer)
    step = ticks[1] - ticks[0]
    mantissa = step / 10 ** math.floor(math.log10(step))     # 10: a step like 0.0999999
    assert min(abs(mantissa - k) for k in (1, 2, 5, 10)) < 1e-6
    assert all(abs(b - a - step) < 1e-9 * max(1.0, abs(b)) for a, b in zip(ticks, ticks[1:]))
    assert ticks[0] <= lo and ticks[-1] >= hi
    assert 4 <= len(ticks) - 1 <= 12 or integer and step == 1         # a short integer axis
    assert not integer or all(t == int(t) for t in ticks)


# ----------------------------------------------------------------------------- TensorBoard
def crc32c_bitwise(data):
    """CRC-32C bit by bit: reflected polynomial 0x82F63B78, initial and final xor 0xFFFFFFFF."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(crc):
    """TFRecord's mask: rotate right by 15 bits, add 0xA282EAD8, modulo 2^32."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) % 2 ** 32


def varint(data, i):
    """The base-128 varint at data[i:] (low groups first) and the index after it."""
    value, shift = 0, 0
    while True:
        value |= (data[i] & 0x7F) << shift
        shift, i = shift + 7, i + 1
        if data[i - 1] < 0x80:
            return value, i


def fields(data):
    """A protobuf message as [(field number, value)]: varints as ints, fixed64 and fixed32 and
    length-delimited as bytes."""
    out, i = [], 0
    while i < len(data):
        key, i = varint(data, i)
        wire = key & 7
        if wire == 0:
            value, i = varint(data, i)
        elif wire == 2:
            size, i = varint(data, i)
            value, i = data[i:i + size], i + size
        else:
            size = {1: 8, 5: 4}[wire]
            value, i = data[i:i + size], i + size
        out.append((key >> 3, value))
    assert i == len(data)
    return out


def read_events(path):
    """Each record's Event as (step, kind, payload): kind 'version' (the string), 'session_log'
    (its status), 'summary' ([(tag, value)]); both CRCs of every record checked."""
    blob, events, i = path.read_bytes(), [], 0
    while i < len(blob):
        header = blob[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack_from("<I", blob, i + 8)
        assert header_crc == masked(crc32c_bitwise(header)), f"length CRC at byte {i}"
        data = blob[i + 12:i + 12 + length]
        (data_crc,) = struct.unpack_from("<I", blob, i + 12 + length)
        assert len(data) == length and data_crc == masked(crc32c_bitwise(data)), f"data CRC at {i}"
        i += 16 + length
        event = dict(fields(data))
        assert struct.unpack("<d", event[1])[0] > 1.7e9                # wall_time
        if 3 in event:
            events.append((event.get(2, 0), "version", event[3].decode()))
        elif 7 in event:
            events.append((event[2], "session_log", dict(fields(event[7]))[1]))
        else:
            values = [dict(fields(v)) for f, v in fields(event[5]) if f == 1]
            events.append((event[2], "summary", [(v[1].decode(), struct.unpack("<f", v[2])[0])
                                                 for v in values]))
    return events


def test_crc32c_check_value_and_against_bitwise():
    assert metrics.crc32c(b"123456789") == 0xE3069283 == crc32c_bitwise(b"123456789")
    assert metrics.crc32c(b"") == 0
    data = bytes(range(256)) * 3 + b"brain.Event:2"
    assert metrics.crc32c(data) == crc32c_bitwise(data)
    assert metrics.masked_crc32c(data) == masked(crc32c_bitwise(data))


def test_tensorboard_event_file_read_by_the_spec(tmp_path):
    fake_run(tmp_path / "save", steps=400, log_interval=100, eval_interval=200,
             tb=tmp_path / "tb").close()
    (path,) = (tmp_path / "tb").iterdir()
    assert re.fullmatch(r"events\.out\.tfevents\.\d{10}\.[^/]+", path.name)
    events = read_events(path)
    assert events[:2] == [(0, "version", "brain.Event:2"), (1, "session_log", 1)]   # START
    train = [(s, dict(v)) for s, kind, v in events[2:] if "lm loss" in dict(v)]
    assert [s for s, _ in train] == [100, 200, 300, 400]                 # multi-byte varints
    assert train[1][1] == pytest.approx({
        "lm loss": 8.0, "learning-rate": 0.02, "loss-scale": 4096.0,
        "skipped-iterations": 0.0, "tokens-per-second": 2048.0, "throughput": 0.5}, rel=1e-6)
    valid = [(s, dict(v)) for s, kind, v in events[2:] if "lm loss validation" in dict(v)]
    assert [s for s, _ in valid] == [200, 400]
    assert valid[0][1] == pytest.approx({"lm loss validation": 8.5,
                                         "lm loss validation ppl": math.exp(8.5)}, rel=1e-6)
    assert len(events) == 2 + 4 + 2


def test_tensorboard_reader_catches_a_damaged_byte(tmp_path):
    fake_run(tmp_path / "save", tb=tmp_path / "tb").close()
    (path,) = (tmp_path / "tb").iterdir()
    blob = bytearray(path.read_bytes())
    blob[-6] ^= 0x01                                   # in the last event's data
    path.write_bytes(bytes(blob))
    with pytest.raises(AssertionError, match="data CRC"):
        read_events(path)


def test_tensorboard_resume_starts_a_later_file_at_the_next_step(tmp_path):
    fake_run(tmp_path / "save", steps=8, tb=tmp_path / "tb").close()
    m = fake_run(tmp_path / "save", steps=6, resume_step=4, tb=tmp_path / "tb")
    m.evaluation(6, "test", 1.5)
    m.close()
    first, second = sorted((tmp_path / "tb").iterdir())      # TensorBoard reads them in this order
    assert [s for s, kind, _ in read_events(first) if kind == "summary"] == [2, 4, 4, 6, 8, 8]
    events = read_events(second)
    assert events[1] == (5, "session_log", 1)          # TensorBoard drops the first file's 5..8
    assert [(s, [t for t, _ in v]) for s, kind, v in events[2:]] == [
        (6, ["lm loss", "learning-rate", "loss-scale", "skipped-iterations",
             "tokens-per-second", "throughput"]),
        (6, ["lm loss test", "lm loss test ppl"])]
