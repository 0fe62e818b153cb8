//! nccl-tests-style table for the local backend, with the machine's memcpy
//! bandwidth beside it (the physical limit of a shared-memory backend).
//!
//! `cargo bench -p weft-collectives --bench collectives [-- RANKS MAX_MIB]`
//! (defaults: 2 ranks, 256 MiB; `WEFT_BENCH_OPS=all_reduce/ring` keeps only
//! the ops whose name contains that text). busbw = algbw × 2(n−1)/n for all-reduce
//! and × (n−1)/n for reduce-scatter and all-gather, as nccl-tests reports.
//! `WEFT_BENCH_RANKS_PER_DOMAIN=k` runs the reproducible-vs-ring table over
//! domains of k ranks (with k < RANKS the reproducible mode keeps the ring
//! pattern instead of its direct one-domain reduce-scatter).
#![allow(clippy::print_stdout, missing_docs)]

use std::time::{Duration, Instant};

use weft_collectives::repro::ExactPartial;
use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, LocalCluster, ReduceOp, ReduceOptions, Topology,
    shard_range,
};

#[derive(Clone, Copy, PartialEq)]
enum Op {
    AllReduce(Algorithm, bool),
    ReduceScatter,
    AllGather,
}

impl Op {
    fn name(self) -> String {
        match self {
            Op::AllReduce(a, false) => format!("all_reduce/{}", a.name()),
            Op::AllReduce(a, true) => format!("all_reduce/{}+repro", a.name()),
            Op::ReduceScatter => "reduce_scatter/ring".into(),
            Op::AllGather => "all_gather/ring".into(),
        }
    }
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce(..) => 2.0 * (n - 1.0) / n,
            _ => (n - 1.0) / n,
        }
    }
}

/// Seconds per call, measured on rank 0 between two barriers.
fn time_op(n: usize, bytes: usize, op: Op) -> f64 {
    let elems = bytes / 4;
    // aim for ~0.4 s per point, at least 3 calls, at most 100 (values double
    // every call and must stay finite)
    let est = (bytes as f64 / 4e9).max(20e-6);
    let iters = ((0.4 / est) as usize).clamp(3, 100);
    let times = LocalCluster::builder(n)
        .timeout(Duration::from_secs(600))
        .run_each(|comm| -> weft_collectives::Result<f64> {
            let r = comm.rank();
            // realistic gradient-like values, small so 100 doublings stay finite
            let mut buf: Vec<f32> = (0..elems)
                .map(|i| ((i * 31 + r * 7) as f32 * 1e-3).sin() * 1e-20)
                .collect();
            let shard = shard_range(elems, n, r);
            let mut out = vec![0f32; shard.len()];
            let run = |buf: &mut Vec<f32>, out: &mut Vec<f32>| -> weft_collectives::Result<()> {
                match op {
                    Op::AllReduce(a, repro) => comm.all_reduce_with(
                        buf,
                        &ReduceOptions::new(ReduceOp::Sum)
                            .algorithm(a)
                            .reproducible(repro),
                    ),
                    Op::ReduceScatter => comm.reduce_scatter_with(
                        buf,
                        out,
                        &ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring),
                    ),
                    Op::AllGather => comm.all_gather_with(out, buf, Algorithm::Ring),
                }
            };
            run(&mut buf, &mut out)?; // warm-up (page faults, thread wake-ups)
            comm.barrier()?;
            let t0 = Instant::now();
            for _ in 0..iters {
                run(&mut buf, &mut out)?;
            }
            comm.barrier()?;
            Ok(t0.elapsed().as_secs_f64() / iters as f64)
        });
    times
        .into_iter()
        .map(|t| t.expect("rank panicked").expect("collective failed"))
        .fold(0.0, f64::max)
}

/// Bytes copied per second by `threads` threads each copying its share of
/// `bytes` (the read and the write of each byte count once).
fn memcpy_bw(bytes: usize, threads: usize) -> f64 {
    let per = bytes / threads;
    let mut src: Vec<Vec<u8>> = (0..threads).map(|_| vec![1u8; per]).collect();
    let mut dst: Vec<Vec<u8>> = (0..threads).map(|_| vec![0u8; per]).collect();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for (d, sr) in dst.iter_mut().zip(src.iter_mut()) {
                s.spawn(move || d.copy_from_slice(sr));
            }
        });
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    bytes as f64 / best
}

/// Per-call seconds of the plain ring all-reduce, the reproducible ring
/// all-reduce and the exact-partial all-reduce (`all_reduce_exact`) of the
/// same f32 buffer, measured side by side: the three alternate in `ROUNDS`
/// rounds inside one cluster and each keeps its fastest round, so that a
/// load spike on the shared machine hits all three alike. Also the time of
/// `ExactPartial::add` per element on rank 0.
fn repro_vs_ring(n: usize, bytes: usize) -> [f64; 4] {
    const ROUNDS: usize = 5;
    let elems = bytes / 4;
    let est = (bytes as f64 / 2e9).max(20e-6);
    let iters = ((0.08 / est) as usize).clamp(2, 50);
    let out = LocalCluster::builder(n)
        .timeout(Duration::from_secs(600))
        .topology(topology())
        .run_each(|comm| -> weft_collectives::Result<[f64; 4]> {
            let r = comm.rank();
            let grad: Vec<f32> = (0..elems)
                .map(|i| ((i * 31 + r * 7) as f32 * 1e-3).sin() * 1e-20)
                .collect();
            let mut buf = grad.clone();
            let mut out = vec![0f32; elems];
            let mut partial = ExactPartial::new(elems);
            partial.add(&grad)?;
            let ring = ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring);
            let repro = ring.reproducible(true);
            let mut best = [f64::MAX; 4];
            for round in 0..=ROUNDS {
                for (k, best) in best.iter_mut().enumerate().take(3) {
                    comm.barrier()?;
                    let mut t = 0.0;
                    for _ in 0..iters {
                        // the input is restored between calls (outside the
                        // timed span) so that every call sees the same values
                        buf.copy_from_slice(&grad);
                        let t0 = Instant::now();
                        match k {
                            0 => comm.all_reduce_with(&mut buf, &ring)?,
                            1 => comm.all_reduce_with(&mut buf, &repro)?,
                            _ => comm.all_reduce_exact(&partial, &mut out, ReduceOp::Sum)?,
                        }
                        t += t0.elapsed().as_secs_f64();
                    }
                    comm.barrier()?;
                    // round 0 warms up (page faults, thread wake-ups)
                    if round > 0 {
                        *best = best.min(t / iters as f64);
                    }
                }
                // one accumulation step of a micro-batch, per element
                let t0 = Instant::now();
                partial.add(&grad)?;
                if round > 0 {
                    best[3] = best[3].min(t0.elapsed().as_secs_f64() / elems.max(1) as f64);
                }
            }
            Ok(best)
        });
    out.into_iter()
        .next()
        .expect("rank 0")
        .expect("rank panicked")
        .expect("collective failed")
}

/// The topology of the reproducible-vs-ring table: flat, or domains of
/// `WEFT_BENCH_RANKS_PER_DOMAIN` ranks.
fn topology() -> Topology {
    std::env::var("WEFT_BENCH_RANKS_PER_DOMAIN")
        .ok()
        .and_then(|k| k.parse().ok())
        .map_or_else(Topology::flat, Topology::new)
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(2);
    let max_mib: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(256);
    let m1 = memcpy_bw(256 << 20, 1);
    let m2 = memcpy_bw(256 << 20, 2);
    println!("# weft-collectives local backend, {n} ranks (threads), f32");
    println!(
        "# memcpy bandwidth (256 MiB): 1 thread {:.2} GB/s, 2 threads {:.2} GB/s",
        m1 / 1e9,
        m2 / 1e9
    );
    println!(
        "{:<28} {:>8} {:>12} {:>12} {:>10} {:>10} {:>9} {:>9}",
        "op/algorithm",
        "backend",
        "bytes",
        "time(us)",
        "algbw GB/s",
        "busbw GB/s",
        "bus/mc1",
        "bus/mc2"
    );
    let ops = [
        Op::AllReduce(Algorithm::Ring, false),
        Op::AllReduce(Algorithm::RecursiveDoubling, false),
        Op::AllReduce(Algorithm::Auto, false),
        Op::AllReduce(Algorithm::Ring, true),
        Op::ReduceScatter,
        Op::AllGather,
    ];
    let mut ring = std::collections::HashMap::new();
    let filter = std::env::var("WEFT_BENCH_OPS").unwrap_or_default();
    for op in ops {
        if !op.name().contains(filter.as_str()) {
            continue;
        }
        let mut bytes = 4 << 10;
        while bytes <= max_mib << 20 {
            let t = time_op(n, bytes, op);
            let algbw = bytes as f64 / t;
            let busbw = algbw * op.bus_factor(n);
            println!(
                "{:<28} {:>8} {:>12} {:>12.1} {:>10.2} {:>10.2} {:>9.2} {:>9.2}",
                op.name(),
                "local",
                bytes,
                t * 1e6,
                algbw / 1e9,
                busbw / 1e9,
                busbw / m1,
                busbw / m2
            );
            if op == Op::AllReduce(Algorithm::Ring, false) {
                ring.insert(bytes, t);
            } else if op == Op::AllReduce(Algorithm::Ring, true)
                && let Some(tr) = ring.get(&bytes)
            {
                println!("{:<28} reproducible / plain ring time = {:.2}x", "", t / tr);
            }
            bytes *= 4;
        }
    }
    if filter.is_empty() || "repro".contains(filter.as_str()) || filter.contains("repro") {
        println!();
        println!(
            "# reproducible vs plain ring all-reduce, {n} ranks ({:?}), f32, side by side (each the best of 5 alternating rounds); exact = all_reduce_exact of an ExactPartial of the same values; add = ExactPartial::add of one micro-batch",
            topology()
        );
        println!(
            "{:>12} {:>12} {:>12} {:>8} {:>12} {:>8} {:>14}",
            "bytes", "ring(us)", "repro(us)", "repro/x", "exact(us)", "exact/x", "add(ns/elem)"
        );
        let mut bytes = 64 << 10;
        while bytes <= max_mib << 20 {
            let [ring, repro, exact, add] = repro_vs_ring(n, bytes);
            println!(
                "{:>12} {:>12.1} {:>12.1} {:>8.2} {:>12.1} {:>8.2} {:>14.2}",
                bytes,
                ring * 1e6,
                repro * 1e6,
                repro / ring,
                exact * 1e6,
                exact / ring,
                add * 1e9
            );
            bytes *= 4;
        }
    }
}
