"""The run's scalars for people to watch: a JSON Lines log, a loss plot, TensorBoard event files.

The rank that logs the loss (instruments/logs.open_metrics) writes them through `Metrics`, into the
run's save folder (`--save`, ./output by default: every run has one, as it has its log folder
there):
- `<save>/metrics.jsonl`, JSON Lines (https://jsonlines.org): one object per line, appended
  as the run goes. A train record per log interval: `step`, `split: "train"`, `time` (unix
  seconds) and the scalars the run measured (`TRAIN_TAGS`'s keys; a key is absent when not
  measured). An evaluation record: `step`, `split` ("validation" or "test"), `time`, `loss`.
  JSON has no NaN or infinity: such values are the strings "nan", "inf", "-inf"
  (`read_records` turns them back into floats). Each line goes to the file in one write()
  call, so a killed run leaves whole lines (at most the last one torn, which a reader skips).
  A run resumed from iteration k keeps the records up to step k and drops the later ones
  (the killed run trained them past its last checkpoint, and they are trained again).
- `<save>/loss.svg`: training and validation loss against step (`loss_svg`), redrawn after
  every record (data.write_atomic), so a browser reloading it during the run never sees half
  a drawing. Linear axes with round tick values; NaN and infinite losses are left out and
  counted in the legend.
- `<tensorboard_dir>/events.out.tfevents.<unix time>.<host>` (`EventFile`, with
  `--tensorboard-dir`): TensorBoard's event file, a sequence of records `uint64 length,
  uint32 masked CRC-32C of the length, data, uint32 masked CRC-32C of the data` (TensorFlow's
  TFRecord format, tensorflow/core/lib/io/record_writer.cc), each `data` a protobuf `Event`
  (tensorflow/core/util/event.proto; summary.proto for `Summary`) encoded here by hand. The
  first event is `file_version: "brain.Event:2"`; the second a `SessionLog` START at the
  first step this run trains. Then one event per record: the iteration as `step`, the scalars
  as `simple_value`s under Megatron-LM's tag names (its training.py `training_log` and
  `evaluate_and_print_results`), each written at once so TensorBoard shows a live run. A
  resumed run starts a new file; TensorBoard drops what an earlier file holds from the
  resumed steps on (its Python loader at the START event, its Rust data server when a step
  comes again), the resume rule of metrics.jsonl.
"""
import json
import math
import numbers
import os
import socket
import struct
import time
from xml.sax.saxutils import escape

from data import write_atomic
from settings.config import ConfigError

JSONL, SVG = "metrics.jsonl", "loss.svg"

# metrics.jsonl key -> TensorBoard tag: Megatron's tags; skipped-iterations and tokens-per-second,
# which Megatron does not write to TensorBoard, named in their style.
TRAIN_TAGS = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "loss_scale": "loss-scale",
    "skipped_iterations": "skipped-iterations",
    "tokens_per_s": "tokens-per-second",
    "tflops": "throughput",               # Megatron's: TFLOP/s per GPU (here per rank)
    "iteration_time": "iteration-time",   # seconds
    "batch_size": "batch-size",
    # an MoE model's (moe.METRICS), under Megatron's names (track_moe_metrics)
    "load_balancing_loss": "load_balancing_loss",
    "seq_load_balancing_loss": "seq_load_balancing_loss",
    "z_loss": "z_loss",
}
SPLITS = ("validation", "test")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class Metrics:
    """The writer of the three files above for one run in `save_dir`, resumed from iteration
    `resume_step` (0: a fresh run, which starts metrics.jsonl over). Each record opens and
    closes its files, so there is nothing to close when the run ends, however it ends."""

    def __init__(self, save_dir, tensorboard_dir=None, resume_step=0):
        os.makedirs(save_dir, exist_ok=True)
        self.jsonl, self.svg = os.path.join(save_dir, JSONL), os.path.join(save_dir, SVG)
        kept = read_records(self.jsonl) if resume_step else []    # a fresh run starts over
        self.records = [r for r in kept if r["step"] <= resume_step]
        write_atomic(self.jsonl, "".join(_line(r) for r in self.records), durable=False)
        write_atomic(self.svg, loss_svg(self.records), durable=False)
        self.events = None
        if tensorboard_dir is not None:
            self.events = EventFile(tensorboard_dir, resume_step + 1)

    def train(self, step, **scalars):
        """A log interval's record: scalars named by TRAIN_TAGS's keys; None means not measured."""
        unknown = sorted(set(scalars) - set(TRAIN_TAGS))
        if unknown:
            raise ValueError(f"unknown training scalars {unknown}; known: {list(TRAIN_TAGS)}")
        values = {k: _number(v) for k, v in scalars.items() if v is not None}
        self._add(step, "train", values, {TRAIN_TAGS[k]: v for k, v in values.items()})

    def evaluation(self, step, split, loss):
        """An evaluation's loss; TensorBoard also gets its perplexity, exp(min(loss, 20)) as in
        Megatron. Megatron writes the test loss under the validation tags too; here it has its
        own (`lm loss test`), so the last point of the validation curve stays a validation loss."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r}: one of {SPLITS}")
        loss, tag = float(loss), f"lm loss {split}"
        self._add(step, split, {"loss": loss}, {tag: loss, f"{tag} ppl": math.exp(min(loss, 20.0))})

    def _add(self, step, split, values, scalars):
        record = {"step": int(step), "split": split, "time": round(time.time(), 3), **values}
        self.records.append(record)
        fd = os.open(self.jsonl, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, _line(record).encode())   # one call: whole lines if the run is killed
        finally:
            os.close(fd)
        if self.events is not None:
            self.events.scalars(record["step"], scalars)
        write_atomic(self.svg, loss_svg(self.records), durable=False)


def read_records(path):
    """metrics.jsonl's records (an empty list without the file). A torn last line (a run killed
    in mid-write) is skipped; any other line that does not parse is an error naming it."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    records = []
    for number, text in enumerate(lines, 1):
        if not text:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            if number == len(lines):                 # no newline after it: the write was cut
                continue
            raise ConfigError(f"{path}:{number}: not a JSON record: {text[:60]!r}; repair or "
                              "remove the file to resume") from None
        records.append({k: _NONFINITE.get(v, v) if isinstance(v, str) else v
                        for k, v in record.items()})
    return records


def _line(record):
    """One JSON line, NaN and infinities as strings (json.dumps would write bare NaN, which
    strict JSON readers refuse)."""
    safe = {k: repr(v) if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in record.items()}
    return json.dumps(safe, allow_nan=False) + "\n"


def _number(value):
    """An int stays an int (step counts), anything else becomes a float (numpy scalars too)."""
    return int(value) if isinstance(value, numbers.Integral) else float(value)


# ----------------------------------------------------------------------------- loss.svg
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 800, 460, 80, 776, 52, 404
CHAR_WIDTH = 6.6                      # of the 11 px monospace font, to place the legend's entries
COLOURS = {"train": "#4292c6", "validation": "#006d2c"}
NAMES = {"train": "training loss", "validation": "validation loss"}


def loss_svg(records, title="lm loss against step"):
    """Training and validation loss (records as in metrics.jsonl) as an SVG drawing: a polyline
    per split with finite losses (class "series", id the split), a dot per validation point
    (and for a curve of one point), ticks and grid lines at round values, axis titles, a legend
    entry per split with each curve's last value, the title. NaN and infinite losses are not
    drawn; the legend counts them."""
    series, dropped = _finite_series(records)
    points = [p for pts in series.values() for p in pts]
    xs = _ticks(min((s for s, _ in points), default=0), max((s for s, _ in points), default=1),
                integer=True)
    ys = _ticks(min((v for _, v in points), default=0.0), max((v for _, v in points), default=1.0))
    x_of, y_of = _mapping(xs, LEFT, RIGHT), _mapping(ys, BOTTOM, TOP)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           'font-family="monospace" font-size="11">',
           f'<text x="4" y="14" font-size="13">{escape(title)}</text>']
    out += _axes(xs, ys, x_of, y_of)
    if not points:
        out.append(f'<text x="{(LEFT + RIGHT) / 2}" y="{(TOP + BOTTOM) / 2}" '
                   'text-anchor="middle">no finite loss yet</text>')
    legend_x = 4
    for split, pts in series.items():
        if pts:
            xy = " ".join(f"{x_of(s):.1f},{y_of(v):.1f}" for s, v in pts)
            out.append(f'<polyline class="series" id="{split}" points="{xy}" fill="none" '
                       f'stroke="{COLOURS[split]}" stroke-width="1.5"/>')
        if split == "validation" or len(pts) == 1:
            out += [f'<circle cx="{x_of(s):.1f}" cy="{y_of(v):.1f}" r="2.5" '
                    f'fill="{COLOURS[split]}"/>' for s, v in pts]
        last = f"step {pts[-1][0]}: {pts[-1][1]:.4f}" if pts else "no finite value"
        text = f"{NAMES[split]} ({last})"
        if dropped[split]:
            text += f", {dropped[split]} non-finite not drawn"
        out.append(f'<rect x="{legend_x}" y="22" width="12" height="12" '
                   f'fill="{COLOURS[split]}" stroke="#333" stroke-width="0.5"/>'
                   f'<text class="legend" x="{legend_x + 16}" y="32">{escape(text)}</text>')
        legend_x += 16 + round(CHAR_WIDTH * len(text)) + 24
    out.append("</svg>")
    return "\n".join(out)


def _finite_series(records):
    """Split -> [(step, loss)] with the finite losses in record order, for each drawn split
    with a loss record; and split -> how many of its losses were NaN or infinite."""
    series, dropped = {}, dict.fromkeys(NAMES, 0)
    for r in records:
        if r.get("split") not in NAMES or r.get("loss") is None:
            continue
        points = series.setdefault(r["split"], [])
        if math.isfinite(r["loss"]):
            points.append((r["step"], r["loss"]))
        else:
            dropped[r["split"]] += 1
    return {k: series[k] for k in NAMES if k in series}, dropped


def _mapping(ticks, start, end):
    """Data value -> pixel: the first tick at `start`, the last at `end`."""
    return lambda value: start + (value - ticks[0]) / (ticks[-1] - ticks[0]) * (end - start)


def _axes(xs, ys, x_of, y_of):
    """Both axes with their ticks, labels and titles, and a light grid line at each y tick."""
    out = [f'<line x1="{LEFT}" y1="{BOTTOM}" x2="{RIGHT}" y2="{BOTTOM}" stroke="#333"/>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{BOTTOM}" stroke="#333"/>']
    for x in xs:
        out.append(f'<line x1="{x_of(x):.1f}" y1="{BOTTOM}" x2="{x_of(x):.1f}" '
                   f'y2="{BOTTOM + 4}" stroke="#333"/><text class="xtick" x="{x_of(x):.1f}" '
                   f'y="{BOTTOM + 16}" text-anchor="middle">{_label(x, xs)}</text>')
    for y in ys:
        out.append(f'<line x1="{LEFT - 4}" y1="{y_of(y):.1f}" x2="{RIGHT}" y2="{y_of(y):.1f}" '
                   f'stroke="#ddd"/><text class="ytick" x="{LEFT - 6}" y="{y_of(y) + 4:.1f}" '
                   f'text-anchor="end">{_label(y, ys)}</text>')
    middle = (TOP + BOTTOM) / 2
    out.append(f'<text class="xtitle" x="{(LEFT + RIGHT) / 2}" y="{BOTTOM + 36}" '
               'text-anchor="middle">step</text>')
    out.append(f'<text class="ytitle" x="16" y="{middle}" text-anchor="middle" '
               f'transform="rotate(-90 16 {middle})">lm loss</text>')
    return out


def _ticks(lo, hi, integer=False):
    """Round tick values from at or below lo to at or above hi: a step of 1, 2 or 5 times a
    power of ten (at least 1 on an integer axis) giving about 4 to 10 intervals. A single value gets
    room around it (a flat curve, one point)."""
    if hi <= lo:
        pad = 1 if integer else max(abs(lo) * 0.05, 0.05)
        lo, hi = lo - pad, hi + pad
    unit = 10.0 ** math.floor(math.log10((hi - lo) / 4))
    step = next(k * unit for k in (1, 2, 5, 10) if (hi - lo) / (k * unit) <= 10)
    step = max(step, 1) if integer else step
    first, last = math.floor(lo / step), math.ceil(hi / step)
    digits = max(0, -math.floor(math.log10(step)))
    return [round(i * step, digits) + 0.0 for i in range(first, last + 1)]   # + 0.0: no -0.0


def _label(value, ticks):
    """A tick label with as many decimals as the tick step needs."""
    step = ticks[1] - ticks[0]
    digits = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{value:.{digits}f}"


# ----------------------------------------------------------------------------- TensorBoard
class EventFile:
    """A TensorBoard event file in `folder`, opened by a run whose first step is `start_step`
    (the file format in the module docstring). Each event is appended whole, file opened and
    closed, so TensorBoard reads a live run and a killed one alike."""

    def __init__(self, folder, start_step):
        os.makedirs(folder, exist_ok=True)
        stem = os.path.join(folder, f"events.out.tfevents.{int(time.time()):010d}."
                                    f"{socket.gethostname()}")
        self.path = _create_new(stem)
        self._write(_event(0, _bytes_field(3, b"brain.Event:2")))
        self._write(_event(start_step, _bytes_field(7, _key(1, 0) + _varint(1))))   # START

    def scalars(self, step, values):
        """One event at `step` with a Summary of tag -> value."""
        summary = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _key(2, 5)
                                        + struct.pack("<f", _float32(v)))
                           for tag, v in values.items())
        self._write(_event(step, _bytes_field(5, summary)))

    def _write(self, data):
        header = struct.pack("<Q", len(data))
        with open(self.path, "ab") as f:
            f.write(header + struct.pack("<I", masked_crc32c(header)) + data
                    + struct.pack("<I", masked_crc32c(data)))


def _create_new(stem):
    """A new empty file named stem, or stem.1, stem.2, ... if a run in the same second took it
    (the names sort in the order TensorBoard must read them)."""
    for n in range(1000):
        path = stem if n == 0 else f"{stem}.{n}"
        try:
            open(path, "xb").close()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{stem}: 1000 event files in this second")


def _event(step, what):
    """An Event: wall_time (field 1, double), step (field 2, varint), then `what` (encoded)."""
    return _key(1, 1) + struct.pack("<d", time.time()) + _key(2, 0) + _varint(step) + what


def _key(field, wire_type):
    """A field's key: its number and wire type (0 varint, 1 fixed64, 2 length-delimited,
    5 fixed32)."""
    return _varint(field << 3 | wire_type)


def _bytes_field(field, data):
    """A length-delimited field (wire type 2): strings, bytes, embedded messages."""
    return _key(field, 2) + _varint(len(data)) + data


def _varint(n):
    """Protobuf's base-128 varint, low 7 bits first; a negative int64 as its 64-bit two's
    complement (ten bytes), as protobuf encodes it."""
    n &= (1 << 64) - 1
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _float32(value):
    """simple_value is a float32: larger magnitudes become infinities (struct refuses them)."""
    return value if not math.isfinite(value) or abs(value) <= 3.4028234663852886e38 \
        else math.copysign(math.inf, value)


def _crc32c_table():
    """CRC-32C (Castagnoli) one byte at a time: the reflected polynomial 0x82F63B78."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = crc >> 1 ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data):
    """CRC-32C of bytes (RFC 3720, appendix B.4; check value crc32c(b"123456789") = 0xE3069283)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ crc >> 8
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    """TFRecord's masked CRC: rotated right by 15 bits plus a constant (tensorflow/core/lib/hash/
    crc32c.h), so that CRCs of data holding CRCs stay well distributed."""
    crc = crc32c(data)
    return ((crc >> 15 | crc << 17) + 0xA282EAD8) & 0xFFFFFFFF


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: metrics.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
