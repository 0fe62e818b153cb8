//! All-reduce of the local (threads) backend against the MPI library's own
//! all-reduce through the `mpi` backend, side by side in one run, on the
//! same sizes and the same number of ranks.
//!
//! `cargo bench -p weft-collectives --features mpi --bench mpi_vs_local [-- RANKS MAX_MIB]`
//! (defaults: 2 ranks, 64 MiB). Started outside `mpirun`, it relaunches
//! itself as `mpirun --allow-run-as-root --oversubscribe -np RANKS`. Rows:
//! - `local`: `LocalCluster` with RANKS threads (run by MPI rank 0 alone
//!   while the other processes sleep in a barrier), `Algorithm::Auto`;
//! - `MPI_Allreduce`: the library's blocking all-reduce (its tuned algorithms);
//! - `MPI_Iallreduce`: the default native path of the backend (watchdog-safe);
//! - `mpi ring`: this crate's ring over MPI point-to-point.
#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::process::Command;
use std::time::{Duration, Instant};

use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, LocalCluster, MpiComm, ReduceOp, ReduceOptions,
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

/// Seconds per call on this rank, between two barriers.
fn time_comm(c: &dyn Communicator, bytes: usize, opts: &ReduceOptions) -> f64 {
    let mut buf = gradient(bytes / 4, c.rank());
    let iters = iters_for(bytes);
    c.all_reduce_with(&mut buf, opts).expect("warm-up");
    c.barrier().expect("barrier");
    let t0 = Instant::now();
    for _ in 0..iters {
        c.all_reduce_with(&mut buf, opts).expect("all_reduce");
    }
    c.barrier().expect("barrier");
    t0.elapsed().as_secs_f64() / iters as f64
}

fn time_local(n: usize, bytes: usize) -> f64 {
    LocalCluster::builder(n)
        .timeout(Duration::from_secs(600))
        .run_each(|comm| time_comm(&comm, bytes, &ReduceOptions::new(ReduceOp::Sum)))
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
        println!("# all-reduce f32 sum, {n} ranks: local threads vs MPI processes");
        println!(
            "# MPI library: {}",
            comm.library_version().lines().next().unwrap_or("")
        );
        println!(
            "{:>10} {:>11} {:>14} {:>15} {:>11} {:>14} {:>16}",
            "bytes",
            "local(us)",
            "MPI_Allreduce",
            "MPI_Iallreduce",
            "mpi ring",
            "local busbw",
            "MPI_Allreduce/local"
        );
    }
    let auto = ReduceOptions::new(ReduceOp::Sum);
    let ring = auto.algorithm(Algorithm::Ring);
    let mut bytes = 4 << 10;
    while bytes <= max_mib << 20 {
        let t_block = time_comm(&blocking, bytes, &auto);
        let t_nb = time_comm(&comm, bytes, &auto);
        let t_ring = time_comm(&comm, bytes, &ring);
        // rank 0 alone runs the local backend; the others sleep in the barrier
        let t_local = if me == 0 { time_local(n, bytes) } else { 0.0 };
        comm.barrier().expect("barrier");
        if me == 0 {
            let busbw = bytes as f64 / t_local * 2.0 * (n - 1) as f64 / n as f64;
            println!(
                "{:>10} {:>11.1} {:>14.1} {:>15.1} {:>11.1} {:>9.2} GB/s {:>15.2}x",
                bytes,
                t_local * 1e6,
                t_block * 1e6,
                t_nb * 1e6,
                t_ring * 1e6,
                busbw / 1e9,
                t_block / t_local
            );
        }
        bytes *= 4;
    }
}
