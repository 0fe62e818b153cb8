//! Trains a model that is not weft's GPT — a stack of `tanh` layers
//! written here in a few dozen lines — with weft-pipeline's executor over
//! 2 and 4 thread ranks (GPipe, 1F1B, interleaved 1F1B, ZB-H1), and
//! checks that every step's loss is bitwise the one-rank run's.
//!
//! `cargo run -p weft-pipeline --example mlp_stack`

#![allow(clippy::print_stdout)] // an example prints its results

use std::collections::HashMap;
use std::ops::Range;

use weft_collectives::{Communicator, LocalCluster};
use weft_pipeline::{ExecError, Executor, ScheduleKind, Stage};

const H: usize = 16; // width
const N: usize = 8; // rows per micro-batch
const LAYERS: usize = 4;

/// One micro-batch: inputs and regression targets, `(N, H)` each.
pub struct Sample {
    x: Vec<f32>,
    y: Vec<f32>,
}

/// Layers `layers` of the stack: `h ← tanh(h·W + b)`, `W (H,H)`; the last
/// stage's loss is `½·mean((h − y)²)`.
#[derive(Debug)]
pub struct MlpStage {
    layers: usize,
    last: bool,
    params: Vec<f32>, // per layer: W then b
    grads: Vec<f32>,
    acts: HashMap<usize, Vec<Vec<f32>>>, // mb → each layer's input, then the output
    dz: HashMap<usize, Vec<Vec<f32>>>,   // mb → each layer's d(pre-activation), after B
    targets: HashMap<usize, Vec<f32>>,   // mb → y, on the last stage
}

/// What can go wrong in a stage: a backward out of order.
#[derive(Debug, thiserror::Error)]
#[error("mlp stage: {0}")]
pub struct MlpError(String);

impl MlpStage {
    fn new(layers: Range<usize>, total: usize, init: &[f32]) -> Self {
        let per = H * H + H;
        let params = init[layers.start * per..layers.end * per].to_vec();
        MlpStage {
            layers: layers.len(),
            last: layers.end == total,
            grads: vec![0.0; params.len()],
            params,
            acts: HashMap::new(),
            dz: HashMap::new(),
            targets: HashMap::new(),
        }
    }

    fn layer(&self, l: usize) -> (&[f32], &[f32]) {
        let p = &self.params[l * (H * H + H)..(l + 1) * (H * H + H)];
        p.split_at(H * H)
    }

    /// Gradient of the loss by the stage's output.
    fn dout(&self, mb: usize, dout: Option<&[f32]>, y: &[f32]) -> Vec<f32> {
        match dout {
            Some(d) => d.to_vec(),
            None => {
                let h = self.acts[&mb].last().expect("forward ran");
                h.iter()
                    .zip(y)
                    .map(|(a, b)| (a - b) / (N * H) as f32)
                    .collect()
            }
        }
    }

    /// B: d(pre-activation) of every layer and the input's gradient.
    fn input_half(&mut self, mb: usize, mut dh: Vec<f32>, dinput: Option<&mut [f32]>) {
        let acts = &self.acts[&mb];
        let mut dzs = vec![Vec::new(); self.layers];
        for l in (0..self.layers).rev() {
            let h = &acts[l + 1];
            let dz: Vec<f32> = dh.iter().zip(h).map(|(d, a)| d * (1.0 - a * a)).collect();
            let (w, _) = self.layer(l);
            let mut dx = vec![0.0f32; N * H];
            for r in 0..N {
                for i in 0..H {
                    dx[r * H + i] = (0..H).map(|j| dz[r * H + j] * w[i * H + j]).sum();
                }
            }
            dzs[l] = dz;
            dh = dx;
        }
        if let Some(out) = dinput {
            out.copy_from_slice(&dh);
        }
        self.dz.insert(mb, dzs);
    }

    /// W: every layer's weight and bias gradients, accumulated.
    fn weight_half(&mut self, mb: usize) -> Result<(), MlpError> {
        let dzs = self
            .dz
            .remove(&mb)
            .ok_or_else(|| MlpError(format!("W of {mb} before B")))?;
        let acts = self
            .acts
            .remove(&mb)
            .ok_or_else(|| MlpError(format!("no forward of {mb}")))?;
        for (l, dz) in dzs.iter().enumerate() {
            let g = &mut self.grads[l * (H * H + H)..(l + 1) * (H * H + H)];
            let (dw, db) = g.split_at_mut(H * H);
            for r in 0..N {
                for i in 0..H {
                    for j in 0..H {
                        dw[i * H + j] += acts[l][r * H + i] * dz[r * H + j];
                    }
                }
                for j in 0..H {
                    db[j] += dz[r * H + j];
                }
            }
        }
        Ok(())
    }
}

impl Stage for MlpStage {
    type Batch<'a> = Sample;
    type Error = MlpError;

    fn input_len(&self) -> usize {
        N * H
    }
    fn output_len(&self) -> usize {
        N * H
    }
    fn slots(&self) -> usize {
        usize::MAX
    }
    fn splits_backward(&self) -> bool {
        true
    }

    fn forward(
        &mut self,
        mb: usize,
        batch: &Sample,
        input: Option<&[f32]>,
        output: Option<&mut [f32]>,
    ) -> Result<Option<f64>, MlpError> {
        let mut acts = vec![input.unwrap_or(&batch.x).to_vec()];
        for l in 0..self.layers {
            let (w, b) = self.layer(l);
            let x = &acts[l];
            let mut h = vec![0.0f32; N * H];
            for r in 0..N {
                for j in 0..H {
                    let z: f32 = (0..H).map(|i| x[r * H + i] * w[i * H + j]).sum::<f32>() + b[j];
                    h[r * H + j] = z.tanh();
                }
            }
            acts.push(h);
        }
        let out = acts.last().cloned().unwrap_or_default();
        self.acts.insert(mb, acts);
        if self.last {
            self.targets.insert(mb, batch.y.clone());
        }
        if let Some(o) = output {
            o.copy_from_slice(&out);
        }
        Ok(self.last.then(|| {
            let se: f64 = out
                .iter()
                .zip(&batch.y)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            0.5 * se / (N * H) as f64
        }))
    }

    fn backward(
        &mut self,
        mb: usize,
        dout: Option<&[f32]>,
        dinput: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>, MlpError> {
        self.backward_input(mb, dout, dinput)?;
        self.backward_weight(mb)
    }

    fn backward_input(
        &mut self,
        mb: usize,
        dout: Option<&[f32]>,
        dinput: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>, MlpError> {
        let y = self.targets.remove(&mb).unwrap_or_default();
        let dh = self.dout(mb, dout, &y);
        self.input_half(mb, dh, dinput);
        Ok(Vec::new())
    }

    fn backward_weight(&mut self, mb: usize) -> Result<Vec<Range<usize>>, MlpError> {
        self.weight_half(mb)?;
        Ok(std::iter::once(0..self.grads.len()).collect())
    }

    fn discard(&mut self, mb: usize) -> Result<(), MlpError> {
        self.acts.remove(&mb);
        self.targets.remove(&mb);
        Ok(())
    }

    fn grads(&self) -> &[f32] {
        &self.grads
    }
    fn grads_mut(&mut self) -> &mut [f32] {
        &mut self.grads
    }
}

/// A deterministic stream of values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Every step's mean loss, training `steps` SGD steps of `m` micro-batches
/// with schedule `kind` over `p` thread ranks (`v` chunks each).
///
/// # Errors
/// A schedule, executor or stage error.
pub fn train(kind: ScheduleKind, p: usize, v: usize, steps: usize) -> anyhow::Result<Vec<f64>> {
    let m = 8;
    let init: Vec<f32> = values(1, LAYERS * (H * H + H))
        .iter()
        .map(|x| x * 0.4)
        .collect();
    let schedule = kind.generate(p, m, v)?;
    let nvs = schedule.placement().virtual_stages();
    let per = LAYERS / nvs;
    let out = LocalCluster::run(p, |comm| -> Result<Vec<f64>, ExecError> {
        let pl = schedule.placement();
        let chunks = (0..pl.chunks())
            .map(|c| {
                let vs = pl.virtual_stage(comm.rank(), c);
                MlpStage::new(vs * per..(vs + 1) * per, LAYERS, &init)
            })
            .collect();
        let mut ex = Executor::new(schedule.clone(), comm.rank(), chunks)?;
        let mut losses = Vec::new();
        for step in 0..steps {
            let data: Vec<Sample> = (0..m)
                .map(|k| {
                    let x = values((step * m + k) as u64 + 7, N * H);
                    let y = x.iter().map(|v| (2.0 * v).sin() * 0.5).collect();
                    Sample { x, y }
                })
                .collect();
            let report = ex.step(&comm, &data, None)?;
            let mut sum = 0.0;
            for l in report.losses.iter().flatten() {
                sum += l;
            }
            losses.push(sum / m as f64);
            for st in ex.stages_mut() {
                // SGD on the mean gradient over the micro-batches
                for (p, g) in st.params.iter_mut().zip(&mut st.grads) {
                    *p -= 0.5 * *g / m as f32;
                    *g = 0.0;
                }
            }
        }
        Ok(losses)
    })?;
    // the losses are on the rank holding the last virtual stage
    let last = schedule.placement().location(nvs - 1).0;
    let losses = out
        .into_iter()
        .nth(last)
        .ok_or_else(|| anyhow::anyhow!("no result from rank {last}"))??;
    Ok(losses)
}

/// Trains every layout and checks each against the one-rank run; the
/// table of first and last losses.
///
/// # Errors
/// A failed run, or a layout whose losses differ from one rank's.
pub fn run() -> anyhow::Result<Vec<(String, f64, f64)>> {
    let steps = 12;
    let one = train(ScheduleKind::GPipe, 1, 1, steps)?;
    anyhow::ensure!(one[steps - 1] < one[0] * 0.8, "the stack learns: {one:?}");
    let mut rows = vec![("1 rank".to_string(), one[0], one[steps - 1])];
    for (kind, p, v) in [
        (ScheduleKind::GPipe, 2, 1),
        (ScheduleKind::OneFOneB, 4, 1),
        (ScheduleKind::Interleaved, 2, 2),
        (ScheduleKind::ZbH1, 2, 1),
        (ScheduleKind::ZbH1, 4, 1),
    ] {
        let got = train(kind, p, v, steps)?;
        let name = format!("{} p={p} v={v}", kind.name());
        anyhow::ensure!(
            got.iter()
                .zip(&one)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: {got:?} differs from one rank's {one:?}"
        );
        rows.push((name, got[0], got[steps - 1]));
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
