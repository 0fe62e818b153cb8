//! Times the phases of the reproducible mode (encode, merge, decode) and
//! of [`ExactPartial`](weft_collectives::repro::ExactPartial) (add, round,
//! mean) on one thread, per element, beside a plain f32 add of the same
//! length; then `REPS` exact all-reduces on 2 thread ranks (for profilers):
//! `cargo run --release -p weft-collectives --example repro_profile [-- LEN [REPS]]`.
//!
//! `… repro_profile -- ring|repro LEN RANKS REPS` instead runs only `REPS`
//! plain ring or reproducible ring all-reduces of `LEN` f32 on `RANKS`
//! thread ranks, so that `perf stat -e task-clock` compares the total CPU
//! work of the two (the figure that matters when ranks outnumber cores).
#![allow(clippy::print_stdout, missing_docs)]
use std::time::Instant;
use weft_collectives::repro::{self, ExactPartial};
use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, LocalCluster, ReduceOp, ReduceOptions,
};

/// Runs `reps` all-reduces of `len` f32 on `ranks` thread ranks; prints
/// the wall time per call.
fn all_reduce_only(repro: bool, len: usize, ranks: usize, reps: u32) {
    let opts = ReduceOptions::new(ReduceOp::Sum)
        .algorithm(Algorithm::Ring)
        .reproducible(repro);
    let t = LocalCluster::run(ranks, |comm| {
        let r = comm.rank();
        let mut buf: Vec<f32> = (0..len)
            .map(|i| ((i * 31 + r * 7) as f32 * 1e-3).sin() * 1e-20)
            .collect();
        comm.all_reduce_with(&mut buf, &opts)?;
        comm.barrier()?;
        let t0 = Instant::now();
        for _ in 0..reps {
            comm.all_reduce_with(&mut buf, &opts)?;
        }
        comm.barrier()?;
        Ok::<_, weft_collectives::Error>(t0.elapsed().as_secs_f64())
    })
    .unwrap()
    .remove(0)
    .unwrap();
    println!(
        "{} all-reduce, {ranks} ranks, {len} f32: {:.1} us per call",
        if repro { "reproducible" } else { "plain ring" },
        t * 1e6 / f64::from(reps)
    );
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_default();
    if mode == "ring" || mode == "repro" {
        let arg = |i: usize, d: usize| {
            std::env::args()
                .nth(i)
                .and_then(|a| a.parse().ok())
                .unwrap_or(d)
        };
        let reps = u32::try_from(arg(4, 20)).unwrap_or(20);
        all_reduce_only(mode == "repro", arg(2, 1 << 20), arg(3, 4), reps);
        return;
    }
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1 << 20);
    let reps: u32 = 20;
    let a: Vec<f32> = (0..n)
        .map(|i| ((i * 31) as f32 * 1e-3).sin() * 1e-20)
        .collect();
    let b: Vec<f32> = (0..n)
        .map(|i| ((i * 31 + 7) as f32 * 1e-3).sin() * 1e-20)
        .collect();
    let mut ea = Vec::new();
    let mut eb = Vec::new();
    let t = Instant::now();
    for _ in 0..reps {
        ea.clear();
        repro::encode(&a, &mut ea);
    }
    let te = t.elapsed().as_secs_f64() / f64::from(reps);
    repro::encode(&b, &mut eb);
    let mut m = Vec::new();
    let t = Instant::now();
    for _ in 0..reps {
        repro::merge(&ea, &eb, n, &mut m).unwrap();
    }
    let tm = t.elapsed().as_secs_f64() / f64::from(reps);
    let mut out = vec![0f32; n];
    let t = Instant::now();
    for _ in 0..reps {
        repro::decode(&m, &mut out).unwrap();
    }
    let td = t.elapsed().as_secs_f64() / f64::from(reps);
    let t = Instant::now();
    for _ in 0..reps {
        for (o, (x, y)) in out.iter_mut().zip(a.iter().zip(&b)) {
            *o = x + y;
        }
        std::hint::black_box(&out);
    }
    let ta = t.elapsed().as_secs_f64() / f64::from(reps);
    let ns = |t: f64| t * 1e9 / n as f64;
    println!(
        "n {n}: encode {:.2} ns/elem ({} B/elem), merge {:.2}, decode {:.2}, plain add {:.2}",
        ns(te),
        ea.len() as f64 / n as f64,
        ns(tm),
        ns(td),
        ns(ta)
    );
    let mut p = ExactPartial::new(n);
    p.add(&a).unwrap();
    let t = Instant::now();
    for _ in 0..reps {
        p.add(&b).unwrap();
    }
    let tadd = t.elapsed().as_secs_f64() / f64::from(reps);
    let t = Instant::now();
    for _ in 0..reps {
        p.round_to(&mut out).unwrap();
    }
    let tround = t.elapsed().as_secs_f64() / f64::from(reps);
    let t = Instant::now();
    for _ in 0..reps {
        p.mean_to(&mut out).unwrap();
    }
    let tmean = t.elapsed().as_secs_f64() / f64::from(reps);
    println!(
        "ExactPartial: add {:.2} ns/elem ({} B/elem), round {:.2}, mean (/{}) {:.2}",
        ns(tadd),
        p.encoded_bytes() as f64 / n as f64,
        ns(tround),
        p.count(),
        ns(tmean)
    );
    let ar_reps: u32 = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(0);
    if ar_reps > 0 {
        let t = Instant::now();
        LocalCluster::run(2, |comm| {
            let mut out = vec![0f32; n];
            for _ in 0..ar_reps {
                comm.all_reduce_exact(&p, &mut out, ReduceOp::Sum)?;
            }
            Ok::<_, weft_collectives::Error>(())
        })
        .unwrap();
        println!(
            "all_reduce_exact, 2 ranks: {:.2} ns/elem",
            ns(t.elapsed().as_secs_f64() / f64::from(ar_reps))
        );
    }
}
