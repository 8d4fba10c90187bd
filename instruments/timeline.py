"""A pipeline step's timeline: every rank's passes gathered over the pipeline (gather_trace), the
unit-time schedule as text (schedule_table), and the measured step beside it as text and SVG
with the bubble, measured and in theory (write_timeline): `pipeline_timeline.svg` and `.txt` of
a run with training_config.pipeline_trace (docs/pipeline.md)."""
import math

import numpy as np
import mindspore as ms
from mindspore import Tensor

import parallel
from pipeline import bubble_fraction, peak_in_flight, schedule, simulate, theory_bubble


PRIME = "'"                   # marks a pass of model chunk 1 ('' chunk 2) in timelines


def schedule_table(ticks):
    """The unit-time timeline as text: one row per pipeline stage, one column per tick; "F3" is
    the forward of micro-batch 3, "B3" its backward, a trailing "'" marks chunk 1 ('' chunk 2,
    ...)."""
    width = max(t[-1][0] for t in ticks if t) + 1
    rows = []
    for r, events in enumerate(ticks):
        cells = ["."] * width
        for tick, kind, mb, chunk in events:
            cells[tick] = f"{kind}{mb}" + PRIME * chunk
        rows.append(f"stage {r}: " + " ".join(f"{cell:<4}" for cell in cells).rstrip())
    return "\n".join(rows)


def gather_trace(trace, state):
    """Every rank's trace of one step, in pipeline-rank order, with times in seconds from the
    earliest pass (time.time() is one clock on one machine; across machines roughly aligned)."""
    # The collectives carry float32: times go as seconds after the first stage's first pass.
    first = parallel.group_ranks(state.pp_group)[0]
    origin = parallel.broadcast(Tensor([trace[0][3]], ms.float64), first, state.pp_group)
    origin = float(origin.asnumpy()[0])
    # [passes, 5]: kind (0 F, 1 B), micro-batch, chunk, start, end
    rows = np.array([[0.0 if k == "F" else 1.0, mb, chunk_id, s - origin, e - origin]
                     for k, mb, chunk_id, s, e in trace], np.float32)
    gathered = parallel.collectives(state.pp_group).all_gather(Tensor(rows[None]), 0)
    gathered = gathered.asnumpy().astype(np.float64)             # [pp, passes, 5]
    base = gathered[:, :, 3].min()
    return [[("F" if k == 0 else "B", int(mb), int(chunk_id), float(s - base), float(e - base))
             for k, mb, chunk_id, s, e in ranks] for ranks in gathered]


def write_timeline(traces, m, v, kind, path, grid=None):
    """Write a step's measured timeline (gather_trace's `traces`, one per stage) to path.txt, with
    the unit-time schedule above it, and path.svg; return the bubble line for the log: measured
    (idle over busy time per stage), in the unit-time schedule, and in theory. `grid`: the
    layout's parallel.rank_grid, which names each stage's ranks (default: one rank a stage)."""
    p = len(traces)
    span = max(e for t in traces for *_, e in t)
    measured = bubble_fraction([sum(e - s for *_, s, e in t) for t in traces], span)
    _, ticks = simulate(p, m, v, kind=kind)
    unit = bubble_fraction([len(t) for t in ticks], max(t[-1][0] for t in ticks) + 1)
    peaks = [peak_in_flight(schedule(p, r, m, v, kind=kind)) for r in range(p)]
    name = schedule_name(kind, v)
    grid = np.arange(p) if grid is None else grid
    stages = [stage_label(r, grid[r]) for r in range(p)]
    timeline = "\n".join(
        f"{stages[r]}: " + "  ".join(f"{k}{mb}{PRIME * chunk_id} {s * 1e3:.0f}-{e * 1e3:.0f}ms"
                                     for k, mb, chunk_id, s, e in t)
        for r, t in enumerate(traces))
    with open(path + ".txt", "w") as f:
        f.write(f"pipeline schedule: {name}, p={p}, m={m} (unit time)\n{schedule_table(ticks)}\n\n"
                f"measured, ms from the first pass ({NOTATION}):\n{timeline}\n\n")
    title = (f"{name}, p={p}, m={m}: bubble (idle / busy) measured {np.mean(measured):.3f}, "
             f"(p - 1) / (v m) = {theory_bubble(p, m, v):.3f}")
    with open(path + ".svg", "w") as f:
        f.write(timeline_svg(traces, ticks, title, stages))
    per_stage = ", ".join(f"{b:.3f}" for b in measured)
    return (f"pipeline: bubble (idle / busy) measured {np.mean(measured):.3f} "
            f"(per stage {per_stage}), unit-time schedule {max(unit):.3f}, "
            f"theory {theory_bubble(p, m, v):.3f}; peak micro-batches in flight per stage {peaks}")


def write_ddp_timeline(trace, path):
    """Write one rank's step without a pipeline, run in pieces with overlap_grad_reduce, to
    path.txt and path.svg: a row of its passes (("F" or "B", micro-batch, piece, start, end))
    and a row of its buckets' collectives (("R", bucket, buffer, start, end)); return the line
    for the log: how many buckets started before the last backward pass ended."""
    origin = min(s for *_, s, _ in trace)
    trace = [(k, a, b, s - origin, e - origin) for k, a, b, s, e in trace]
    passes = [t for t in trace if t[0] != "R"]
    buckets = [t for t in trace if t[0] == "R"]
    backward_end = max(e for k, *_, e in passes if k == "B")
    early = sum(s < backward_end for *_, s, _ in buckets)
    line = (f"data parallel: {early} of {len(buckets)} bucket(s) started before the backward "
            f"ended ({backward_end * 1e3:.0f} ms into the step)")
    text = "\n".join(f"{k}{a}{PRIME * b} {s * 1e3:.0f}-{e * 1e3:.0f}ms" for k, a, b, s, e in trace)
    with open(path + ".txt", "w") as f:
        f.write(f"{line}\n{DDP_NOTATION}\n{text}\n")
    width, rows = 1100.0, [passes, buckets]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="150" '
           'font-family="monospace" font-size="11">', f'<text x="4" y="14">{line}</text>']
    _timeline_panel(out, rows, ["passes (pieces)", "buckets' collectives"], 0, width,
                    "measured: " + DDP_NOTATION, "ms from the first pass", 1e3)
    out.append("</svg>")
    with open(path + ".svg", "w") as f:
        f.write("\n".join(out))
    return line


DDP_NOTATION = ("F0' = forward of micro-batch 0 through piece 1, B the same backward, R3 = bucket "
                "3's reduction (R3' in the experts' buffer)")


def schedule_name(kind, v):
    """The schedule's name for the timeline's title."""
    if kind == "afab":
        name = "all forward, all backward"
    else:
        name = "1F1B" if v == 1 else "interleaved 1F1B"
    return name + (f", {v} chunks per stage" if v > 1 else "")


NOTATION = ("F3 = forward of micro-batch 3, B3 = its backward, F3' = the same on the stage's "
            "second model chunk")


def stage_label(stage, ranks):
    """"stage s (ranks a-b)": `ranks`, the stage's slice of parallel.rank_grid, are adjacent (pp
    is the grid's outermost axis)."""
    first, last = int(np.min(ranks)), int(np.max(ranks))
    if first == last:
        return f"stage {stage} (rank {first})"
    return f"stage {stage} (ranks {first}-{last})"


def timeline_svg(traces, ticks, title, stages):
    """The step as an SVG drawing, two panels of one row per pipeline stage: the unit-time
    schedule (simulate's `ticks`, every pass one tick) above the measured passes (`traces`). A
    box per pass, labelled (F/B, micro-batch, a prime per later chunk), forwards blue and
    backwards green, darker for later chunks; a legend; an axis under each panel (ticks, ms)."""
    width, row, top = 1100.0, 28, 44
    panel = 30 + row * len(traces) + 40                 # heading, rows, axis
    chunks = max(chunk_id for t in traces for *_, chunk_id, _, _ in t) + 1
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
           f'height="{top + 2 * panel}" font-family="monospace" font-size="11">',
           f'<text x="4" y="14">{title}</text>']
    legend = [(f"{word}{f' chunk {chunk_id} ({k}{PRIME * chunk_id})' if chunks > 1 else ''}",
               TIMELINE_COLOURS[k][min(chunk_id, 2)])
              for k, word in (("F", "forward"), ("B", "backward")) for chunk_id in range(chunks)]
    for i, (text, fill) in enumerate(legend):
        out.append(f'<rect x="{4 + i * 150}" y="21" width="12" height="12" fill="{fill}" '
                   'stroke="#333" stroke-width="0.5"/>'
                   f'<text x="{20 + i * 150}" y="31">{text}</text>')
    unit = [[(kind, mb, chunk_id, tick, tick + 1) for tick, kind, mb, chunk_id in t]
            for t in ticks]
    _timeline_panel(out, unit, stages, top, width, "unit-time schedule: every pass one tick",
                    "ticks", 1.0)
    _timeline_panel(out, traces, stages, top + panel, width, "measured: this step's passes",
                    "ms from the first pass", 1e3)
    out.append("</svg>")
    return "\n".join(out)


TIMELINE_COLOURS = {"F": ["#9ecae1", "#4292c6", "#08519c"], "B": ["#a1d99b", "#41ab5d", "#006d2c"],
                    "R": ["#fdae6b", "#e6550d", "#a63603"]}


def _timeline_panel(out, rows, stages, top, width, heading, unit, per_unit):
    """Append to `out` a panel at height `top`: its heading, a row of boxes per stage (rows[r]:
    (kind, micro-batch, chunk, start, end), in seconds or ticks), an axis in `unit` (start x
    per_unit)."""
    row, left = 28, 150
    span = max(e for t in rows for *_, e in t)
    scale = (width - left - 20) / span
    out.append(f'<text x="4" y="{top + 16}">{heading}</text>')
    for r, events in enumerate(rows):
        y = top + 24 + r * row
        out.append(f'<text x="4" y="{y + 17}">{stages[r]}</text>')
        for kind, mb, chunk_id, s, e in events:
            x, w = left + s * scale, max((e - s) * scale, 1.0)
            label = f"{kind}{mb}{PRIME * chunk_id}"
            size = min(11.0, max(5.0, 1.6 * w / len(label)))   # shrink it to fit a narrow box
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 4}" '
                       f'fill="{TIMELINE_COLOURS[kind][min(chunk_id, 2)]}" stroke="#333" '
                       f'stroke-width="0.5"><title>{label}: {s * per_unit:.1f}-'
                       f'{e * per_unit:.1f} {unit}</title></rect>'
                       f'<text x="{x + 1:.1f}" y="{y + 16}" font-size="{size:.1f}">{label}</text>')
    axis = top + 24 + row * len(rows) + 4
    step = _tick_ms(span * per_unit)
    out.append(f'<line x1="{left}" y1="{axis}" x2="{left + span * scale:.1f}" y2="{axis}" '
               'stroke="#333"/>')
    for i in range(int(span * per_unit // step) + 1):
        x = left + i * step / per_unit * scale
        out.append(f'<line x1="{x:.1f}" y1="{axis}" x2="{x:.1f}" y2="{axis + 4}" stroke="#333"/>'
                   f'<text x="{x:.1f}" y="{axis + 16}" text-anchor="middle">{i * step:g}</text>')
    out.append(f'<text x="{left + span * scale:.1f}" y="{axis + 30}" text-anchor="end">'
               f'{unit}</text>')


def _tick_ms(span_ms):
    """A round axis interval giving about 5-10 marks over span_ms (ms or ticks)."""
    step = 10 ** math.floor(math.log10(max(span_ms, 1e-3) / 5))
    return next(k * step for k in (1, 2, 5, 10) if span_ms / (k * step) <= 10)


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: timeline.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
