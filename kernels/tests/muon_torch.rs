//! `muon_update` against `torch.optim.Muon` (`tests/python/muon_ref.py`):
//! the same random weights and gradients through five steps, in square,
//! wide and tall shapes, Nesterov on and off, with and without weight
//! decay, both learning-rate scales.
//!
//! torch runs Newton–Schulz in bf16. The f32 check replaces it in the
//! script with the same code in float32 and compares our
//! [`Precision::F32`]; the bf16 check compares our [`Precision::Bf16`]
//! with torch as it is. Each case is also run in weft's `[in, out]`
//! layout (the transposed buffers with [`WeightShape::InOut`]), which
//! must give the transpose of the same bits.
//!
//! Tolerances (relative L2 error of the parameter's change over the five
//! steps, `p₅ − p₀`): 2e-5 in f32 (measured at most 1.1e-6), 1e-2 in bf16
//! (measured 3e-5 to 4e-3: the two sides sum the products in different
//! orders, so some results round to the neighbouring bf16, and the
//! quintic carries those differences on — torch's own bf16 iteration
//! against the same arithmetic written as f32 products of bf16 values
//! rounded to bf16 differs by 2e-3 at 96 × 32 and 6e-3 at 768 × 768).
//! Run with `--nocapture` for the figures per case.
//!
//! Skipped, saying why on stderr, without a Python that has torch and
//! numpy (`WEFT_PYTHON`, else `~/.cache/weft-venv/bin/python`, else
//! `python3`); a failure under `WEFT_REQUIRE_ALL`.

use std::path::{Path, PathBuf};
use std::process::Command;

use weft_kernels::{Muon, MuonScale, Precision, WeightShape, muon_update};
use weft_testkit::python;

const STEPS: usize = 5;

/// A scratch directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let d = std::env::temp_dir().join(format!("weft-muon-torch-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `n` values in [-scale, scale) from a fixed-seed xorshift generator.
fn rand(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            scale * (2.0 * u - 1.0)
        })
        .collect()
}

fn write(path: &Path, v: &[f32]) {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

fn read(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; m.len()];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = m[i * cols + j];
        }
    }
    t
}

/// `‖got − want‖ / ‖want‖` of the changes from `p0`, in f64.
fn rel_change(got: &[f32], want: &[f32], p0: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for ((&g, &w), &p) in got.iter().zip(want).zip(p0) {
        let (g, w, p) = (f64::from(g), f64::from(w), f64::from(p));
        num += (g - w) * (g - w);
        den += (w - p) * (w - p);
    }
    (num / den).sqrt()
}

fn rel(got: &[f32], want: &[f32]) -> f64 {
    rel_change(got, want, &vec![0.0; want.len()])
}

struct Case {
    name: String,
    rows: usize,
    cols: usize,
    hp: Muon,
    precision: Precision,
    p0: Vec<f32>,
    grads: Vec<Vec<f32>>,
}

fn cases() -> Vec<Case> {
    let configs = [
        // (momentum, nesterov, weight decay, scale, lr)
        (0.95, true, 0.1, MuonScale::MatchRmsAdamW, 0.02),
        (0.95, false, 0.0, MuonScale::Original, 0.02),
        (0.9, true, 0.05, MuonScale::Original, 0.05),
        (0.9, false, 0.1, MuonScale::MatchRmsAdamW, 0.01),
    ];
    let mut out = Vec::new();
    let mut seed = 1;
    for precision in [Precision::F32, Precision::Bf16] {
        for (rows, cols) in [(64, 64), (96, 32), (32, 96)] {
            for (c, &(momentum, nesterov, weight_decay, scale, lr)) in configs.iter().enumerate() {
                let n = rows * cols;
                seed += 100;
                out.push(Case {
                    name: format!("{precision}-{rows}x{cols}-{c}"),
                    rows,
                    cols,
                    hp: Muon {
                        lr,
                        momentum,
                        nesterov,
                        weight_decay,
                        scale,
                        ..Muon::default()
                    },
                    precision,
                    p0: rand(n, seed, 0.05),
                    grads: (0..STEPS as u64)
                        .map(|s| rand(n, seed + 1 + s, 1.0))
                        .collect(),
                });
            }
        }
    }
    out
}

/// Our steps on the case in torch's `[out, in]` layout, and in weft's
/// `[in, out]` layout transposed back.
fn ours(c: &Case) -> (Vec<f32>, Vec<f32>) {
    let (rows, cols, n) = (c.rows, c.cols, c.rows * c.cols);
    let out_in = WeightShape::OutIn {
        fan_out: rows,
        fan_in: cols,
    };
    let (mut p, mut buf) = (c.p0.clone(), vec![0.0f32; n]);
    for g in &c.grads {
        muon_update(&mut p, g, &mut buf, out_in, &c.hp, c.precision).unwrap();
    }
    let in_out = WeightShape::InOut {
        fan_in: cols,
        fan_out: rows,
    };
    let (mut pt, mut buf) = (transpose(&c.p0, rows, cols), vec![0.0f32; n]);
    for g in &c.grads {
        let gt = transpose(g, rows, cols);
        muon_update(&mut pt, &gt, &mut buf, in_out, &c.hp, c.precision).unwrap();
    }
    (p, transpose(&pt, cols, rows))
}

#[test]
#[allow(clippy::print_stderr)]
fn muon_matches_torch() {
    let Some(py) = python("torch, numpy") else {
        return;
    };
    let dir = TempDir::new();
    let cases = cases();
    let mut list = String::new();
    for c in &cases {
        let adjust = match c.hp.scale {
            MuonScale::Original => "original",
            MuonScale::MatchRmsAdamW => "match_rms_adamw",
        };
        let ns = if c.precision == Precision::F32 {
            "f32"
        } else {
            "bf16"
        };
        list += &format!(
            "{} {} {} {STEPS} {} {} {} {} {adjust} {ns}\n",
            c.name,
            c.rows,
            c.cols,
            c.hp.lr,
            c.hp.weight_decay,
            c.hp.momentum,
            u8::from(c.hp.nesterov),
        );
        write(&dir.0.join(format!("{}.p0.f32", c.name)), &c.p0);
        write(&dir.0.join(format!("{}.g.f32", c.name)), &c.grads.concat());
    }
    std::fs::write(dir.0.join("cases.txt"), list).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/muon_ref.py");
    let out = Command::new(&py).arg(script).arg(&dir.0).output().unwrap();
    assert!(
        out.status.success(),
        "muon_ref.py failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let mut worst = [0.0f64; 2];
    for c in &cases {
        let want = read(&dir.0.join(format!("{}.out.f32", c.name)));
        let (got, got_in_out) = ours(c);
        let change = rel_change(&got, &want, &c.p0);
        let params = rel(&got, &want);
        eprintln!(
            "{:<16} relative error of the change {change:.2e}, of the parameter {params:.2e}",
            c.name
        );
        let (slot, tol) = if c.precision == Precision::F32 {
            (0, 2e-5)
        } else {
            (1, 1e-2)
        };
        assert!(change < tol, "{}: relative error {change} > {tol}", c.name);
        worst[slot] = worst[slot].max(change);
        // The layouts iterate on the same orientation (torch's).
        assert_eq!(got, got_in_out, "{}: the two layouts differ", c.name);
    }
    eprintln!(
        "worst relative error of the change: f32 {:.2e}, bf16 {:.2e}",
        worst[0], worst[1]
    );
}
