//! `weft plan`: the command-line side of [`weft_plan`] — the model from a
//! job configuration or from dimensions, the cluster from a preset, a file
//! or this machine (measured here, since the planner itself never
//! measures), the table, JSON, explanation, budget and SVG plots — and
//! `weft plan --calibrate`, which measures this machine, predicts several
//! `weft train` layouts and runs them, predicted against measured.
//!
//! This machine, measured ([`MachineProfile::measure`]): the rate of the
//! kernels' f32 and bf16 products at the shapes the job's blocks and head
//! multiply (forward and backward: a CPU's GEMM rate depends on the
//! shapes and on what stays in cache, so a large product's "peak" would
//! misstate a small model's), with every core and with each smaller pool a
//! rank gets when a job's ranks share the cores out; a tiny product's
//! time (a kernel call's fixed cost); the memory bandwidth of a triad over
//! 64 MiB; the thread backend's all-reduce between two ranks — its
//! bandwidth β from 8 MiB less 1 KiB back to back, its latency α at 1 KiB
//! between ranks that compute in between (a product each on its own
//! pool), timed on both ranks, so that α is what a collective costs
//! inside a step, the ranks' drift and the sleeping peer's wake-up
//! included —
//! in the job's reproducible or plain sums; the memory
//! available. Attention's products are charged at the GEMM rate,
//! element-wise work at the triad's bandwidth.
//!
//! `--calibrate` runs its layouts and measures the machine in rounds (a
//! shared machine's other jobs come and go over seconds), predicts from
//! the best figures of the rounds and compares with each layout's quietest
//! round. A step does more than products and element-wise passes (the
//! pool's wake-ups, copies and zeroing, the exact sums), so the share of
//! the measured rates a step reaches is measured too, on the one-rank
//! layout, and every layout is predicted at it: the one-rank layout is the
//! reference, the parallel layouts are the check ([`calibrate`]).

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use weft_plan::search::{Constraints, reason, search};
use weft_plan::{
    Accounting, Cluster, Device, Efficiency, Layout, Link, ModelSpec, Peak, Precision, Prediction,
    Recipe, Request, ScheduleKind, Strategy,
};

use crate::config::{Config, ConfigError};
use crate::train::{Observer, RankMemory, RunInfo, StepReport, TrainError};

/// Errors of `weft plan`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The planner refused the request.
    #[error(transparent)]
    Plan(#[from] weft_plan::Error),
    /// The job configuration is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A calibration run failed.
    #[error("calibration run {layout}: {source}")]
    Train {
        /// The layout being run.
        layout: String,
        /// Why.
        source: Box<TrainError>,
    },
    /// Reading or writing a file.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Flags that do not go together, or a value out of range.
    #[error("{0}")]
    Usage(String),
}

/// `weft plan`'s options.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct PlanArgs {
    /// A `weft train` job file: the model, batch and precision come from it
    /// (flags below override them).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override a key of the job, as `weft train --set` does.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Transformer layers, L.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Channels, C.
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Tokens per sequence, T.
    #[arg(long)]
    pub seq: Option<usize>,
    /// Vocabulary, V.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Feed-forward width (default 4·hidden).
    #[arg(long, value_name = "F")]
    pub ffn_hidden: Option<usize>,
    /// Experts per layer (mixture of experts; 0: dense).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts per token.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Global batch, sequences per step.
    #[arg(long, value_name = "N")]
    pub global_batch: Option<usize>,
    /// GPUs (ranks) to plan for (default: the cluster file's count, 8 for
    /// a preset, the job's ranks on this machine).
    #[arg(long)]
    pub gpus: Option<usize>,
    /// The cluster: a preset (a100-80gb, a100-40gb, h100, h200), a TOML
    /// file, or `this-machine` (measured now).
    #[arg(long, value_name = "PRESET|FILE|this-machine", default_value = "h100")]
    pub cluster: String,
    /// What the ranks hold and compute: `mixed` (mixed precision on GPUs)
    /// or `weft` (weft's own run; the default on this machine).
    #[arg(long, value_name = "weft|mixed")]
    pub recipe: Option<String>,
    /// Arithmetic of the products: fp32, bf16, fp16 (default: bf16 on
    /// GPUs, the job's train.precision with `weft`).
    #[arg(long)]
    pub precision: Option<String>,
    /// GPU recipe: the attention scores are materialized (no fused flash
    /// attention), as in Megatron-LM 2021.
    #[arg(long)]
    pub materialized_attention: bool,
    /// Pin the data-parallel degree.
    #[arg(long)]
    pub dp: Option<usize>,
    /// Pin the tensor-parallel degree.
    #[arg(long)]
    pub tp: Option<usize>,
    /// Pin the pipeline stages.
    #[arg(long)]
    pub pp: Option<usize>,
    /// Pin the expert-parallel degree.
    #[arg(long)]
    pub ep: Option<usize>,
    /// Pin the sharding: none, optimizer, grad_op, full, hybrid.
    #[arg(long)]
    pub fsdp: Option<String>,
    /// Ranks per sharding group with `--fsdp hybrid`.
    #[arg(long, value_name = "N")]
    pub hybrid_shard: Option<usize>,
    /// Pin the pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v.
    #[arg(long)]
    pub schedule: Option<String>,
    /// Model chunks per stage for the interleaved schedule.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Pin the micro-batch size.
    #[arg(long, value_name = "N")]
    pub micro_batch: Option<usize>,
    /// Pin sequence parallelism on (`true`) or off (`false`).
    #[arg(long, value_name = "BOOL")]
    pub sp: Option<bool>,
    /// Also consider full activation recomputation (which weft does not run).
    #[arg(long)]
    pub recompute: bool,
    /// Layouts to show (0: all).
    #[arg(long, default_value_t = 8)]
    pub top: usize,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Walk the chain for this model: where plain data parallelism stops
    /// fitting, FSDP against it, the communication crossover and how batch
    /// and sparsity move it, tensor parallelism inside against across nodes.
    #[arg(long)]
    pub explain: bool,
    /// Write SVG plots (step time and its parts against GPUs per strategy;
    /// memory per GPU by layout) into this folder.
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,
    /// A compute budget in FLOPs: the Chinchilla-optimal size and tokens,
    /// and how long the best layout takes.
    #[arg(long, value_name = "FLOPS")]
    pub budget_flops: Option<f64>,
    /// A compute budget in GPU-hours of this cluster at the best layout's
    /// predicted throughput.
    #[arg(long, value_name = "HOURS")]
    pub budget_gpu_hours: Option<f64>,
    /// Measure this machine, predict the step time and memory of several
    /// `weft train` layouts of the job and run them: predicted against
    /// measured.
    #[arg(long)]
    pub calibrate: bool,
    /// Steps per calibration run (the first fifth is not timed).
    #[arg(long, default_value_t = 40)]
    pub calibrate_steps: u64,
    /// Calibration rounds: each measures the machine and runs every
    /// layout; the prediction uses the best measurement, the comparison
    /// each layout's quietest round.
    #[arg(long, default_value_t = 3)]
    pub calibrate_rounds: usize,
    /// Print the published Megatron-LM runs (Narayanan et al. 2021, Table 1)
    /// against the planner's predictions.
    #[arg(long)]
    pub published: bool,
}

/// What this machine reaches with a given number of kernel threads.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ThreadFigures {
    /// Kernel threads (a rank's pool).
    pub threads: usize,
    /// FLOP/s of the job's f32 products, forward and backward.
    pub gemm_f32: f64,
    /// FLOP/s of its bf16 products.
    pub gemm_bf16: f64,
    /// Seconds of a product's fixed cost (a tiny product).
    pub overhead: f64,
    /// Bytes/s of a triad over 64 MiB.
    pub memory_bandwidth: f64,
}

/// This machine, measured (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MachineProfile {
    /// The CPU (`model name` of /proc/cpuinfo, as `lscpu` shows it).
    pub cpu: String,
    /// Cores available to this process.
    pub cores: usize,
    /// The products measured: `(tokens, in, out)` of each, forward and
    /// backward.
    pub shapes: Vec<(usize, usize, usize)>,
    /// Figures with every core, and with each smaller pool a rank of a
    /// job on this machine gets (the cores shared out over the ranks).
    pub per_threads: Vec<ThreadFigures>,
    /// The thread backend's all-reduce between two ranks: α and 1/β.
    pub link: Link,
    /// Whether `link` was measured with reproducible sums.
    pub reproducible: bool,
    /// Bytes of memory available.
    pub memory: f64,
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned())
}

fn available_memory() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(8.0 * 1024.0 * 1024.0 * 1024.0, |kb| kb * 1024.0)
}

/// Best of `reps` timings of `f` (a shared machine only ever slows a run).
fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// FLOP/s of the products `shapes` (`(m, k, n)`: `(m, k) × (k, n)`),
/// forward and backward as the blocks run them, on the current pool. In
/// a training step a product's operands were written long before it runs,
/// so each call here reads operands the previous calls have pushed out of
/// the caches: copies cycling through 64 MiB or more.
fn gemm_rate(shapes: &[(usize, usize, usize)], precision: Precision) -> f64 {
    use weft_kernels::{Mode, matmul_backward, matmul_forward};
    const COLD: usize = 64 << 20;
    let (mut flops, mut secs) = (0.0, 0.0);
    for &(m, k, n) in shapes {
        let bytes = 4 * (2 * m * k + 2 * k * n + 2 * m * n + n);
        let copies = COLD.div_ceil(bytes).clamp(2, 64);
        let mk: Vec<Vec<f32>> = (0..copies).map(|_| vec![0.5f32; m * k]).collect();
        let kn: Vec<Vec<f32>> = (0..copies).map(|_| vec![0.25f32; k * n]).collect();
        let mn: Vec<Vec<f32>> = (0..copies).map(|_| vec![0.125f32; m * n]).collect();
        let mut out: Vec<Vec<f32>> = (0..copies).map(|_| vec![0f32; m * n]).collect();
        let mut dinp: Vec<Vec<f32>> = (0..copies).map(|_| vec![0f32; m * k]).collect();
        let mut dw: Vec<Vec<f32>> = (0..copies).map(|_| vec![0f32; k * n]).collect();
        let mut db = vec![0f32; n];
        let f = 2.0 * (m * k * n) as f64;
        let reps = ((4e8 / f) as usize).clamp(3, 50);
        let mut ok = true;
        let mut i = 0;
        let tf = best_of(reps, || {
            i = (i + 1) % copies;
            ok &= matmul_forward(
                &mut out[i],
                &mk[i],
                &kn[i],
                None,
                1,
                m,
                k,
                n,
                Mode::Throughput,
                precision,
            )
            .is_ok();
        });
        let tb = best_of(reps, || {
            i = (i + 1) % copies;
            ok &= matmul_backward(
                &mut dinp[i],
                &mut dw[i],
                Some(&mut db),
                &mn[i],
                &mk[i],
                &kn[i],
                1,
                m,
                k,
                n,
                Mode::Throughput,
                precision,
            )
            .is_ok();
        });
        if ok {
            flops += 3.0 * f;
            secs += tf + tb;
        }
    }
    if secs > 0.0 { flops / secs } else { f64::NAN }
}

/// `out = a · w` in f32 on the current pool, the kernels' throughput mode.
fn product(out: &mut [f32], a: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
    let _ = weft_kernels::matmul_forward(
        out,
        a,
        w,
        None,
        1,
        m,
        k,
        n,
        weft_kernels::Mode::Throughput,
        Precision::F32,
    );
}

/// Seconds of a tiny product: a kernel call's fixed cost on this pool.
fn call_overhead() -> f64 {
    let (m, k, n) = (8, 8, 8);
    let a = vec![0.5f32; m * k];
    let w = vec![0.25f32; k * n];
    let mut out = vec![0f32; m * n];
    best_of(200, || {
        product(&mut out, &a, &w, (m, k, n));
    })
}

fn triad_bandwidth() -> f64 {
    use rayon::prelude::*;
    let n = 16 << 20; // 64 MiB of f32 per array
    let b = vec![1.0f32; n];
    let c = vec![2.0f32; n];
    let mut a = vec![0.0f32; n];
    let t = best_of(5, || {
        a.par_chunks_mut(1 << 16)
            .zip(b.par_chunks(1 << 16))
            .zip(c.par_chunks(1 << 16))
            .for_each(|((a, b), c)| {
                for ((x, y), z) in a.iter_mut().zip(b).zip(c) {
                    *x = y + 0.5 * z;
                }
            });
        std::hint::black_box(&a);
    });
    3.0 * 4.0 * n as f64 / t
}

/// The thread backend's all-reduce between two ranks as a training step
/// meets it: β from 8 MiB back to back, less 1 KiB back to back (two
/// ranks: `2α + S/β`, so the difference is the transfer alone); α from
/// 1 KiB all-reduces each after a product of the job's first shape on
/// each rank's own pool (a rank's share of the cores), timed on both
/// ranks (their mean, the median over iterations) — so α holds what a
/// collective between computing ranks costs their lockstep: the
/// exchange, the waiting rank's sleep and wake-up, and the ranks' drift.
fn all_reduce_link(reproducible: bool, shape: (usize, usize, usize)) -> Link {
    use weft_collectives::{Communicator, CommunicatorExt, LocalCluster, ReduceOp, ReduceOptions};
    let threads = (crate::ranks::cores() / 2).max(1);
    let opts = ReduceOptions::new(ReduceOp::Sum).reproducible(reproducible);
    let slowest = |v: Vec<weft_collectives::Result<weft_collectives::Result<f64>>>| {
        v.into_iter()
            .filter_map(|r| r.ok().and_then(Result::ok))
            .fold(0.0f64, f64::max)
    };
    let back_to_back = |len: usize| {
        slowest(
            LocalCluster::builder(2).run_each(|comm| -> weft_collectives::Result<f64> {
                let mut buf = vec![1e-3f32; len];
                let mut best = f64::INFINITY;
                for _ in 0..10 {
                    comm.barrier()?;
                    let t = Instant::now();
                    comm.all_reduce_with(&mut buf, &opts)?;
                    best = best.min(t.elapsed().as_secs_f64());
                }
                Ok(best)
            }),
        )
    };
    let big = back_to_back(2 << 20);
    let tiny = back_to_back(256);
    // each iteration: a product, then a small all-reduce, timed on each
    // rank; their mean is what the synchronisation costs the ranks'
    // lockstep: the exchange, the sleeping peer's wake-up, and half the
    // drift between the ranks' products (the earlier rank waits it out)
    let (m, k, n) = shape;
    let per_rank: Vec<Vec<f64>> = LocalCluster::builder(2)
        .run_each(|comm| -> weft_collectives::Result<Vec<f64>> {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a rayon pool");
            let a = vec![0.5f32; m * k];
            let w = vec![0.25f32; k * n];
            let mut out = vec![0f32; m * n];
            let mut small = vec![1e-3f32; 256];
            let mut times = Vec::with_capacity(100);
            comm.barrier()?;
            for _ in 0..100 {
                pool.install(|| {
                    product(&mut out, &a, &w, (m, k, n));
                });
                let t = Instant::now();
                comm.all_reduce_with(&mut small, &opts)?;
                times.push(t.elapsed().as_secs_f64());
            }
            Ok(times)
        })
        .into_iter()
        .filter_map(|r| r.ok().and_then(Result::ok))
        .collect();
    let mut sync: Vec<f64> = match per_rank.as_slice() {
        [a, b] => a.iter().zip(b).map(|(x, y)| 0.5 * (x + y)).collect(),
        _ => vec![tiny],
    };
    sync.sort_by(f64::total_cmp);
    let small = sync[sync.len() / 2].max(1e-7);
    let big_bytes = 8.0 * 1024.0 * 1024.0;
    // two ranks: all-reduce = 2α + S/β (2(n−1)/n = 1)
    Link {
        bandwidth: big_bytes / (big - tiny).max(1e-9),
        latency: small / 2.0,
    }
}

/// The products a block and the head of `model` run for a micro-batch
/// of `tokens` tokens: `(m, k, n)` of `(m, k) × (k, n)`.
#[must_use]
pub fn block_products(model: &ModelSpec, tokens: usize) -> Vec<(usize, usize, usize)> {
    let (c, f) = (model.hidden, model.ffn_hidden);
    vec![
        (tokens, c, 3 * c),
        (tokens, c, c),
        (tokens, c, f),
        (tokens, f, c),
        (tokens, c, model.vocab),
    ]
}

impl MachineProfile {
    /// Measures this machine (a few seconds): the products of `model` for
    /// micro-batches of `tokens` tokens, with every core and with each pool
    /// a rank of a smaller share gets; the memory bandwidth and a tiny
    /// product's cost likewise; the thread backend's all-reduce
    /// (`reproducible`: in weft's exact sums, `parallel.reproducible`).
    ///
    /// # Panics
    /// If a rayon pool cannot be built (no threads can be started).
    #[must_use]
    pub fn measure(model: &ModelSpec, tokens: usize, reproducible: bool) -> Self {
        let cores = crate::ranks::cores();
        let shapes = block_products(model, tokens.max(1));
        let mut counts: Vec<usize> = (1..=cores).map(|r| (cores / r).max(1)).collect();
        counts.dedup();
        // three rounds, the best figure of each: a shared machine only
        // ever makes a measurement slower
        let per_threads = counts
            .into_iter()
            .map(|threads| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("a rayon pool");
                let mut best = ThreadFigures {
                    threads,
                    gemm_f32: 0.0,
                    gemm_bf16: 0.0,
                    overhead: f64::INFINITY,
                    memory_bandwidth: 0.0,
                };
                for _ in 0..3 {
                    pool.install(|| {
                        best.gemm_f32 = best.gemm_f32.max(gemm_rate(&shapes, Precision::F32));
                        best.gemm_bf16 = best.gemm_bf16.max(gemm_rate(&shapes, Precision::Bf16));
                        best.overhead = best.overhead.min(call_overhead());
                        best.memory_bandwidth = best.memory_bandwidth.max(triad_bandwidth());
                    });
                }
                best
            })
            .collect();
        MachineProfile {
            cpu: cpu_name(),
            cores,
            link: all_reduce_link(reproducible, shapes[0]),
            shapes,
            per_threads,
            reproducible,
            memory: available_memory(),
        }
    }

    /// The best figures of several measurements of this machine (the
    /// highest rates, the lowest costs): a shared machine only ever makes
    /// a measurement slower. α is the exception, their median: it is a
    /// difference of two timings, which noise moves either way. `None`
    /// when `profiles` is empty.
    #[must_use]
    pub fn best(profiles: &[MachineProfile]) -> Option<MachineProfile> {
        let (first, rest) = profiles.split_first()?;
        let mut best = first.clone();
        for p in rest {
            for f in &mut best.per_threads {
                if let Some(g) = p.per_threads.iter().find(|g| g.threads == f.threads) {
                    f.gemm_f32 = f.gemm_f32.max(g.gemm_f32);
                    f.gemm_bf16 = f.gemm_bf16.max(g.gemm_bf16);
                    f.overhead = f.overhead.min(g.overhead);
                    f.memory_bandwidth = f.memory_bandwidth.max(g.memory_bandwidth);
                }
            }
            best.link.bandwidth = best.link.bandwidth.max(p.link.bandwidth);
        }
        let mut alphas: Vec<f64> = profiles.iter().map(|p| p.link.latency).collect();
        alphas.sort_by(f64::total_cmp);
        best.link.latency = alphas[alphas.len() / 2];
        Some(best)
    }

    /// The figures of a rank of a job of `ranks` ranks: its pool has the
    /// cores shared out (`weft train`'s rule), at least one thread.
    #[must_use]
    pub fn figures(&self, ranks: usize) -> ThreadFigures {
        self.pool_figures((self.cores / ranks.max(1)).max(1))
    }

    /// The figures of a pool of `threads` threads (the nearest measured).
    #[must_use]
    pub fn pool_figures(&self, threads: usize) -> ThreadFigures {
        self.per_threads
            .iter()
            .copied()
            .min_by_key(|f| f.threads.abs_diff(threads))
            .unwrap_or(ThreadFigures {
                threads,
                gemm_f32: 1e9,
                gemm_bf16: 1e9,
                overhead: 0.0,
                memory_bandwidth: 1e9,
            })
    }

    /// This machine as a cluster of `ranks` CPU ranks: the planner shares
    /// a `Device::Cpu` cluster's rates out over its ranks, so the machine's
    /// rates are those of a rank's pool times the ranks that run at once;
    /// the measured rates are what the work reaches, so the efficiencies
    /// are 1.
    #[must_use]
    pub fn cluster(&self, ranks: usize) -> Cluster {
        self.cluster_at(ranks, (self.cores / ranks.max(1)).max(1), 1.0)
    }

    /// [`cluster`](Self::cluster) with pools of `threads` threads
    /// (`parallel.threads`) and products and element-wise work at
    /// `efficiency` of the measured rates: what a `weft train` step reaches
    /// of them ([`Calibration::efficiency`]).
    #[must_use]
    pub fn cluster_at(&self, ranks: usize, threads: usize, efficiency: f64) -> Cluster {
        let f = self.pool_figures(threads);
        let at_once = (self.cores / f.threads).max(1).min(ranks.max(1)) as f64;
        Cluster {
            name: format!("this machine ({})", self.cpu),
            gpus: ranks.max(1),
            gpus_per_node: ranks.max(1),
            memory: self.memory,
            memory_bandwidth: f.memory_bandwidth * at_once,
            launch_overhead: f.overhead,
            peak: Peak {
                fp32: f.gemm_f32 * at_once,
                bf16: f.gemm_bf16 * at_once,
                // no CPU here multiplies fp16: weft widens it to f32
                fp16: f.gemm_f32 * at_once,
            },
            intra: self.link,
            inter: self.link,
            efficiency: Efficiency {
                gemm: efficiency,
                memory: efficiency,
                link: 1.0,
            },
            device: Device::Cpu,
        }
    }
}

/// The model a job trains.
///
/// # Errors
/// [`PlanError::Config`] when the synthetic corpus' settings are wrong.
pub fn model_of(config: &Config) -> Result<ModelSpec, PlanError> {
    let vocab = if config.data.source == weft_data::Source::Synthetic {
        weft_data::SyntheticLanguage::new(config.data.synthetic.clone())
            .map_err(|e| ConfigError {
                origin: "config".into(),
                position: None,
                key: Some(format!("data.synthetic.{}", e.field)),
                message: e.problem,
            })?
            .vocab_size()
    } else {
        weft_data::GPT2_VOCAB
    };
    let m = &config.model;
    let mut spec = ModelSpec::gpt(m.n_layer, m.n_embd, m.n_head, m.block_size, vocab);
    if m.moe.experts > 0 {
        spec = spec.with_moe(m.moe.experts, m.moe.top_k);
        spec.shared_expert = m.moe.shared_expert;
    }
    Ok(spec)
}

/// The layout a job runs: its `[parallel]` table and micro-batch size.
///
/// # Errors
/// [`PlanError::Config`] when the batch does not split over the layout.
pub fn layout_of(config: &Config) -> Result<Layout, PlanError> {
    Ok(Layout {
        parallel: config.parallel,
        micro_batch_size: config.batch_split()?.micro,
        recompute: false,
    })
}

/// What a job's ranks hold and compute.
#[must_use]
pub fn recipe_of(config: &Config) -> Recipe {
    let mut r = Recipe::weft(config.train.precision);
    r.bf16_grad_wire = config.parallel.grad_wire == weft_numerics::Dtype::BF16;
    r
}

/// A calibration layout's figures: of one run, or of the quietest of
/// several rounds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Measured {
    /// Median seconds per step (the first fifth of the steps not counted);
    /// over rounds, the lowest round's.
    pub step_s: f64,
    /// The fastest step (of every round).
    pub best_step_s: f64,
    /// Each round's median seconds per step, in order (one for a single
    /// run): their spread is the machine's noise.
    pub round_step_s: Vec<f64>,
    /// Steps timed.
    pub steps: usize,
    /// Memory of rank 0 as the built model allocated it.
    pub memory: RankMemory,
}

/// Collects a run's start-up report and step times.
#[derive(Default)]
struct Recorder {
    info: Option<RunInfo>,
    steps: Vec<f64>,
}

impl Observer for Recorder {
    fn start(&mut self, info: &RunInfo) {
        self.info = Some(info.clone());
    }
    fn step(&mut self, report: &StepReport) {
        if let Some(info) = &self.info {
            self.steps
                .push(info.tokens_per_step as f64 / report.record.tokens_per_s);
        }
    }
}

/// Runs `config` for `steps` steps in a scratch folder under `dir` and
/// measures its step time and memory.
///
/// # Errors
/// [`PlanError::Train`] if the run fails.
pub fn run_layout(config: &Config, steps: u64, dir: &Path) -> Result<Measured, PlanError> {
    let mut cfg = config.clone();
    cfg.train.steps = steps;
    cfg.train.eval_every = 0;
    cfg.train.eval_sequences = 1;
    cfg.checkpoint.every = 0;
    cfg.run.dir = dir.to_owned();
    cfg.run.name = format!("calibrate-{}", layout_name(config));
    cfg.run.trace_steps = 0;
    let mut rec = Recorder::default();
    let layout = layout_name(config);
    crate::train::train(&cfg, false, &mut rec).map_err(|e| PlanError::Train {
        layout: layout.clone(),
        source: Box::new(e),
    })?;
    let _ = std::fs::remove_dir_all(dir.join(&cfg.run.name));
    let info = rec
        .info
        .ok_or_else(|| PlanError::Usage(format!("{layout}: no start-up report")))?;
    let skip = rec.steps.len() / 5;
    let mut timed: Vec<f64> = rec.steps[skip..].to_vec();
    timed.sort_by(f64::total_cmp);
    if timed.is_empty() {
        return Err(PlanError::Usage(format!("{layout}: no step was timed")));
    }
    Ok(Measured {
        step_s: timed[timed.len() / 2],
        best_step_s: timed[0],
        round_step_s: vec![timed[timed.len() / 2]],
        steps: timed.len(),
        memory: info.memory,
    })
}

fn layout_name(config: &Config) -> String {
    layout_of(config).map_or_else(
        |_| "layout".into(),
        |l| l.to_string().replace([' ', '/'], "_"),
    )
}

/// One calibration layout: predicted against measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CalibrationRow {
    /// The `--set` arguments of the layout.
    pub sets: Vec<String>,
    /// Kernel threads of each rank.
    pub threads: usize,
    /// Whether this is the one-rank reference its pool size's efficiency
    /// was measured on (its prediction then matches by construction).
    pub reference: bool,
    /// The planner's prediction.
    pub predicted: Prediction,
    /// What the run measured.
    pub measured: Measured,
    /// `(predicted − measured) / measured` of the step time (the median
    /// step).
    pub step_error: f64,
    /// The same against the fastest step: the measurements of the machine
    /// are each the best of several (a shared machine only slows them), so
    /// this compares like with like; the median includes other jobs.
    pub fastest_error: f64,
    /// `(predicted − measured) / measured` of rank 0's memory.
    pub memory_error: f64,
}

/// The layouts `--calibrate` runs: dp=1, dp=2, dp=2 with FSDP (ZeRO-3),
/// tp=2, pp=2 (1F1B), as `--set` arguments.
#[must_use]
pub fn calibration_layouts() -> Vec<Vec<String>> {
    [
        vec![],
        vec!["parallel.dp=2"],
        vec!["parallel.dp=2", "parallel.fsdp=\"full\""],
        vec!["parallel.tp=2"],
        vec!["parallel.pp=2"],
    ]
    .into_iter()
    .map(|v| v.into_iter().map(str::to_owned).collect())
    .collect()
}

/// What `--calibrate` found.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Calibration {
    /// This machine: the best figures of every round's measurement.
    pub machine: MachineProfile,
    /// Rounds run (each runs every layout, then measures the machine).
    pub rounds: usize,
    /// For each pool size the layouts' ranks have: the share of the
    /// measured product and memory rates a `weft train` step reaches,
    /// measured on a one-rank job with that pool (the reference). What a
    /// step does besides products and element-wise passes — the pool's
    /// wake-ups, copies and zeroing, the exact sums — makes it less than
    /// 1. Every layout is predicted at its pool's.
    pub efficiency: Vec<PoolEfficiency>,
    /// Each layout, predicted from `machine` against its quietest round;
    /// the references (one rank, a pool of each size) first, flagged.
    pub layouts: Vec<CalibrationRow>,
}

/// A pool size's step efficiency ([`Calibration::efficiency`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PoolEfficiency {
    /// Kernel threads of the pool.
    pub threads: usize,
    /// The share of the measured rates a step reaches.
    pub efficiency: f64,
}

/// Runs each layout of `layouts` (as `--set` arguments over `base`) for
/// `steps` steps and measures this machine, `rounds` times over, with a
/// one-rank reference job for each pool size the layouts' ranks have
/// (`parallel.threads`); then predicts each layout from the machine's best
/// figures, at its pool's efficiency measured on its reference, and
/// compares the prediction with the layout's quietest round (the lowest
/// median step) and its fastest step. Both sides are thus the machine at
/// its least disturbed: a shared machine's other jobs come and go over
/// seconds, and slow whatever runs meanwhile — a measurement or a layout
/// — never speed it up.
///
/// # Errors
/// A layout's configuration error (before anything runs); the planner's;
/// a run's.
pub fn calibrate(
    base: &Config,
    layouts: &[Vec<String>],
    steps: u64,
    rounds: usize,
    say: &mut dyn FnMut(&str),
) -> Result<Calibration, PlanError> {
    let rounds = rounds.max(1);
    let model = model_of(base)?;
    let tokens = base
        .batch_split()
        .map_or(model.seq, |b| b.micro * model.seq);
    struct Job {
        sets: Vec<String>,
        cfg: Config,
        layout: Layout,
        threads: usize,
        reference: bool,
    }
    let job = |sets: &[String], reference: bool| -> Result<Job, PlanError> {
        let mut cfg = base.clone();
        for s in sets {
            cfg = cfg.with_override(s)?;
        }
        cfg.validate()?;
        let layout = layout_of(&cfg)?;
        let threads = crate::ranks::threads_per_rank(layout.world(), cfg.parallel.threads);
        Ok(Job {
            sets: sets.to_vec(),
            cfg,
            layout,
            threads,
            reference,
        })
    };
    let mut jobs = Vec::with_capacity(layouts.len() + 2);
    for sets in layouts {
        jobs.push(job(sets, false)?);
    }
    // a one-rank reference for each pool size: a layout itself, or the
    // job on one rank with that pool
    let mut pools: Vec<usize> = jobs.iter().map(|j| j.threads).collect();
    pools.sort_unstable();
    pools.dedup();
    let mut references = Vec::new();
    for &t in &pools {
        if let Some(j) = jobs
            .iter_mut()
            .find(|j| j.layout.world() == 1 && j.threads == t)
        {
            j.reference = true;
        } else {
            let sets: Vec<String> = [
                "parallel.dp=1",
                "parallel.tp=1",
                "parallel.pp=1",
                "parallel.ep=1",
                "parallel.fsdp=\"none\"",
                "parallel.sequence_parallel=false",
            ]
            .iter()
            .map(|s| (*s).to_owned())
            .chain([format!("parallel.threads={t}")])
            .collect();
            references.push(job(&sets, true)?);
        }
    }
    references.append(&mut jobs);
    let mut jobs = references;
    jobs.sort_by_key(|j| !j.reference);
    let dir = std::env::temp_dir().join(format!("weft-plan-calibrate-{}", std::process::id()));
    let mut profiles = Vec::with_capacity(rounds);
    let mut runs: Vec<Vec<Measured>> = vec![Vec::with_capacity(rounds); jobs.len()];
    for round in 1..=rounds {
        for (j, got) in jobs.iter().zip(&mut runs) {
            let m = run_layout(&j.cfg, steps, &dir)?;
            say(&format!(
                "calibrate     round {round}/{rounds}: {} ({} thread{}{}): {steps} steps, median {:.2} ms",
                j.layout,
                j.threads,
                if j.threads == 1 { "" } else { "s" },
                if j.reference { ", reference" } else { "" },
                1e3 * m.step_s
            ));
            got.push(m);
        }
        say(&format!(
            "calibrate     round {round}/{rounds}: measuring this machine"
        ));
        profiles.push(MachineProfile::measure(
            &model,
            tokens,
            base.parallel.reproducible,
        ));
    }
    let _ = std::fs::remove_dir_all(&dir);
    let machine = MachineProfile::best(&profiles)
        .ok_or_else(|| PlanError::Usage("calibration needs at least one round".into()))?;
    let measured: Vec<Measured> = runs
        .iter()
        .filter_map(|got| {
            let quietest = got.iter().min_by(|a, b| a.step_s.total_cmp(&b.step_s))?;
            Some(Measured {
                step_s: quietest.step_s,
                best_step_s: got
                    .iter()
                    .map(|m| m.best_step_s)
                    .fold(f64::INFINITY, f64::min),
                round_step_s: got.iter().map(|m| m.step_s).collect(),
                steps: quietest.steps,
                memory: quietest.memory,
            })
        })
        .collect();
    let request = |j: &Job, efficiency: f64| Request {
        model: model.clone(),
        batch: j.cfg.train.batch_size,
        cluster: machine.cluster_at(j.layout.world(), j.threads, efficiency),
        recipe: recipe_of(&j.cfg),
    };
    // each pool's efficiency: its reference's prediction brought to its
    // measurement (products and element-wise work scale with it; the
    // kernels' fixed costs do not, hence a few rounds of the fixed point)
    let mut efficiency = Vec::with_capacity(pools.len());
    for (j, m) in jobs.iter().zip(&measured).filter(|(j, _)| j.reference) {
        let mut e = 1.0;
        for _ in 0..4 {
            let p = weft_plan::predict(&request(j, e), &j.layout)?;
            e = (e * p.step_s / m.step_s).clamp(0.05, 2.0);
        }
        efficiency.push(PoolEfficiency {
            threads: j.threads,
            efficiency: e,
        });
    }
    let mut rows = Vec::with_capacity(jobs.len());
    for (j, measured) in jobs.iter().zip(measured) {
        let e = efficiency
            .iter()
            .find(|p| p.threads == j.threads)
            .map_or(1.0, |p| p.efficiency);
        let predicted = weft_plan::predict(&request(j, e), &j.layout)?;
        let total = measured.memory.total() as f64;
        rows.push(CalibrationRow {
            sets: j.sets.clone(),
            threads: j.threads,
            reference: j.reference,
            step_error: (predicted.step_s - measured.step_s) / measured.step_s,
            fastest_error: (predicted.step_s - measured.best_step_s) / measured.best_step_s,
            memory_error: (predicted.memory_rank0.total() as f64 - total) / total,
            predicted,
            measured,
        });
    }
    Ok(Calibration {
        machine,
        rounds,
        efficiency,
        layouts: rows,
    })
}

fn mb(b: f64) -> String {
    format!("{:.1} MB", b / 1e6)
}

/// The calibration as a Markdown table, with the machine it ran on.
#[must_use]
pub fn calibration_table(cal: &Calibration) -> String {
    let profile = &cal.machine;
    let figs: Vec<String> = profile
        .per_threads
        .iter()
        .map(|f| {
            format!(
                "{} thread(s): f32 products {:.1} GFLOP/s, bf16 {:.1}, {:.1} µs per call, memory {:.1} GB/s",
                f.threads,
                f.gemm_f32 / 1e9,
                f.gemm_bf16 / 1e9,
                f.overhead * 1e6,
                f.memory_bandwidth / 1e9
            )
        })
        .collect();
    let mut s = format!(
        "this machine (best of {} round(s)): {} ({} cores); {}; all-reduce between 2 thread ranks{}: α {:.1} µs, β {:.2} GB/s\n\
         weft train's step reaches {} of these product and memory rates (measured on one rank, the reference; every other layout is predicted)\n\n\
         | layout | threads per rank | predicted step | measured step (median{}) | error | fastest step | error | each round's median | predicted memory (rank 0) | measured memory | error |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
        cal.rounds,
        profile.cpu,
        profile.cores,
        figs.join("; "),
        if profile.reproducible {
            " (reproducible sums)"
        } else {
            ""
        },
        profile.link.latency * 1e6,
        profile.link.bandwidth / 1e9,
        cal.efficiency
            .iter()
            .map(|p| format!(
                "{:.1}% with {} thread{}",
                100.0 * p.efficiency,
                p.threads,
                if p.threads == 1 { "" } else { "s" }
            ))
            .collect::<Vec<_>>()
            .join(", "),
        if cal.rounds > 1 {
            ", quietest round"
        } else {
            ""
        }
    );
    for r in &cal.layouts {
        let rounds: Vec<String> = r
            .measured
            .round_step_s
            .iter()
            .map(|t| format!("{:.1}", 1e3 * t))
            .collect();
        s.push_str(&format!(
            "| {}{} | {} | {:.2} ms | {:.2} ms | {:+.1}% | {:.2} ms | {:+.1}% | {} ms | {} | {} | {:+.2}% |\n",
            r.predicted.layout,
            if r.reference { " (reference)" } else { "" },
            r.threads,
            1e3 * r.predicted.step_s,
            1e3 * r.measured.step_s,
            100.0 * r.step_error,
            1e3 * r.measured.best_step_s,
            100.0 * r.fastest_error,
            rounds.join(", "),
            mb(r.predicted.memory_rank0.total() as f64),
            mb(r.measured.memory.total() as f64),
            100.0 * r.memory_error
        ));
    }
    s
}

/// One layout of the JSON output.
#[derive(Serialize)]
struct JsonLayout<'a> {
    /// The layout in one line (`dp=2 tp=4 pp=2 fsdp=full 1f1b mbs=1`).
    name: String,
    #[serde(flatten)]
    prediction: &'a Prediction,
    memory_total: u64,
    reason: String,
}

#[derive(Serialize)]
struct JsonPlan<'a> {
    model: &'a ModelSpec,
    batch: usize,
    cluster: &'a Cluster,
    recipe: &'a Recipe,
    layouts: Vec<JsonLayout<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    explain: Option<&'a weft_plan::explain::Explanation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    budget: Option<&'a weft_plan::budget::BudgetReport>,
}

fn usage(msg: impl Into<String>) -> PlanError {
    PlanError::Usage(msg.into())
}

/// The request `args` describe (the model, batch, cluster and recipe),
/// and the job configuration when one is given.
///
/// # Errors
/// A bad configuration, cluster file or preset, or a missing dimension.
pub fn request(args: &PlanArgs) -> Result<(Request, Option<Config>), PlanError> {
    let config = if args.config.is_some() || !args.sets.is_empty() {
        Some(Config::load(args.config.as_deref(), &args.sets)?)
    } else {
        None
    };
    let mut model = match &config {
        Some(c) => model_of(c)?,
        None => {
            let need = |v: Option<usize>, flag: &str| {
                v.ok_or_else(|| usage(format!("{flag} is required without --config (the model's dimensions: --layers --hidden --heads --seq --vocab)")))
            };
            ModelSpec::gpt(
                need(args.layers, "--layers")?,
                need(args.hidden, "--hidden")?,
                need(args.heads, "--heads")?,
                need(args.seq, "--seq")?,
                need(args.vocab, "--vocab")?,
            )
        }
    };
    if let Some(v) = args.layers {
        model.layers = v;
    }
    if let Some(v) = args.hidden {
        model.hidden = v;
        model.ffn_hidden = 4 * v;
    }
    if let Some(v) = args.heads {
        model.heads = v;
    }
    if let Some(v) = args.seq {
        model.seq = v;
    }
    if let Some(v) = args.vocab {
        model.vocab = v;
    }
    if let Some(v) = args.ffn_hidden {
        model.ffn_hidden = v;
    }
    if let Some(e) = args.experts {
        model.experts = e;
        if model.top_k == 0 && e > 0 {
            model.top_k = 2;
        }
    }
    if let Some(k) = args.top_k {
        model.top_k = k;
    }
    model.validate()?;
    let batch = match (args.global_batch, &config) {
        (Some(b), _) => b,
        (None, Some(c)) => c.train.batch_size,
        (None, None) => return Err(usage("--global-batch is required without --config")),
    };
    let this_machine = args.cluster == "this-machine";
    let cluster = if this_machine {
        let ranks = args
            .gpus
            .or_else(|| config.as_ref().map(|c| c.parallel.world_size()))
            .unwrap_or(1);
        let reproducible = config.as_ref().is_none_or(|c| c.parallel.reproducible);
        // the products of this model, at a micro-batch of one rank's share
        let tokens = (batch / ranks).clamp(1, 16) * model.seq;
        MachineProfile::measure(&model, tokens.min(4096), reproducible).cluster(ranks)
    } else if args.cluster.ends_with(".toml") || Path::new(&args.cluster).is_file() {
        let c = Cluster::from_file(Path::new(&args.cluster))?;
        match args.gpus {
            Some(g) => c.with_gpus(g),
            None => c,
        }
    } else {
        Cluster::preset(&args.cluster, args.gpus.unwrap_or(8))?
    };
    let accounting = match args.recipe.as_deref() {
        Some("weft") => Accounting::Weft,
        Some("mixed") => Accounting::Mixed,
        Some(other) => return Err(usage(format!("--recipe {other}: expected weft or mixed"))),
        None if cluster.device == Device::Cpu => Accounting::Weft,
        None => Accounting::Mixed,
    };
    let mut recipe = match accounting {
        Accounting::Weft => config
            .as_ref()
            .map_or(Recipe::weft(Precision::F32), recipe_of),
        Accounting::Mixed => Recipe::mixed(),
    };
    if let Some(p) = &args.precision {
        recipe.precision = p
            .parse()
            .map_err(|_| usage(format!("--precision {p}: expected fp32, bf16 or fp16")))?;
    }
    if args.materialized_attention {
        recipe.flash_attention = false;
    }
    Ok((
        Request {
            model,
            batch,
            cluster,
            recipe,
        },
        config,
    ))
}

fn constraints(args: &PlanArgs) -> Result<Constraints, PlanError> {
    let fsdp = match args.fsdp.as_deref() {
        None => None,
        Some("none") => Some(None),
        Some(name) => {
            let s: Strategy = name.parse().map_err(|_| {
                usage(format!(
                    "--fsdp {name}: expected none, optimizer, grad_op, full or hybrid"
                ))
            })?;
            if s == Strategy::Hybrid && args.hybrid_shard.is_none() {
                return Err(usage("--fsdp hybrid needs --hybrid-shard N"));
            }
            Some(Some(s))
        }
    };
    let schedule = match args.schedule.as_deref() {
        None => None,
        Some(name) => Some(name.parse::<ScheduleKind>().map_err(|_| {
            usage(format!(
                "--schedule {name}: expected gpipe, 1f1b, interleaved, zb-h1, zb-h2 or zb-v"
            ))
        })?),
    };
    Ok(Constraints {
        dp: args.dp,
        tp: args.tp,
        pp: args.pp,
        ep: args.ep,
        fsdp,
        hybrid_shard: args.hybrid_shard,
        schedule,
        pp_chunks: args.chunks,
        micro_batch_size: args.micro_batch,
        sequence_parallel: args.sp,
        allow_recompute: args.recompute,
        max_micro_batch: None,
    })
}

fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else {
        format!("{:.2} ms", 1e3 * s)
    }
}

fn gib(b: u64) -> String {
    weft_plan::memory::bytes(b)
}

/// The table of the best layouts.
fn table(req: &Request, preds: &[Prediction], top: usize) -> String {
    let mut s = format!(
        "model: {} layers, hidden {}, {} heads, seq {}, vocab {}{}; {:.3}B parameters; global batch {} ({} tokens)\n\
         cluster: {}\n\
         recipe: {} accounting, {} products{}\n\n",
        req.model.layers,
        req.model.hidden,
        req.model.heads,
        req.model.seq,
        req.model.vocab,
        if req.model.is_moe() {
            format!(", {} experts top-{}", req.model.experts, req.model.top_k)
        } else {
            String::new()
        },
        req.model.params() / 1e9,
        req.batch,
        req.batch * req.model.seq,
        req.cluster,
        match req.recipe.accounting {
            Accounting::Weft => "weft",
            Accounting::Mixed => "mixed-precision",
        },
        req.recipe.precision.name(),
        if req.recipe.accounting == Accounting::Mixed && req.recipe.flash_attention {
            ", flash attention"
        } else {
            ""
        },
    );
    s.push_str(
        "| # | layout | fits | memory/GPU | params | grads | optimizer | activations | buffers | step | compute | tp | dp exposed | bubble | tokens/s | TFLOP/s/GPU | MFU |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let n = if top == 0 {
        preds.len()
    } else {
        top.min(preds.len())
    };
    for (i, p) in preds.iter().take(n).enumerate() {
        let m = &p.memory;
        let t = &p.time;
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1}% | {:.0} | {:.2} | {:.1}% |\n",
            i + 1,
            p.layout,
            if p.fits { "yes" } else { "no" },
            gib(m.total()),
            gib(m.params),
            gib(m.grads),
            gib(m.optimizer),
            gib(m.activations),
            gib(m.buffers),
            secs(p.step_s),
            secs(t.compute),
            secs(t.tp_comm),
            secs(t.dp_exposed),
            100.0 * t.bubble_fraction,
            p.tokens_per_s,
            p.tflops_per_gpu,
            100.0 * p.mfu
        ));
    }
    s.push('\n');
    for (i, p) in preds.iter().take(n).enumerate() {
        s.push_str(&format!(
            "{}. {}: {}\n",
            i + 1,
            p.layout,
            reason(p, &preds[0])
        ));
    }
    if preds.len() > n {
        s.push_str(&format!(
            "({} more layouts; --top 0 shows all, --json gives every figure)\n",
            preds.len() - n
        ));
    }
    s
}

/// The step-time plot's strategies: replicas, FSDP and the best layout
/// of any kind, at each power-of-two GPU count up to the cluster's.
fn strategies(req: &Request) -> Vec<(String, Vec<(usize, Prediction)>)> {
    let pure = |s: Option<Strategy>| Constraints {
        tp: Some(1),
        pp: Some(1),
        ep: Some(1),
        fsdp: Some(s),
        ..Constraints::default()
    };
    let kinds: [(&str, Constraints); 3] = [
        ("data parallel (replicas)", pure(None)),
        ("FSDP (ZeRO-3)", pure(Some(Strategy::Full))),
        ("best layout (tp, pp, FSDP...)", Constraints::default()),
    ];
    let mut out = Vec::new();
    for (name, c) in kinds {
        let mut pts = Vec::new();
        let mut g = 1usize;
        while g <= req.cluster.gpus.max(1) {
            let r = Request {
                cluster: req.cluster.clone().with_gpus(g),
                ..req.clone()
            };
            let c = if g == 1 && c.fsdp == Some(Some(Strategy::Full)) {
                pure(None)
            } else {
                c.clone()
            };
            if let Ok(v) = search(&r, &c)
                && let Some(p) = v.into_iter().find(|p| p.fits)
            {
                pts.push((g, p));
            }
            g *= 2;
        }
        out.push((name.to_owned(), pts));
    }
    out
}

/// Runs `weft plan` and returns what it prints; `say` receives progress.
///
/// # Errors
/// Bad flags, configuration or cluster; the planner's errors; a failed
/// calibration run; a plot that cannot be written.
pub fn run(args: &PlanArgs, say: &mut dyn FnMut(&str)) -> Result<String, PlanError> {
    if args.published {
        let a100 = Cluster::preset("a100-80gb", 8)?;
        let rows = weft_plan::published::compare(&weft_plan::published::MEGATRON_2021, &a100)?;
        if args.json {
            return Ok(serde_json::to_string_pretty(&rows).unwrap_or_default());
        }
        let worst = rows.iter().map(|r| r.error.abs()).fold(0.0, f64::max);
        return Ok(format!(
            "Narayanan et al. 2021 (Megatron-LM), Table 1, on the a100-80gb preset:\n\n{}\nworst error {:.1}%",
            weft_plan::published::table(&rows),
            100.0 * worst
        ));
    }
    if args.calibrate {
        let base = Config::load(args.config.as_deref(), &args.sets)?;
        let cal = calibrate(
            &base,
            &calibration_layouts(),
            args.calibrate_steps.max(5),
            args.calibrate_rounds.max(1),
            say,
        )?;
        if args.json {
            return Ok(serde_json::to_string_pretty(&cal).unwrap_or_default());
        }
        return Ok(calibration_table(&cal));
    }
    let (req, _) = request(args)?;
    let c = constraints(args)?;
    let preds = search(&req, &c)?;
    let explanation = if args.explain {
        Some(weft_plan::explain::explain(&req)?)
    } else {
        None
    };
    let best = preds.iter().find(|p| p.fits).unwrap_or(&preds[0]);
    let budget = match (args.budget_flops, args.budget_gpu_hours) {
        (Some(_), Some(_)) => {
            return Err(usage("give --budget-flops or --budget-gpu-hours, not both"));
        }
        (Some(f), None) if f.is_finite() && f > 0.0 => Some(weft_plan::budget::report(
            f,
            req.model.params(),
            best.tokens_per_s,
            req.cluster.gpus,
        )),
        (None, Some(h)) if h.is_finite() && h > 0.0 => {
            // the GPU-hours deliver the best layout's model FLOP/s per GPU
            let flops = h * 3600.0 * best.tflops_per_gpu * 1e12;
            Some(weft_plan::budget::report(
                flops,
                req.model.params(),
                best.tokens_per_s,
                req.cluster.gpus,
            ))
        }
        (None, None) => None,
        _ => return Err(usage("a budget must be a positive number")),
    };
    if let Some(dir) = &args.plot {
        std::fs::create_dir_all(dir).map_err(|source| PlanError::Io {
            path: dir.clone(),
            source,
        })?;
        let fsdp = explanation.as_ref().map_or_else(
            || weft_plan::explain::crossover(&req, &req.model, req.batch),
            |e| e.crossover.clone(),
        );
        let top = if args.top == 0 {
            preds.len()
        } else {
            args.top.min(preds.len())
        };
        for (name, svg) in [
            (
                "step_time.svg",
                weft_plan::svg::step_time_plot(&strategies(&req), &fsdp),
            ),
            ("memory.svg", weft_plan::svg::memory_plot(&preds[..top])),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, svg).map_err(|source| PlanError::Io {
                path: path.clone(),
                source,
            })?;
            say(&format!("wrote         {}", path.display()));
        }
    }
    if args.json {
        let top = if args.top == 0 {
            preds.len()
        } else {
            args.top.min(preds.len())
        };
        let out = JsonPlan {
            model: &req.model,
            batch: req.batch,
            cluster: &req.cluster,
            recipe: &req.recipe,
            layouts: preds[..top]
                .iter()
                .map(|p| JsonLayout {
                    name: p.layout.to_string(),
                    prediction: p,
                    memory_total: p.memory.total(),
                    reason: reason(p, &preds[0]),
                })
                .collect(),
            explain: explanation.as_ref(),
            budget: budget.as_ref(),
        };
        return Ok(serde_json::to_string_pretty(&out).unwrap_or_default());
    }
    let mut s = table(&req, &preds, args.top);
    if let Some(e) = &explanation {
        s.push_str(&format!("\nThe chain for this model:\n{e}\n"));
    }
    if let Some(b) = &budget {
        s.push_str(&format!(
            "\nBudget {:.3e} FLOPs: Chinchilla-optimal {:.2}B parameters on {:.1}B tokens (Hoffmann et al. 2022: N = sqrt(C/120), D = 20·N; approach-3 loss {:.3}).\n\
             This model ({:.2}B parameters) at the best layout ({}, {:.0} tokens/s): the budget buys {:.1}B tokens in {:.1} days ({:.0} GPU-hours); \
             its compute-optimal {:.1}B tokens take {:.1} days.\n",
            b.optimum.flops,
            b.optimum.params / 1e9,
            b.optimum.tokens / 1e9,
            b.optimum.loss,
            b.params / 1e9,
            best.layout,
            b.tokens_per_s,
            b.tokens / 1e9,
            b.days,
            b.gpu_hours,
            b.optimal_tokens / 1e9,
            b.optimal_days
        ));
    }
    Ok(s)
}
