//! Trains a model that is not weft's GPT — a stack of `tanh` layers
//! written here — fully sharded with weft-fsdp over 1, 2 and 4 thread
//! ranks (ZeRO-1, ZeRO-2, ZeRO-3, hybrid), and checks that every step's
//! loss and the final parameters are bitwise the one-rank run's — with f32
//! parameters, and with bf16 ones (`Precision::BF16_PARAMS`: the weights
//! gathered and computed with in bf16, the biases kept in f32 through
//! `UnitSpec::keep_f32`), which are a different run than f32 but the same
//! on every layout.
//!
//! The model calls FSDP's hooks around each layer (one unit per layer):
//! `pre_forward` gathers the layer's parameters, `post_forward` frees them,
//! `pre_backward` gathers them again with a gradient buffer,
//! `post_backward` hands the gradients to the reduce-scatter.
//!
//! `cargo run -p weft-fsdp --example mlp_sharded`

#![allow(clippy::print_stdout)] // an example prints its results

use weft_collectives::{Communicator, CommunicatorExt, LocalCluster, Topology};
use weft_fsdp::{Fsdp, FsdpConfig, Precision, Strategy, UnitSpec};
use weft_kernels::AdamW;
use weft_parallel::{Coords, LayoutBuilder, ParamLayout, Placements};

const H: usize = 16; // width
const N: usize = 8; // rows per micro-batch
const LAYERS: usize = 4;

/// The stack's layout (`layers.{l}.weight (H,H)`, `layers.{l}.bias (H)`)
/// and one FSDP unit per layer, its bias kept in f32 when the parameters
/// are gathered in bf16.
///
/// # Panics
/// Never: the names and shapes are fixed.
pub fn layout() -> (ParamLayout, Vec<UnitSpec>) {
    let mut b = LayoutBuilder::new(Coords::SINGLE);
    let mut units = Vec::new();
    for l in 0..LAYERS {
        let rep = Placements::REPLICATED;
        let w = b
            .push(format!("layers.{l}.weight"), &[H, H], true, rep)
            .expect("shape");
        let bias = b
            .push(format!("layers.{l}.bias"), &[H], false, rep)
            .expect("shape");
        units.push(UnitSpec {
            name: format!("layer {l}"),
            range: w.start..bias.end,
            // one range: the bias, after the weight
            keep_f32: std::iter::once(bias.start - w.start..bias.end - w.start).collect(),
            ..UnitSpec::default()
        });
    }
    (b.finish().expect("layout"), units)
}

/// One micro-batch, `(N, H)` inputs and targets.
fn sample(step: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
    let mut s = ((step * 131 + k) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let x: Vec<f32> = (0..N * H)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    let y = x.iter().map(|v| (2.0 * v).sin() * 0.5).collect();
    (x, y)
}

/// Forward and backward of one micro-batch through the sharded stack,
/// calling the hooks; the loss `½·mean((h − y)²)`.
fn micro_batch(f: &mut Fsdp, x: &[f32], y: &[f32]) -> weft_fsdp::Result<f64> {
    let mut acts = vec![x.to_vec()];
    for l in 0..LAYERS {
        f.pre_forward(l)?;
        let p = f.params(l)?;
        let (w, b) = p.split_at(H * H);
        let h = &acts[l];
        let out: Vec<f32> = (0..N * H)
            .map(|i| {
                let (r, j) = (i / H, i % H);
                ((0..H).map(|k| h[r * H + k] * w[k * H + j]).sum::<f32>() + b[j]).tanh()
            })
            .collect();
        acts.push(out);
        f.post_forward(l)?;
    }
    let last = &acts[LAYERS];
    let loss = 0.5
        * last
            .iter()
            .zip(y)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>()
        / (N * H) as f64;
    let mut dh: Vec<f32> = last
        .iter()
        .zip(y)
        .map(|(a, b)| (a - b) / (N * H) as f32)
        .collect();
    for l in (0..LAYERS).rev() {
        f.pre_backward(l, 0)?;
        let (p, g) = f.view(l, 0)?;
        let (w, _) = p.split_at(H * H);
        let (dw, db) = g.split_at_mut(H * H);
        let dz: Vec<f32> = dh
            .iter()
            .zip(&acts[l + 1])
            .map(|(d, a)| d * (1.0 - a * a))
            .collect();
        let x = &acts[l];
        for r in 0..N {
            for i in 0..H {
                for j in 0..H {
                    dw[i * H + j] += x[r * H + i] * dz[r * H + j];
                }
            }
            for j in 0..H {
                db[j] += dz[r * H + j];
            }
        }
        dh = (0..N * H)
            .map(|i| {
                let (r, k) = (i / H, i % H);
                (0..H).map(|j| dz[r * H + j] * w[k * H + j]).sum()
            })
            .collect();
        f.post_backward(l, 0)?;
    }
    Ok(loss)
}

/// What a run ends with: every step's loss and norm, and the parameters.
pub type Run = (Vec<u64>, Vec<u64>, Vec<u32>);

/// Trains `steps` steps of a global batch of 4 micro-batches over `n`
/// ranks with `cfg`, clipping the norm to 0.5.
///
/// # Errors
/// An FSDP or collective error, or ranks that disagree.
pub fn train(n: usize, cfg: &FsdpConfig, steps: usize) -> anyhow::Result<Run> {
    let (layout, units) = layout();
    let init: Vec<f32> = (0..layout.len())
        .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.6)
        .collect();
    let m = 4;
    let per = m / n;
    let hp = AdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..AdamW::default()
    };
    let out = LocalCluster::builder(n)
        .topology(Topology::new(2))
        .run_each(|comm| -> anyhow::Result<Run> {
            let mut f = Fsdp::new(&comm, &layout, units.clone(), cfg.clone(), &init)?;
            let (mut losses, mut norms) = (Vec::new(), Vec::new());
            for step in 0..steps {
                f.begin_step(per)?;
                let mut mine = Vec::new();
                for j in 0..per {
                    let (x, y) = sample(step, comm.rank() * per + j);
                    mine.push(micro_batch(&mut f, &x, &y)?);
                }
                f.finish_backward()?;
                // the global loss: every micro-batch's, in global order
                let mut all = vec![0.0f64; m];
                comm.all_gather(&mine, &mut all)?;
                let mut loss = 0.0;
                for l in &all {
                    loss += l;
                }
                losses.push((loss / m as f64).to_bits());
                let norm = f.grad_norm()?.finish(None)?;
                norms.push(norm.to_bits());
                let coef = if norm > 0.5 {
                    (0.5 / (norm + 1e-6)) as f32
                } else {
                    1.0
                };
                f.apply(coef, &hp)?;
            }
            let params = f.full_params()?.iter().map(|x| x.to_bits()).collect();
            Ok((losses, norms, params))
        });
    let mut runs = Vec::new();
    for r in out {
        runs.push(r??);
    }
    anyhow::ensure!(runs.windows(2).all(|w| w[0] == w[1]), "ranks disagree");
    Ok(runs.remove(0))
}

/// Trains every strategy on 1, 2 and 4 ranks, with f32 and with bf16
/// parameters, and checks each against the one-rank run in its precision;
/// the first and last losses of each.
///
/// # Errors
/// A failed run, or one that is not bitwise the one-rank run.
pub fn run() -> anyhow::Result<Vec<(String, f64, f64)>> {
    let steps = 6;
    let mut rows = Vec::new();
    let loss = |r: &Run, i: usize| f64::from_bits(r.0[i]);
    let mut bases: Vec<Run> = Vec::new();
    for (name, precision) in [("f32", Precision::F32), ("bf16", Precision::BF16_PARAMS)] {
        let one = FsdpConfig {
            precision,
            ..FsdpConfig::default()
        };
        let base = train(1, &one, steps)?;
        anyhow::ensure!(loss(&base, steps - 1) < loss(&base, 0), "the stack learns");
        anyhow::ensure!(
            bases.iter().all(|b| b.2 != base.2),
            "{name} parameters give another run than f32"
        );
        for strategy in Strategy::ALL {
            let cfg = FsdpConfig {
                strategy,
                hybrid_shard: 2,
                ..one.clone()
            };
            for n in [1, 2, 4] {
                if strategy == Strategy::Hybrid && n == 1 {
                    continue;
                }
                let got = train(n, &cfg, steps)?;
                anyhow::ensure!(
                    got == base,
                    "{strategy} over {n} ranks with {name} parameters differs from one rank"
                );
                rows.push((
                    format!("{strategy} n={n} {name}"),
                    loss(&got, 0),
                    loss(&got, steps - 1),
                ));
            }
        }
        bases.push(base);
    }
    Ok(rows)
}

#[allow(dead_code)] // the test includes this file as a module
fn main() -> anyhow::Result<()> {
    println!("{:<22} {:>12} {:>12}", "layout", "first loss", "last loss");
    for (name, first, last) in run()? {
        println!("{name:<22} {first:>12.6} {last:>12.6}   bitwise the 1-rank run");
    }
    Ok(())
}
