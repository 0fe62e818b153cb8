//! nccl-tests-style table for the local backend, with the machine's memcpy
//! bandwidth beside it (the physical limit of a shared-memory backend).
//!
//! `cargo bench -p weft-collectives --bench collectives [-- RANKS MAX_MIB]`
//! (defaults: 2 ranks, 256 MiB; `WEFT_BENCH_OPS=all_reduce/ring` keeps only
//! the ops whose name contains that text). busbw = algbw × 2(n−1)/n for all-reduce
//! and × (n−1)/n for reduce-scatter and all-gather, as nccl-tests reports.
//! A second table runs the collectives a training step calls (ring
//! all-reduce, reduce-scatter and all-gather; reproducible and exact
//! all-reduce and reduce-scatter; bf16 reduce-scatter and all-gather; the
//! all-gather in place; the exact accumulation of FSDP's micro-batches) side
//! by side from 1 MiB up, alternating in rounds, with their ratios to
//! memcpy and to each other (`WEFT_BENCH_OPS=side` prints only that table).
//! `WEFT_BENCH_RANKS_PER_DOMAIN=k` runs it over domains of k ranks (with
//! k < RANKS the ring keeps its neighbour pattern instead of the direct
//! one-domain exchange).
//!
//! What the ratios can reach: busbw counts the bytes a rank sends, but on
//! one machine's memory every rank also reads its own contribution and
//! writes its output. Counting every byte read or written alike (stores
//! that bypass the cache make writes somewhat cheaper here), n ranks move
//! (3n − 1)·S for an all-reduce of S bytes, (n + 1)·S for a reduce-scatter,
//! 2n·S for an out-of-place all-gather and 2(n − 1)·S in place. So at the
//! all-reduce's efficiency, `rs/ar` can reach (3n − 1)/(2(n + 1)) — 0.83
//! with 2 ranks, 1.1 with 4 —, the out-of-place `ag/ar` (3n − 1)/4n —
//! 0.63 and 0.69 —, and `agip/ar` (3n − 1)/4(n − 1) — 1.25 and 0.92.
//!
//! Against the memcpy column, the same count gives each op a ceiling: a
//! large memcpy moves three lines per byte copied (it reads the source,
//! reads each destination line before writing it, and writes it back),
//! the collectives' large outputs are streamed (a write, no read first),
//! so busbw can reach at most 6(n − 1)/(n(3n − 1))·mc2 for the all-reduce
//! (0.60 with 2 ranks, 0.41 with 4), 3(n − 1)/(n(n + 1)) for the
//! reduce-scatter (0.50, 0.45), 3(n − 1)/2n² for the out-of-place
//! all-gather (0.38, 0.28) and 3/2n in place (0.75, 0.38), whatever the
//! implementation. Smaller sizes beat them from the caches. The side table
//! ends with each op's share of its ceiling at the largest size.
#![allow(clippy::print_stdout, missing_docs)]

use std::time::{Duration, Instant};

use weft_collectives::repro::ExactPartial;
use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, LocalCluster, ReduceOp, ReduceOptions, Topology,
    bf16, shard_range,
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

/// The collectives FSDP and the data-parallel trainer call every step, on
/// the same f32 gradient, side by side: the [`SIDE`] calls alternate in
/// `ROUNDS` rounds inside one cluster and each keeps its fastest round, so
/// that a load spike on the shared machine hits all alike. Seconds per
/// call (rank 0, between barriers), and `ExactPartial::add` per element.
const SIDE: [&str; 13] = [
    "ring all_reduce",
    "ring reduce_scatter",
    "ring all_gather",
    "reproducible all_reduce",
    "all_reduce_exact",
    "reproducible reduce_scatter",
    "reduce_scatter_exact_div",
    "bf16 reduce_scatter",
    "bf16 all_gather",
    "ring all_gather in place",
    "all_reduce_exact, 2 contributions",
    "reduce_scatter_exact_div, 2 contributions",
    "reduce_scatter_add_exact into an encoded accumulator",
];

fn side_by_side(n: usize, bytes: usize) -> ([f64; SIDE.len()], f64) {
    const ROUNDS: usize = 5;
    let elems = bytes / 4;
    let est = (bytes as f64 / 2e9).max(20e-6);
    let iters = ((0.08 / est) as usize).clamp(2, 50);
    let out = LocalCluster::builder(n)
        .timeout(Duration::from_secs(600))
        .topology(topology())
        .run_each(
            |comm| -> weft_collectives::Result<([f64; SIDE.len()], f64)> {
                let r = comm.rank();
                let grad: Vec<f32> = (0..elems)
                    .map(|i| ((i * 31 + r * 7) as f32 * 1e-3).sin() * 1e-20)
                    .collect();
                let g16: Vec<bf16> = grad.iter().map(|&x| bf16::from_f32(x)).collect();
                let sr = shard_range(elems, n, r);
                let mut buf = grad.clone();
                let mut inp = grad.clone();
                let mut inp16 = g16.clone();
                let mut full16 = g16.clone();
                let mut shard = vec![0f32; sr.len()];
                let mut shard16 = vec![bf16::ZERO; sr.len()];
                let mut partial = ExactPartial::new(elems);
                partial.add(&grad)?;
                let mut acc = ExactPartial::new(sr.len());
                let ring = ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring);
                let repro = ring.reproducible(true);
                let mut best = [f64::MAX; SIDE.len()];
                let mut add = f64::MAX;
                for round in 0..=ROUNDS {
                    for (k, best) in best.iter_mut().enumerate() {
                        comm.barrier()?;
                        let mut t = 0.0;
                        for _ in 0..iters {
                            // every input is written afresh before each call
                            // (outside the timed span), as a backward pass or
                            // the last micro-batch's accumulation writes it
                            // just before the step reduces it: every call
                            // sees the same values, and every op the same
                            // cache state (in-place all-reduces must restore
                            // their input anyway)
                            match k {
                                0 | 3 => buf.copy_from_slice(&grad),
                                1 | 5 => inp.copy_from_slice(&grad),
                                2 => inp[..sr.len()].copy_from_slice(&grad[..sr.len()]),
                                4 | 6 => {
                                    partial.clear();
                                    partial.add(&grad)?;
                                }
                                10 | 11 => {
                                    // encoded: a second micro-batch
                                    partial.clear();
                                    partial.add(&grad)?;
                                    partial.add(&grad)?;
                                }
                                12 => {
                                    // a later micro-batch: the shard's
                                    // accumulator already encoded
                                    inp.copy_from_slice(&grad);
                                    acc.clear();
                                    acc.add(&grad[sr.clone()])?;
                                    acc.add(&grad[sr.clone()])?;
                                }
                                7 => inp16.copy_from_slice(&g16),
                                8 => inp16[..sr.len()].copy_from_slice(&g16[..sr.len()]),
                                // the rank's shard of `buf` is its input
                                _ => buf[sr.clone()].copy_from_slice(&grad[sr.clone()]),
                            }
                            let t0 = Instant::now();
                            match k {
                                0 => comm.all_reduce_with(&mut buf, &ring)?,
                                1 => comm.reduce_scatter_with(&inp, &mut shard, &ring)?,
                                2 => comm.all_gather_with(
                                    &inp[..sr.len()],
                                    &mut buf,
                                    Algorithm::Ring,
                                )?,
                                3 => comm.all_reduce_with(&mut buf, &repro)?,
                                4 => comm.all_reduce_exact(&partial, &mut buf, ReduceOp::Sum)?,
                                5 => comm.reduce_scatter_with(&inp, &mut shard, &repro)?,
                                6 => {
                                    comm.reduce_scatter_exact_div(&partial, &mut shard, n as u64)?;
                                }
                                7 => comm.reduce_scatter_with(&inp16, &mut shard16, &ring)?,
                                8 => comm.all_gather_with(
                                    &inp16[..sr.len()],
                                    &mut full16,
                                    Algorithm::Ring,
                                )?,
                                9 => comm.all_gather_in_place_with(&mut buf, Algorithm::Ring)?,
                                10 => comm.all_reduce_exact(&partial, &mut buf, ReduceOp::Sum)?,
                                12 => comm.reduce_scatter_add_exact(&inp, &mut acc)?,
                                _ => {
                                    comm.reduce_scatter_exact_div(&partial, &mut shard, n as u64)?;
                                }
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
                        add = add.min(t0.elapsed().as_secs_f64() / elems.max(1) as f64);
                    }
                }
                Ok((best, add))
            },
        );
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
    if filter.is_empty() || filter.contains("side") || filter.contains("repro") {
        println!();
        println!(
            "# side by side, {n} ranks ({:?}), f32 (bf16 rows: bf16 buffers, f32 accumulation), each the best of 5 alternating rounds",
            topology()
        );
        println!(
            "# busbw and /mc2 (busbw over the 2-thread memcpy above); rs/ar, ag/ar: busbw over the ring all-reduce's; the rest: time over the plain op's; exact, exdiv: one contribution per rank (it travels as values), exact2, exdiv2: two (encoded); agip: all-gather in place; rsadd: reduce_scatter_add_exact (FSDP's reproducible reduce-scatter of a micro-batch after the first) into encoded accumulators"
        );
        println!(
            "{:>10} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9} {:>8} {:>9}",
            "bytes",
            "ar GB/s",
            "rs GB/s",
            "ag GB/s",
            "ar/mc2",
            "rs/mc2",
            "ag/mc2",
            "rs/ar",
            "ag/ar",
            "repro/ar",
            "exact/ar",
            "repro/rs",
            "exdiv/rs",
            "exact2/ar",
            "exdiv2/rs",
            "bf16 rs",
            "bf16 ag",
            "add ns/el",
            "agip GB/s",
            "agip/ar",
            "rsadd/rs"
        );
        let f = (n as f64 - 1.0) / n as f64;
        let mut bytes = 1 << 20;
        let (mut last, mut top) = ([0.0; 4], 0);
        while bytes <= max_mib << 20 {
            let (t, add) = side_by_side(n, bytes);
            let b = bytes as f64;
            let (ar, rs, ag) = (b / t[0] * 2.0 * f, b / t[1] * f, b / t[2] * f);
            let agip = b / t[9] * f;
            (last, top) = ([ar, rs, ag, agip], bytes);
            println!(
                "{:>10} {:>8.2} {:>8.2} {:>8.2} {:>7.2} {:>7.2} {:>7.2} {:>6.2} {:>6.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>8.2} {:>9.2}",
                bytes,
                ar / 1e9,
                rs / 1e9,
                ag / 1e9,
                ar / m2,
                rs / m2,
                ag / m2,
                rs / ar,
                ag / ar,
                t[3] / t[0],
                t[4] / t[0],
                t[5] / t[1],
                t[6] / t[1],
                t[10] / t[0],
                t[11] / t[1],
                t[7] / t[1],
                t[8] / t[2],
                add * 1e9,
                agip / 1e9,
                agip / ar,
                t[12] / t[1]
            );
            bytes *= 4;
        }
        println!(
            "# memcpy bandwidth again (256 MiB): 1 thread {:.2} GB/s, 2 threads {:.2} GB/s",
            memcpy_bw(256 << 20, 1) / 1e9,
            memcpy_bw(256 << 20, 2) / 1e9
        );
        let ceil = ceilings(n);
        let names = ["ar", "rs", "ag", "agip"];
        let share: Vec<String> = (0..4)
            .map(|i| {
                format!(
                    "{} {:.2} ({:.0}%)",
                    names[i],
                    ceil[i],
                    100.0 * last[i] / m2 / ceil[i]
                )
            })
            .collect();
        if n > 1 && top > 0 {
            println!(
                "# ceilings of busbw/mc2 from memory traffic (see the bench's docs), and the share reached at {} MiB: {}",
                top >> 20,
                share.join(", ")
            );
        }
    }
}

/// The most busbw over the 2-thread memcpy's bandwidth that each op's
/// memory traffic allows on one machine, n ranks in one domain (all-reduce,
/// reduce-scatter, out-of-place and in-place all-gather): every rank reads
/// its inputs and writes its outputs, streamed; a memcpy moves three lines
/// per byte (see the module docs).
fn ceilings(n: usize) -> [f64; 4] {
    let n = n as f64;
    [
        6.0 * (n - 1.0) / (n * (3.0 * n - 1.0)),
        3.0 * (n - 1.0) / (n * (n + 1.0)),
        3.0 * (n - 1.0) / (2.0 * n * n),
        3.0 / (2.0 * n),
    ]
}
