//! This machine, measured: what `weft plan --cluster this-machine` and
//! `--calibrate` plan with ([`MachineProfile::measure`]).
//!
//! The rate of the kernels' f32 and bf16 products at the shapes the job's
//! blocks and head multiply (forward and backward: a CPU's GEMM rate
//! depends on the shapes and on what stays in cache, so a large product's
//! "peak" would misstate a small model's), with every core and with each
//! smaller pool a rank gets when a job's ranks share the cores out; a tiny
//! product's time (a kernel call's fixed cost); the memory bandwidth of a
//! triad over 64 MiB; the thread backend's all-reduce between two ranks —
//! its bandwidth β from 8 MiB less 1 KiB back to back, its latency α at
//! 1 KiB between ranks that compute in between (a product each on its own
//! pool), timed on both ranks, so that α is what a collective costs inside
//! a step, the ranks' drift and the sleeping peer's wake-up included — in
//! the job's reproducible or plain sums; the memory available. Attention's
//! products are charged at the GEMM rate, element-wise work at the triad's
//! bandwidth. [`MachineProfile::cluster`] turns the figures into a
//! [`Cluster`] of CPU ranks.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::cluster::{Cluster, Device, Efficiency, Link, Peak, Precision};
use crate::model::ModelSpec;

/// Cores available to this process.
#[must_use]
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
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

/// Elements of the large all-reduce of a link's measurement (8 MiB).
const LINK_BIG: usize = 2 << 20;
/// Elements of the small one (1 KiB).
const LINK_TINY: usize = 256;

/// All-reduces a link's measurement times back to back.
const BACK_TO_BACK: usize = 10;

/// The fastest of [`BACK_TO_BACK`] all-reduces of `len` `f32`s, each after
/// a barrier.
fn back_to_back(
    comm: &(impl weft_collectives::Communicator + ?Sized),
    len: usize,
    opts: &weft_collectives::ReduceOptions,
) -> weft_collectives::Result<f64> {
    use weft_collectives::CommunicatorExt;
    let mut buf = vec![1e-3f32; len];
    let mut best = f64::INFINITY;
    for _ in 0..BACK_TO_BACK {
        comm.barrier()?;
        let t = Instant::now();
        comm.all_reduce_with(&mut buf, opts)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// A link as two ranks' all-reduce meets it, and what its bytes cost the
/// cores of the machine both ranks run on ([`link_between`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkCost {
    /// α and β.
    pub link: Link,
    /// Seconds of the whole machine's cores per byte sent over the link:
    /// what moving it takes from compute on nodes that share one machine
    /// ([`Cluster::network_cpu`]).
    pub cpu_per_byte: f64,
}

/// Products a rank's pool of `threads` completes per second, on its own
/// thread, until `stop` (or for `alone` seconds when `stop` is `None`).
fn product_rate(threads: usize, stop: Option<&std::sync::atomic::AtomicBool>, alone: f64) -> f64 {
    use std::sync::atomic::Ordering;
    const SHAPE: (usize, usize, usize) = (128, 128, 128);
    let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(threads).build() else {
        return 0.0;
    };
    let (m, k, n) = SHAPE;
    let (a, w, mut out) = (vec![0.5f32; m * k], vec![0.25f32; k * n], vec![0f32; m * n]);
    let start = Instant::now();
    let mut done = 0usize;
    loop {
        pool.install(|| product(&mut out, &a, &w, SHAPE));
        done += 1;
        let over = match stop {
            Some(s) => s.load(Ordering::Relaxed),
            None => start.elapsed().as_secs_f64() >= alone,
        };
        if over {
            return done as f64 / start.elapsed().as_secs_f64();
        }
    }
}

/// The link between the two ranks of `comm` (of any backend: MPI
/// processes on two nodes, say) as its all-reduce meets it: β from 8 MiB
/// all-reduces back to back less 1 KiB ones (two ranks: `2α + S/β`, so
/// the difference is the transfer alone), α from the 1 KiB ones (half
/// their time); and what the bytes take from compute on the machine's
/// cores: each rank's products (a pool of half the cores, so the two
/// ranks fill the machine) run alone, then beside the 8 MiB all-reduces
/// again; the share of their rate lost, over the all-reduces' time and
/// the bytes both ranks sent (each `S` an all-reduce), is
/// [`LinkCost::cpu_per_byte`] (on ranks of one machine: the kernel's
/// network stack, the MPI library's copies and its waits' polls).
/// `reproducible`: in weft's exact sums. Every rank must call it; each
/// returns its own timing.
///
/// # Errors
/// A collective's failure, or `comm` not of two ranks.
pub fn link_between(
    comm: &(impl weft_collectives::Communicator + ?Sized),
    reproducible: bool,
) -> weft_collectives::Result<LinkCost> {
    use weft_collectives::{CommunicatorExt, ReduceOp, ReduceOptions};
    if comm.size() != 2 {
        return Err(weft_collectives::Error::InvalidArgument {
            op: weft_collectives::OpKind::AllReduce,
            arg: "comm",
            reason: format!("a link is measured between 2 ranks, not {}", comm.size()),
        });
    }
    let opts = ReduceOptions::new(ReduceOp::Sum).reproducible(reproducible);
    let big = back_to_back(comm, LINK_BIG, &opts)?;
    let tiny = back_to_back(comm, LINK_TINY, &opts)?;
    // the products alone, both ranks at once, then beside the transfers
    let threads = (cores() / 2).max(1);
    comm.barrier()?;
    let alone = product_rate(threads, None, 0.5);
    comm.barrier()?;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (beside, seconds) = std::thread::scope(|s| {
        let rate = s.spawn(|| product_rate(threads, Some(&stop), 0.0));
        let t = Instant::now();
        let r = back_to_back(comm, LINK_BIG, &opts);
        let seconds = t.elapsed().as_secs_f64();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let beside = rate.join().unwrap_or(0.0);
        r.map(|_| (beside, seconds))
    })?;
    // both ranks' loss: their mean share of the machine's cores
    let mut lost = [((1.0 - beside / alone.max(1e-9)).max(0.0) * seconds) as f32];
    comm.all_reduce_with(&mut lost, &ReduceOptions::new(ReduceOp::Sum))?;
    let sent = (BACK_TO_BACK * 2 * 4 * LINK_BIG) as f64;
    let cpu_per_byte = f64::from(lost[0]) / 2.0 / sent;
    Ok(LinkCost {
        link: Link {
            bandwidth: 4.0 * LINK_BIG as f64 / (big - tiny).max(1e-9),
            latency: tiny / 2.0,
        },
        cpu_per_byte,
    })
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
    let threads = (cores() / 2).max(1);
    let opts = ReduceOptions::new(ReduceOp::Sum).reproducible(reproducible);
    let slowest = |v: Vec<weft_collectives::Result<weft_collectives::Result<f64>>>| {
        v.into_iter()
            .filter_map(|r| r.ok().and_then(Result::ok))
            .fold(0.0f64, f64::max)
    };
    let back_to_back = |len: usize| {
        slowest(LocalCluster::builder(2).run_each(|comm| back_to_back(&comm, len, &opts)))
    };
    let big = back_to_back(LINK_BIG);
    let tiny = back_to_back(LINK_TINY);
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
    let big_bytes = 4.0 * LINK_BIG as f64;
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
        (tokens, c, model.q_dim() + 2 * model.kv_dim()),
        (tokens, model.q_dim(), c),
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
        let cores = cores();
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
    /// of them ([`Calibration::efficiency`](crate::calibrate::Calibration::efficiency)).
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
            network_cpu: 0.0,
        }
    }
}

impl MachineProfile {
    /// [`cluster_at`](Self::cluster_at) for ranks on nodes of their own
    /// network that share this machine's cores ([`Device::CpuNodes`]),
    /// `per_node` to a node, over the links `net` measured: `inter` is a
    /// rank's share of its node's link.
    #[must_use]
    pub fn cluster_on_nodes(
        &self,
        ranks: usize,
        per_node: usize,
        threads: usize,
        efficiency: f64,
        net: &crate::calibrate::Network,
    ) -> Cluster {
        let per_node = per_node.clamp(1, ranks.max(1));
        Cluster {
            name: format!("nodes of this machine ({})", self.cpu),
            gpus_per_node: per_node,
            intra: net.intra,
            inter: Link {
                bandwidth: net.node.bandwidth / per_node as f64,
                latency: net.node.latency,
            },
            device: Device::CpuNodes,
            network_cpu: net.cpu_per_byte,
            ..self.cluster_at(ranks, threads, efficiency)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Between two thread ranks: a link with a positive rate, and one
    /// cost to the cores per byte that both ranks report alike (they
    /// sum their losses), finite and not negative.
    #[test]
    fn link_between_measures_the_link_and_its_cost_to_the_cores() {
        let costs: Vec<LinkCost> = weft_collectives::LocalCluster::builder(2)
            .run_each(|comm| link_between(&comm, true))
            .into_iter()
            .map(|r| r.unwrap().unwrap())
            .collect();
        assert_eq!(costs.len(), 2);
        for c in &costs {
            assert!(
                c.link.bandwidth.is_finite() && c.link.bandwidth > 0.0,
                "{c:?}"
            );
            assert!(c.link.latency.is_finite() && c.link.latency > 0.0, "{c:?}");
            assert!(c.cpu_per_byte.is_finite() && c.cpu_per_byte >= 0.0, "{c:?}");
        }
        assert_eq!(costs[0].cpu_per_byte, costs[1].cpu_per_byte);
    }

    /// The best of several measurements takes each figure's best, and α's
    /// median.
    #[test]
    fn machine_profile_best_takes_each_figure_s_best() {
        let a = MachineProfile {
            cpu: "test".into(),
            cores: 2,
            shapes: vec![(64, 32, 96)],
            per_threads: vec![ThreadFigures {
                threads: 2,
                gemm_f32: 1e11,
                gemm_bf16: 1e11,
                overhead: 2e-7,
                memory_bandwidth: 3e10,
            }],
            link: Link {
                bandwidth: 4e9,
                latency: 7e-5,
            },
            reproducible: false,
            memory: 8e9,
        };
        let mut b = a.clone();
        b.per_threads[0].gemm_f32 *= 2.0;
        b.per_threads[0].overhead *= 2.0;
        b.link.latency /= 2.0;
        b.link.bandwidth /= 2.0;
        let mut c = a.clone();
        c.link.latency *= 4.0;
        let best = MachineProfile::best(&[a.clone(), b.clone(), c]).unwrap();
        assert_eq!(best.per_threads[0].gemm_f32, b.per_threads[0].gemm_f32);
        assert_eq!(best.per_threads[0].overhead, a.per_threads[0].overhead);
        assert_eq!(best.link.bandwidth, a.link.bandwidth);
        // α: the median (a difference of timings, noisy either way)
        assert_eq!(best.link.latency, a.link.latency);
        assert!(MachineProfile::best(&[]).is_none());
    }
}
