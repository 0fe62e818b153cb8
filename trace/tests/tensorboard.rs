//! Interop: the `tensorboard` Python package reads the event files that
//! `weft_trace::tensorboard` writes. Skipped, saying why, without Python.

use std::collections::BTreeMap;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use weft_testkit::python;
use weft_trace::tensorboard::{EventWriter, FILE_VERSION, TEXT_PLUGIN, file_name, read_records};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/tb_read.py")
}

/// A fresh folder of this test's own under cargo's scratch dir.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("weft-trace-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One scalar as written: (tag, step, value as given, wall time).
type Scalar = (&'static str, u64, f64, f64);

/// The scalars written: several series, NaN, infinities, -0.0, a subnormal,
/// values that round to f32, steps up to `i64::MAX`.
fn scalars() -> Vec<Scalar> {
    let t0 = 1_700_000_000.0;
    vec![
        ("train/loss", 0, 10.5, t0 + 0.25),
        ("train/loss", 1, 0.1, t0 + 1.125), // rounds to f32
        ("train/lr", 1, 3e-4, t0 + 1.125),
        ("train/loss", 2, f64::NAN, t0 + 2.0),
        ("train/loss", 3, f64::INFINITY, t0 + 3.0),
        ("train/loss", 4, f64::NEG_INFINITY, t0 + 4.0),
        ("train/loss", 5, -0.0, t0 + 5.0),
        ("train/loss", 6, 1e-40, t0 + 6.0), // subnormal f32
        ("train/loss", 7, 1e300, t0 + 7.0), // beyond f32: +inf
        ("train/grad_norm", 1 << 40, 2.5, t0 + 8.0),
        ("train/grad_norm", i64::MAX as u64, -1.75, t0 + 9.0),
    ]
}

/// (tag, step, text, wall time).
fn texts() -> Vec<(&'static str, u64, &'static str, f64)> {
    vec![
        (
            "config",
            0,
            "# run\n| key | value |\n|---|---|\n| lr | 3e-4 |",
            1_700_000_000.5,
        ),
        ("notes", 7, "", 1_700_000_007.5),
        ("notes", 8, "λ → ∞, \"quoted\"", 1_700_000_008.5),
    ]
}

#[test]
fn tensorboard_reads_what_we_write() {
    let Some(py) = python("tensorboard") else {
        return;
    };
    let dir = scratch("tb");
    let name = file_name(1_700_000_000, "test-host", 4242);
    let path = dir.join(&name);
    let start = 1_699_999_999.75;
    {
        let file = std::fs::File::create(&path).unwrap();
        let mut w = EventWriter::new(BufWriter::new(file), start).unwrap();
        // interleaved as a trainer would log them
        let (s, t) = (scalars(), texts());
        w.text(t[0].0, t[0].1, t[0].2, t[0].3).unwrap();
        for &(tag, step, value, wall) in &s {
            w.scalar(tag, step, value, wall).unwrap();
        }
        for &(tag, step, text, wall) in &t[1..] {
            w.text(tag, step, text, wall).unwrap();
        }
        w.flush().unwrap();
    }
    let bytes = std::fs::read(&path).unwrap();
    let ours = read_records(&bytes).unwrap();
    assert_eq!(ours.len(), 1 + scalars().len() + texts().len());

    let out = Command::new(&py)
        .arg(script())
        .arg(&dir)
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_str(stdout.trim()).unwrap();

    // Every record, in order: same count and lengths as ours, canonical
    // (tensorboard's protobuf serializes it back to the same bytes), the
    // file_version first.
    let records = got["records"].as_array().unwrap();
    assert_eq!(records.len(), ours.len());
    for (i, (r, data)) in records.iter().zip(&ours).enumerate() {
        assert_eq!(r["len"], data.len(), "record {i}");
        assert_eq!(r["canonical"], true, "record {i}: {r}");
        let expected = if i == 0 { "file_version" } else { "summary" };
        assert_eq!(r["what"], expected, "record {i}: {r}");
    }
    assert_eq!(records[0]["file_version"], FILE_VERSION);
    assert_eq!(records[0]["wall_time"], start.to_bits());
    assert_eq!(records[0]["step"], 0);
    assert_eq!(got["file_version"], 2.0);

    // Scalars: every (step, f32 value, wall time) of every tag, bit-exact.
    let mut want: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
    for &(tag, step, value, wall) in &scalars() {
        want.entry(tag).or_default().push(serde_json::json!([
            step,
            (value as f32).to_bits(),
            wall.to_bits()
        ]));
    }
    let want = serde_json::to_value(&want).unwrap();
    assert_eq!(got["scalars"], want);
    // the edge cases really are there
    let loss = &got["scalars"]["train/loss"];
    assert!(f32::from_bits(loss[2][1].as_u64().unwrap() as u32).is_nan());
    assert_eq!(loss[3][1], f32::INFINITY.to_bits());
    assert_eq!(loss[5][1], (-0.0f32).to_bits());
    assert_eq!(loss[7][1], f32::INFINITY.to_bits());
    assert_eq!(got["scalars"]["train/grad_norm"][1][0], i64::MAX);

    // Texts: the text plugin's metadata, a rank-0 string tensor.
    let mut want: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
    for &(tag, step, text, wall) in &texts() {
        want.entry(tag)
            .or_default()
            .push(serde_json::json!([step, text, [], wall.to_bits()]));
    }
    for (tag, events) in &want {
        assert_eq!(got["texts"][tag]["plugin"], TEXT_PLUGIN, "{tag}");
        assert_eq!(
            &got["texts"][tag]["events"],
            &Value::from(events.clone()),
            "{tag}"
        );
    }
    assert_eq!(got["texts"].as_object().unwrap().len(), want.len());
    assert_eq!(
        got["text_plugin_tags"],
        serde_json::json!(["config", "notes"])
    );

    // What TensorBoard's server sees: scalars under the scalars plugin,
    // texts under the text plugin, with their data classes.
    let plugin = &got["plugin_accumulator"];
    assert_eq!(plugin.as_object().unwrap().len(), 5, "{plugin}");
    for &(tag, step, value, _) in &scalars() {
        let p = &plugin[tag];
        assert_eq!(p["plugin"], "scalars", "{tag}");
        assert_eq!(p["data_class"], 1, "{tag}: DATA_CLASS_SCALAR");
        let row = serde_json::json!([step, (value as f32).to_bits()]);
        assert!(
            p["events"].as_array().unwrap().contains(&row),
            "{tag}: {row} in {p}"
        );
    }
    for &(tag, step, text, _) in &texts() {
        let p = &plugin[tag];
        assert_eq!(p["plugin"], TEXT_PLUGIN, "{tag}");
        assert_eq!(p["data_class"], 2, "{tag}: DATA_CLASS_TENSOR");
        let row = serde_json::json!([step, text]);
        assert!(
            p["events"].as_array().unwrap().contains(&row),
            "{tag}: {row} in {p}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
