//! All-reduce, reduce-scatter and all-gather of the local (threads)
//! backend against the MPI library's own collectives through the `mpi`
//! backend, side by side in one run, on the same sizes and the same number
//! of ranks.
//!
//! `cargo bench -p weft-collectives --features mpi --bench mpi_vs_local [-- RANKS MAX_MIB]`
//! (defaults: 2 ranks, 64 MiB). Started outside `mpirun`, it relaunches
//! itself as `mpirun --allow-run-as-root --oversubscribe -np RANKS`. Columns:
//! - `local`: `LocalCluster` with RANKS threads (run by MPI rank 0 alone
//!   while the other processes sleep in a barrier), `Algorithm::Auto`;
//! - `MPI blocking`: the library's blocking collective (`MPI_Allreduce`,
//!   `MPI_Reduce_scatter`, `MPI_Allgatherv`: its tuned algorithms; the
//!   `v`/counts forms because shards may differ by one element);
//! - `MPI nonblocking`: the library's non-blocking collective
//!   (`MPI_Iallreduce`, `MPI_Ireduce_scatter`, `MPI_Iallgatherv`, polled
//!   by the watchdog): what `Auto` all-gather runs, and `Auto` all-reduce
//!   below `NATIVE_ALL_REDUCE_BELOW` (2 MiB);
//! - `mpi ring`: this crate's ring over MPI point-to-point: what `Auto`
//!   reduce-scatter runs, and `Auto` all-reduce from 2 MiB (faster than
//!   the library's non-blocking calls here).
//!
//! busbw is nccl-tests': algbw × 2(n−1)/n for all-reduce, × (n−1)/n for
//! the other two.
#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

mod common;
use common::Op;

use std::process::Command;
use std::time::{Duration, Instant};

use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, LocalCluster, MpiComm, ReduceOp, ReduceOptions,
    shard_range,
};

fn under_mpirun() -> bool {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "MPI_LOCALNRANKS",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

fn iters_for(bytes: usize) -> usize {
    let est = (bytes as f64 / 2e9).max(20e-6);
    ((0.3 / est) as usize).clamp(3, 200)
}

fn gradient(elems: usize, r: usize) -> Vec<f32> {
    (0..elems)
        .map(|i| ((i * 31 + r * 7) as f32 * 1e-3).sin() * 1e-30)
        .collect()
}

/// Seconds per call of `op` on this rank (`bytes`: the full buffer),
/// between two barriers; with `library`, a reduce-scatter calls the MPI
/// library's own ([`MpiComm::library_reduce_scatter`]).
fn time_comm(
    c: &dyn Communicator,
    op: Op,
    bytes: usize,
    algorithm: Algorithm,
    library: Option<&MpiComm>,
) -> f64 {
    let (n, r) = (c.size(), c.rank());
    let elems = bytes / 4;
    let mut buf = gradient(elems, r);
    let mut shard = vec![0f32; shard_range(elems, n, r).len()];
    let opts = ReduceOptions::new(ReduceOp::Sum).algorithm(algorithm);
    let mut call = || match op {
        Op::AllReduce => match library {
            Some(l) => l.library_all_reduce(&mut buf, ReduceOp::Sum),
            None => c.all_reduce_with(&mut buf, &opts),
        },
        Op::ReduceScatter => match library {
            Some(l) => l.library_reduce_scatter(&buf, &mut shard, ReduceOp::Sum),
            None => c.reduce_scatter_with(&buf, &mut shard, &opts),
        },
        Op::AllGather => c.all_gather_with(&shard, &mut buf, algorithm),
    };
    let iters = iters_for(bytes);
    call().expect("warm-up");
    c.barrier().expect("barrier");
    let t0 = Instant::now();
    for _ in 0..iters {
        call().unwrap_or_else(|e| panic!("{}: {e}", op.name()));
    }
    c.barrier().expect("barrier");
    t0.elapsed().as_secs_f64() / iters as f64
}

fn time_local(n: usize, op: Op, bytes: usize) -> f64 {
    LocalCluster::builder(n)
        .timeout(Duration::from_secs(600))
        .run_each(|comm| time_comm(&comm, op, bytes, Algorithm::Auto, None))
        .into_iter()
        .map(|t| t.expect("rank panicked"))
        .fold(0.0, f64::max)
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(2);
    let max_mib: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(64);
    if !under_mpirun() {
        let me = std::env::current_exe().expect("own path");
        let launcher = std::env::var("WEFT_MPIRUN").unwrap_or_else(|_| "mpirun".into());
        let status = Command::new(&launcher)
            .args([
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                &n.to_string(),
            ])
            .arg(&me)
            .args([n.to_string(), max_mib.to_string()])
            .status()
            .unwrap_or_else(|e| panic!("cannot start `{launcher}` (install openmpi-bin): {e}"));
        assert!(status.success(), "{launcher}: {status}");
        return;
    }
    let comm = MpiComm::builder()
        .timeout(Duration::from_secs(600))
        .init()
        .expect("MPI initialises");
    let n = comm.size();
    let blocking = comm.clone().with_blocking_native(true);
    let me = comm.rank();
    if me == 0 {
        println!("# f32, {n} ranks: local threads vs MPI processes");
        println!(
            "# MPI library: {}",
            comm.library_version().lines().next().unwrap_or("")
        );
        println!(
            "{:<15} {:>10} {:>11} {:>13} {:>16} {:>11} {:>12} {:>12} {:>14}",
            "op",
            "bytes",
            "local(us)",
            "MPI blocking",
            "MPI nonblocking",
            "mpi ring",
            "local busbw",
            "MPI busbw",
            "MPI blk/local"
        );
    }
    for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather] {
        let mut bytes = 4 << 10;
        while bytes <= max_mib << 20 {
            let t_block = time_comm(&blocking, op, bytes, Algorithm::Auto, Some(&blocking));
            let t_nb = time_comm(&comm, op, bytes, Algorithm::Auto, Some(&comm));
            let t_ring = time_comm(&comm, op, bytes, Algorithm::Ring, None);
            // rank 0 alone runs the local backend; the others sleep in the barrier
            let t_local = if me == 0 {
                time_local(n, op, bytes)
            } else {
                0.0
            };
            comm.barrier().expect("barrier");
            if me == 0 {
                let bus = |t: f64| bytes as f64 / t * op.bus_factor(n) / 1e9;
                println!(
                    "{:<15} {:>10} {:>11.1} {:>13.1} {:>16.1} {:>11.1} {:>7.2} GB/s {:>7.2} GB/s {:>13.2}x",
                    op.name(),
                    bytes,
                    t_local * 1e6,
                    t_block * 1e6,
                    t_nb * 1e6,
                    t_ring * 1e6,
                    bus(t_local),
                    bus(t_block),
                    t_block / t_local
                );
            }
            bytes *= 4;
        }
    }
}
