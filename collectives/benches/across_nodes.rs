//! Collectives between nodes: weft's algorithms against the MPI
//! library's own on the same ranks, side by side in one run, with bus
//! bandwidth against the link rate. Meant for a cluster whose nodes talk
//! over real (or rate-limited) links, such as the network namespaces of
//! `scripts/cluster.sh`:
//!
//! ```sh
//! cargo bench -p weft-collectives --features mpi --bench across_nodes --no-run
//! scripts/cluster.sh up --nodes 2 --link 1gbit && scripts/cluster.sh measure
//! $(cat /run/weft-cluster/mpirun) -np 2 --map-by node \
//!     target/release/deps/across_nodes-HASH --link 119.8 [--max-mib 64]
//! ```
//!
//! `--link` is the rate `cluster.sh measure` reached through the switch
//! (MB/s, one direction): the ceiling of one node's traffic each way.
//! Ranks of one node form a domain (the MPI library's shared-memory
//! split), so `--map-by slot` with two slots a node gives 2 nodes × 2
//! ranks and `--map-by node` one rank a node.
//!
//! Table 1, per collective and size (1 MiB up): `weft`, what the trainer
//! runs (`Algorithm::Auto`: for all-reduce the hierarchical algorithm when
//! every node holds the same two or more ranks, else the ring; the ring
//! for reduce-scatter; the library's non-blocking all-gather, polled by
//! the watchdog), weft's own ring (`ring`), the library's blocking
//! collective (`MPI_Allreduce`, `MPI_Reduce_scatter`, `MPI_Allgatherv`),
//! their bus bandwidths (nccl-tests': algbw × 2(n−1)/n for all-reduce,
//! × (n−1)/n for the others), the better of weft's two over `--link`, and
//! MPI's time over weft's.
//!
//! Table 2, all-reduce only: the flat ring against the hierarchical
//! algorithm (where possible) with the speed-up the byte counts predict,
//! the exact (reproducible) all-reduce against the plain one, and the
//! bf16 wire against f32 (the same element count).
//!
//! Predicted hierarchical speed-up: the flat ring crosses each node's
//! link with 2(n−1)/n·S each way, the hierarchical algorithm with
//! 2(N−1)/N·S (N nodes, its k = n/N rings share the link) plus its two
//! in-node phases of (k−1)/k·S each at the in-node rate, measured here as
//! the ring all-reduce of the ranks of one node: so t_flat = 2(n−1)/n·S/B
//! and t_hier = 2(N−1)/N·S/B + 2(k−1)/k·S/B_in.
#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

mod common;
use common::Op;

use std::time::{Duration, Instant};

use half::bf16;
use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, MpiComm, ReduceOp, ReduceOptions, shard_range,
};

fn gradient(elems: usize, r: usize) -> Vec<f32> {
    (0..elems)
        .map(|i| ((i * 31 + r * 7) as f32 * 1e-3).sin())
        .collect()
}

/// How one call is made.
#[derive(Clone, Copy)]
enum How {
    /// weft's algorithm, with these options (all-reduce, reduce-scatter)
    /// or this algorithm (all-gather).
    Weft(ReduceOptions),
    /// The library's blocking collective.
    Library,
    /// weft's all-reduce of a bf16 buffer (bf16 on the wire).
    Bf16(ReduceOptions),
}

/// Seconds per call on this rank (`bytes`: the full f32 buffer), the
/// slowest rank's, between barriers; `iters` calls after one warm-up.
fn time(c: &MpiComm, op: Op, bytes: usize, how: How, iters: usize) -> f64 {
    let (n, r) = (c.size(), c.rank());
    let elems = bytes / 4;
    let mut buf = gradient(elems, r);
    let mut half: Vec<bf16> = buf.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut shard = vec![0f32; shard_range(elems, n, r).len()];
    let mut call = || match (op, how) {
        (Op::AllReduce, How::Weft(o)) => c.all_reduce_with(&mut buf, &o),
        (Op::AllReduce, How::Library) => c.library_all_reduce(&mut buf, ReduceOp::Sum),
        (Op::AllReduce, How::Bf16(o)) => c.all_reduce_with(&mut half, &o),
        (Op::ReduceScatter, How::Library) => {
            c.library_reduce_scatter(&buf, &mut shard, ReduceOp::Sum)
        }
        (Op::ReduceScatter, How::Weft(o) | How::Bf16(o)) => {
            c.reduce_scatter_with(&buf, &mut shard, &o)
        }
        (Op::AllGather, How::Library) => c.all_gather_with(&shard, &mut buf, Algorithm::Auto),
        (Op::AllGather, How::Weft(o) | How::Bf16(o)) => {
            c.all_gather_with(&shard, &mut buf, o.algorithm)
        }
    };
    call().expect("warm-up");
    c.barrier().expect("barrier");
    let t0 = Instant::now();
    for _ in 0..iters {
        call().unwrap_or_else(|e| panic!("{}: {e}", op.name()));
    }
    c.barrier().expect("barrier");
    let mut t = [t0.elapsed().as_secs_f64() / iters as f64];
    c.all_reduce(&mut t, ReduceOp::Max).expect("max");
    t[0]
}

/// One-way rate (MB/s) from rank 0 to the first rank of the next node:
/// 64 MiB sent in 1 MiB messages.
fn point_to_point(c: &MpiComm, per_node: usize) -> f64 {
    let peer = per_node;
    let chunk = vec![1u8; 1 << 20];
    let mut got = vec![0u8; 1 << 20];
    c.barrier().expect("barrier");
    let t0 = Instant::now();
    for _ in 0..64 {
        if c.rank() == 0 {
            c.send_bytes(peer, 0, &chunk).expect("send");
        } else if c.rank() == peer {
            c.recv_bytes(0, 0, &mut got).expect("recv");
        }
    }
    c.barrier().expect("barrier");
    let mut t = [t0.elapsed().as_secs_f64()];
    c.all_reduce(&mut t, ReduceOp::Max).expect("max");
    64.0 * f64::from(1u32 << 20) / t[0] / 1e6
}

fn arg(args: &[String], name: &str) -> Option<f64> {
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).and_then(|v| v.parse().ok())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(link) = arg(&args, "--link") else {
        eprintln!(
            "usage (under the cluster's mpirun): across_nodes --link MB/s [--max-mib 64] [--min-mib 1 (0.0625 = 64 KiB)]\n\
             --link: the rate `scripts/cluster.sh measure` reached, MB/s one way"
        );
        std::process::exit(2);
    };
    // sizes in KiB, from --min-mib (fractions allowed: 0.0625 is 64 KiB)
    let max_kib = (arg(&args, "--max-mib").unwrap_or(64.0) * 1024.0) as usize;
    let min_kib = ((arg(&args, "--min-mib").unwrap_or(1.0) * 1024.0) as usize).max(1);
    let comm = MpiComm::builder()
        .timeout(Duration::from_secs(600))
        .init()
        .expect("MPI initialises");
    let (n, me) = (comm.size(), comm.rank());
    let k = comm.topology().ranks_per_domain().clamp(1, n);
    let nodes = n / k;
    if nodes < 2 {
        if me == 0 {
            eprintln!("across_nodes: all {n} ranks share one node; start it over two or more");
        }
        std::process::exit(2);
    }
    let p2p = point_to_point(&comm, k);
    // the in-node rate: the ring all-reduce of one node's ranks
    let node_comm = comm
        .split_mpi(
            u32::try_from(me / k).unwrap_or(0),
            u32::try_from(me % k).unwrap_or(0),
        )
        .expect("split by node");
    let in_node = if k > 1 {
        let s = 16 << 20;
        let t = time(
            &node_comm,
            Op::AllReduce,
            s,
            How::Weft(ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring)),
            5,
        );
        s as f64 * Op::AllReduce.bus_factor(k) / t / 1e6
    } else {
        f64::INFINITY
    };
    if me == 0 {
        println!("# {n} ranks on {nodes} nodes ({k} a node); f32 unless said");
        println!(
            "# MPI library: {}",
            comm.library_version().lines().next().unwrap_or("")
        );
        println!(
            "# link (--link, measured through the switch): {link:.1} MB/s; MPI point-to-point rank 0 -> {k}: {p2p:.1} MB/s; \
             in-node ring all-reduce busbw: {in_node:.0} MB/s ({:.1}x the link)",
            in_node / link
        );
        println!();
        println!(
            "{:<15} {:>6} {:>9} {:>9} {:>9} {:>11} {:>11} {:>11} {:>10} {:>9}",
            "op",
            "MiB",
            "weft ms",
            "ring ms",
            "MPI ms",
            "weft busbw",
            "ring busbw",
            "MPI busbw",
            "best/link",
            "MPI/weft"
        );
    }
    let iters_for = |bytes: usize| {
        let est = bytes as f64 * 2.0 / (link * 1e6);
        ((1.5 / est) as usize).clamp(2, 30)
    };
    let plain = ReduceOptions::new(ReduceOp::Sum);
    for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather] {
        let mut kib = min_kib;
        while kib <= max_kib {
            let bytes = kib << 10;
            let iters = iters_for(bytes);
            let t_weft = time(&comm, op, bytes, How::Weft(plain), iters);
            let ring = plain.algorithm(Algorithm::Ring);
            let t_ring = time(&comm, op, bytes, How::Weft(ring), iters);
            let t_lib = time(&comm, op, bytes, How::Library, iters);
            if me == 0 {
                let bus = |t: f64| bytes as f64 / t * op.bus_factor(n) / 1e6;
                println!(
                    "{:<15} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>6.1} MB/s {:>6.1} MB/s {:>6.1} MB/s {:>10.2} {:>8.2}x",
                    op.name(),
                    mib_label(kib),
                    t_weft * 1e3,
                    t_ring * 1e3,
                    t_lib * 1e3,
                    bus(t_weft),
                    bus(t_ring),
                    bus(t_lib),
                    bus(t_weft.min(t_ring)) / link,
                    t_lib / t_weft
                );
            }
            kib *= 4;
        }
    }
    if me == 0 {
        println!();
        println!(
            "{:<6} {:>9} {:>10} {:>9} {:>9} {:>10} {:>10} {:>8} {:>9} {:>9} {:>8}",
            "MiB",
            "flat ms",
            "hier ms",
            "hier x",
            "predicted",
            "exact ms",
            "plain ms",
            "exact/",
            "bf16 ms",
            "f32 ms",
            "f32/bf16"
        );
    }
    let hier_possible = k > 1;
    let mut kib = min_kib.max(1024);
    while kib <= max_kib {
        let bytes = kib << 10;
        let iters = iters_for(bytes);
        let ring = plain.algorithm(Algorithm::Ring);
        let t_flat = time(&comm, Op::AllReduce, bytes, How::Weft(ring), iters);
        let t_hier = if hier_possible {
            let h = plain.algorithm(Algorithm::Hierarchical);
            Some(time(&comm, Op::AllReduce, bytes, How::Weft(h), iters))
        } else {
            None
        };
        let t_plain = time(&comm, Op::AllReduce, bytes, How::Weft(plain), iters);
        let exact = plain.reproducible(true);
        let t_exact = time(&comm, Op::AllReduce, bytes, How::Weft(exact), iters);
        let t_bf16 = time(&comm, Op::AllReduce, bytes, How::Bf16(plain), iters);
        if me == 0 {
            let s = bytes as f64;
            let b = link * 1e6;
            let (nn, nodes_f, kk) = (n as f64, nodes as f64, k as f64);
            let flat_pred = 2.0 * (nn - 1.0) / nn * s / b;
            let hier_pred = 2.0 * (nodes_f - 1.0) / nodes_f * s / b
                + 2.0 * (kk - 1.0) / kk * s / (in_node * 1e6);
            let (hier_ms, hier_x, pred) = match t_hier {
                Some(t) => (
                    format!("{:.1}", t * 1e3),
                    format!("{:.2}x", t_flat / t),
                    format!("{:.2}x", flat_pred / hier_pred),
                ),
                None => ("-".into(), "-".into(), "-".into()),
            };
            println!(
                "{:<6} {:>9.1} {:>10} {:>9} {:>9} {:>10.1} {:>10.1} {:>7.2}x {:>9.1} {:>9.1} {:>7.2}x",
                mib_label(kib),
                t_flat * 1e3,
                hier_ms,
                hier_x,
                pred,
                t_exact * 1e3,
                t_plain * 1e3,
                t_exact / t_plain,
                t_bf16 * 1e3,
                t_plain * 1e3,
                t_plain / t_bf16
            );
        }
        kib *= 4;
    }
}

/// A size in KiB as MiB for the tables: whole MiB as integers, below as
/// a fraction (`0.25`).
fn mib_label(kib: usize) -> String {
    if kib.is_multiple_of(1024) {
        (kib / 1024).to_string()
    } else {
        format!("{:.4}", kib as f64 / 1024.0)
            .trim_end_matches('0')
            .to_string()
    }
}
