"""Reads a weft TensorBoard event file with the `tensorboard` package and
prints what it found as one JSON object (trace/tests/tensorboard.rs).

    python tb_read.py FOLDER FILE

FOLDER is the run's log folder (found by TensorBoard's own directory
watcher, which picks files by name), FILE the event file in it. Floating
point numbers are printed as their bits (f64 as u64, f32 as u32), so that
NaN and infinities survive JSON and the comparison is exact.
"""

import json
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.backend.event_processing import plugin_event_accumulator as pea
from tensorboard.compat.proto import event_pb2
from tensorboard.util import tensor_util


def f64_bits(x):
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def main():
    folder, path = sys.argv[1], sys.argv[2]
    out = {}

    # Every record, raw (the loader checks both CRCs of each), parsed, and
    # serialized again: canonical bytes come back unchanged.
    records = []
    for raw in event_file_loader.RawEventFileLoader(path).Load():
        ev = event_pb2.Event.FromString(raw)
        records.append(
            {
                "len": len(raw),
                "canonical": ev.SerializeToString() == raw,
                "what": ev.WhichOneof("what"),
                "file_version": ev.file_version,
                "wall_time": f64_bits(ev.wall_time),
                "step": ev.step,
                "values": len(ev.summary.value),
            }
        )
    out["records"] = records

    # The classic accumulator: simple_value scalars and tensors as written.
    acc = ea.EventAccumulator(folder, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    out["file_version"] = acc.file_version
    tags = acc.Tags()
    out["scalars"] = {
        tag: [[e.step, f32_bits(e.value), f64_bits(e.wall_time)] for e in acc.Scalars(tag)]
        for tag in tags[ea.SCALARS]
    }
    texts = {}
    for tag in tags[ea.TENSORS]:
        meta = acc.SummaryMetadata(tag)
        rows = []
        for e in acc.Tensors(tag):
            arr = tensor_util.make_ndarray(e.tensor_proto)
            rows.append(
                [e.step, arr.item().decode("utf-8"), list(arr.shape), f64_bits(e.wall_time)]
            )
        texts[tag] = {"plugin": meta.plugin_data.plugin_name, "events": rows}
    out["texts"] = texts
    out["text_plugin_tags"] = sorted(acc.PluginTagToContent("text").keys())

    # The accumulator TensorBoard's server uses: every value migrated to a
    # tensor with its plugin and data class (scalars → "scalars" plugin).
    pacc = pea.EventAccumulator(folder, size_guidance={pea.TENSORS: 0})
    pacc.Reload()
    plugin = {}
    for tag in pacc.Tags()[pea.TENSORS]:
        meta = pacc.SummaryMetadata(tag)
        rows = []
        for e in pacc.Tensors(tag):
            arr = tensor_util.make_ndarray(e.tensor_proto)
            if arr.dtype == object:
                value = arr.item().decode("utf-8")
            else:
                value = f32_bits(float(arr.item()))
            rows.append([e.step, value])
        plugin[tag] = {
            "plugin": meta.plugin_data.plugin_name,
            "data_class": int(meta.data_class),
            "events": rows,
        }
    out["plugin_accumulator"] = plugin

    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
