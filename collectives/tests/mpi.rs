//! The collectives over MPI processes (feature `mpi`), against a serial
//! reference computed by every rank.
//!
//! Run by `cargo test -p weft-collectives --features mpi`: when started
//! outside `mpirun`, this binary relaunches itself as
//! `mpirun --allow-run-as-root --oversubscribe -np 4 <itself>` (set
//! `WEFT_MPIRUN` to use another launcher, `WEFT_MPI_NP` for another rank
//! count). Or run it directly under `mpirun`; every rank checks its own
//! results and exits non-zero on the first failure, which fails the job.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::Command;
use std::time::{Duration, Instant};

use weft_collectives::repro::ExactPartial;
use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, Element, Error, LinkClass, Mesh, MpiComm, ReduceOp,
    ReduceOptions, Topology, bf16, f16, shard_range,
};
use weft_numerics::ExactSum;

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

fn main() {
    if !under_mpirun() {
        let me = std::env::current_exe().expect("own path");
        let launcher = std::env::var("WEFT_MPIRUN").unwrap_or_else(|_| "mpirun".into());
        let np = std::env::var("WEFT_MPI_NP").unwrap_or_else(|_| "4".into());
        eprintln!("mpi tests: launching {launcher} -np {np} {}", me.display());
        let status = Command::new(&launcher)
            .args(["--allow-run-as-root", "--oversubscribe", "-np", &np])
            .arg(&me)
            .status()
            .unwrap_or_else(|e| panic!("cannot start `{launcher}` (install openmpi-bin): {e}"));
        assert!(status.success(), "{launcher} -np {np}: {status}");
        return;
    }
    let t0 = Instant::now();
    let comm = MpiComm::builder()
        .topology(Topology::new(2))
        .timeout(Duration::from_secs(60))
        .init()
        .expect("MPI initialises");
    let mut checks = 0usize;
    every_op_matches_the_serial_reference(&comm, &mut checks);
    native_all_reduce_and_its_traffic(&comm, &mut checks);
    reproducible_mode_equals_exact_sum(&comm, &mut checks);
    split_mesh_send_recv_and_non_blocking(&comm, &mut checks);
    mismatches_and_timeouts_are_errors(&comm, &mut checks);
    comm.barrier().expect("final barrier");
    if comm.rank() == 0 {
        println!(
            "mpi tests: {checks} checks passed on each of {} ranks in {:.1?}",
            comm.size(),
            t0.elapsed()
        );
    }
}

/// Whether `n` ranks in domains of 2 (the topology this test sets) form
/// the two or more equal domains the hierarchical algorithm needs: an even
/// world of at least 4.
fn spans_domains(n: usize) -> bool {
    n >= 4 && n.is_multiple_of(2)
}

/// Small integers: every partial sum is exact in every dtype, so every
/// algorithm must match the reference bit for bit.
fn contribution(seed: u64, rank: usize, len: usize) -> Vec<f64> {
    let mut s = seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % 17) as f64 - 8.0
        })
        .collect()
}

fn reference(op: ReduceOp, cols: &[Vec<f64>]) -> Vec<f64> {
    let n = cols.len();
    (0..cols[0].len())
        .map(|i| {
            let it = cols.iter().map(|c| c[i]);
            match op {
                ReduceOp::Sum => it.sum(),
                ReduceOp::Avg => it.sum::<f64>() / n as f64,
                ReduceOp::Max => it.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Min => it.fold(f64::INFINITY, f64::min),
            }
        })
        .collect()
}

fn conv<T: Element>(xs: &[f64]) -> Vec<T> {
    xs.iter().map(|&x| T::from_f64(x)).collect()
}

fn bits<T: Element>(xs: &[T]) -> Vec<u64> {
    xs.iter().map(|x| x.to_f64().to_bits()).collect()
}

fn check_dtype<T: Element>(c: &dyn Communicator, len: usize, seed: u64, alg: Algorithm) -> usize {
    let (n, r) = (c.size(), c.rank());
    let cols: Vec<Vec<f64>> = (0..n).map(|q| contribution(seed, q, len)).collect();
    let mine: Vec<T> = conv(&cols[r]);
    let what = |op: &str| format!("{op} {} len {len} {alg:?} on rank {r}", T::DTYPE);
    let mut k = 0;
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
        let want: Vec<T> = conv(&reference(op, &cols));
        let opts = ReduceOptions::new(op).algorithm(alg);
        let mut b = mine.clone();
        c.all_reduce_with(&mut b, &opts)
            .unwrap_or_else(|e| panic!("{}: {e}", what("all_reduce")));
        assert_eq!(bits(&b), bits(&want), "{} {op:?}", what("all_reduce"));
        let sr = shard_range(len, n, r);
        let mut out = vec![T::ZERO; sr.len()];
        c.reduce_scatter_with(&mine, &mut out, &opts)
            .unwrap_or_else(|e| panic!("{}: {e}", what("reduce_scatter")));
        assert_eq!(
            bits(&out),
            bits(&want[sr]),
            "{} {op:?}",
            what("reduce_scatter")
        );
        k += 2;
    }
    // all-gather of each rank's shard of its contribution
    let full: Vec<T> = (0..n)
        .flat_map(|q| conv::<T>(&cols[q][shard_range(len, n, q)]))
        .collect();
    let mut out = vec![T::ZERO; len];
    c.all_gather_with(&mine[shard_range(len, n, r)], &mut out, alg)
        .unwrap_or_else(|e| panic!("{}: {e}", what("all_gather")));
    assert_eq!(bits(&out), bits(&full), "{}", what("all_gather"));
    let mut inp = vec![T::ZERO; len];
    let sr = shard_range(len, n, r);
    inp[sr.clone()].copy_from_slice(&mine[sr]);
    c.all_gather_in_place_with(&mut inp, alg)
        .unwrap_or_else(|e| panic!("{}: {e}", what("all_gather_in_place")));
    assert_eq!(bits(&inp), bits(&full), "{}", what("all_gather_in_place"));
    let root = (seed as usize) % n;
    let mut b = mine.clone();
    c.broadcast(&mut b, root)
        .unwrap_or_else(|e| panic!("{}: {e}", what("broadcast")));
    assert_eq!(
        bits(&b),
        bits(&conv::<T>(&cols[root])),
        "{}",
        what("broadcast")
    );
    let mut b = mine.clone();
    c.reduce(&mut b, root, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{}: {e}", what("reduce")));
    if r == root {
        let want: Vec<T> = conv(&reference(ReduceOp::Sum, &cols));
        assert_eq!(bits(&b), bits(&want), "{}", what("reduce"));
    }
    // all-to-all-v: rank i sends (seed + 3i + 5j) % 4 elements to rank j
    let count = |i: usize, j: usize| ((seed as usize) + 3 * i + 5 * j) % 4;
    let send_counts: Vec<usize> = (0..n).map(|j| count(r, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| count(i, r)).collect();
    let value = |i: usize, j: usize, e: usize| T::from_f64((100 * i + 10 * j + e) as f64);
    let send: Vec<T> = (0..n)
        .flat_map(|j| (0..count(r, j)).map(move |e| value(r, j, e)))
        .collect();
    let want: Vec<T> = (0..n)
        .flat_map(|i| (0..count(i, r)).map(move |e| value(i, r, e)))
        .collect();
    let mut recv = vec![T::ZERO; want.len()];
    c.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
        .unwrap_or_else(|e| panic!("{}: {e}", what("all_to_all_v")));
    assert_eq!(bits(&recv), bits(&want), "{}", what("all_to_all_v"));
    k + 4
}

fn every_op_matches_the_serial_reference(c: &MpiComm, checks: &mut usize) {
    let algs = [
        Algorithm::Auto,
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Hierarchical,
    ];
    for (i, &len) in [0usize, 1, 7, 1000, 40_003].iter().enumerate() {
        for (j, &alg) in algs.iter().enumerate() {
            if alg == Algorithm::Hierarchical && !spans_domains(c.size()) {
                continue;
            }
            let seed = (i * 10 + j) as u64;
            *checks += check_dtype::<f32>(c, len, seed, alg);
            *checks += check_dtype::<f64>(c, len, seed, alg);
            *checks += check_dtype::<f16>(c, len, seed, alg);
            *checks += check_dtype::<bf16>(c, len, seed, alg);
        }
    }
}

fn native_all_reduce_and_its_traffic(c: &MpiComm, checks: &mut usize) {
    let (n, r) = (c.size(), c.rank());
    // 32 KiB: below both thresholds, one node or several
    let len = 1 << 13;
    let cols: Vec<Vec<f64>> = (0..n).map(|q| contribution(99, q, len)).collect();
    let mut b: Vec<f32> = conv(&cols[r]);
    let before = c.traffic();
    c.all_reduce(&mut b, ReduceOp::Avg)
        .expect("native all_reduce");
    assert_eq!(
        bits(&b),
        bits(&conv::<f32>(&reference(ReduceOp::Avg, &cols)))
    );
    let t = c.traffic().since(&before);
    let s = 4 * len;
    assert_eq!(
        t.sent_by(weft_collectives::OpKind::AllReduce) as usize,
        2 * (n - 1) * s / n,
        "native all-reduce traffic is the textbook volume"
    );
    // an explicit ring over exchange moves exactly the textbook volume
    let before = c.traffic();
    let mut b: Vec<f32> = conv(&cols[r]);
    c.all_reduce_with(
        &mut b,
        &ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring),
    )
    .expect("ring all_reduce");
    let t = c.traffic().since(&before);
    let sent = t.sent_by(weft_collectives::OpKind::AllReduce) as usize;
    // a split group counts its own traffic; the process's counters see it too
    let half = c.split((r % 2) as u32, r as u32).expect("split");
    let (g0, all0) = (half.group_traffic(), c.traffic());
    let mut x = vec![1.0f32; 1024];
    half.all_reduce_with(
        &mut x,
        &ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring),
    )
    .expect("group all_reduce");
    let g = half.group_traffic().since(&g0);
    let (k, hr) = (half.size(), half.rank());
    // the ring's chunks this rank sends: n − 1 in the reduce-scatter, n − 1
    // in the all-gather (uneven when k does not divide 1024)
    let chunk = |q: usize| 4 * shard_range(1024, k, q).len();
    let ring_sent: usize = (0..k.saturating_sub(1))
        .map(|s| chunk((hr + 2 * k - s - 1) % k) + chunk((hr + k - s) % k))
        .sum();
    assert_eq!(
        g.sent_by(weft_collectives::OpKind::AllReduce) as usize,
        ring_sent,
        "the group's own counters"
    );
    assert_eq!(c.traffic().since(&all0).total_sent(), g.total_sent());
    *checks += 1;
    let per_step: usize = (0..n).map(|q| shard_range(len, n, q).len() * 4).sum();
    assert_eq!(per_step, s);
    assert!(
        sent.abs_diff(2 * (n - 1) * s / n) <= 2 * n * 4,
        "ring sent {sent} bytes, textbook {}",
        2 * (n - 1) * s / n
    );
    *checks += 3;
    // a group spanning nodes runs this crate's algorithm from 64 KiB (the
    // hierarchical one here: bytes inside and between domains; the
    // library's call counts all its bytes on one link class)
    if spans_domains(n) {
        let len = weft_collectives::NATIVE_ALL_REDUCE_BELOW_ACROSS_NODES / 4;
        let mut x: Vec<f32> = conv(&contribution(5, r, len));
        let before = c.traffic();
        c.all_reduce(&mut x, ReduceOp::Sum)
            .expect("all_reduce across domains");
        let t = c.traffic().since(&before);
        for class in LinkClass::ALL {
            assert!(
                t.sent(weft_collectives::OpKind::AllReduce, class) > 0,
                "64 KiB across domains is weft's algorithm: {class:?} bytes"
            );
        }
        let cols: Vec<Vec<f64>> = (0..n).map(|q| contribution(5, q, len)).collect();
        assert_eq!(
            bits(&x),
            bits(&conv::<f32>(&reference(ReduceOp::Sum, &cols)))
        );
        *checks += 2;
    }
    // from NATIVE_ALL_REDUCE_BELOW bytes `Auto` runs this crate's
    // algorithm (the bits of an explicit one), the library's all-reduce
    // is still there at any size, and blocking `Auto` calls the library
    let big = weft_collectives::NATIVE_ALL_REDUCE_BELOW / 4 + 5;
    // fractions, so that the order of the additions shows in the bits
    let cols: Vec<Vec<f64>> = (0..n)
        .map(|q| {
            let c = contribution(17, q, big);
            conv::<f32>(
                &c.iter()
                    .enumerate()
                    .map(|(i, x)| x * 0.1 + (i as f64 * 1e-3).sin())
                    .collect::<Vec<_>>(),
            )
            .into_iter()
            .map(f64::from)
            .collect()
        })
        .collect();
    let mine: Vec<f32> = conv(&cols[r]);
    let (mut auto, mut lib, mut blocking) = (mine.clone(), mine.clone(), mine.clone());
    c.all_reduce(&mut auto, ReduceOp::Sum)
        .expect("auto all_reduce");
    // the ring on one domain, the hierarchical ring over several
    let explicit: Vec<Vec<u64>> = [Algorithm::Ring, Algorithm::Hierarchical]
        .into_iter()
        .filter_map(|a| {
            let mut x = mine.clone();
            c.all_reduce_with(&mut x, &ReduceOptions::new(ReduceOp::Sum).algorithm(a))
                .ok()
                .map(|()| bits(&x))
        })
        .collect();
    assert!(
        explicit.contains(&bits(&auto)),
        "Auto from 2 MiB is this crate's algorithm"
    );
    c.library_all_reduce(&mut lib, ReduceOp::Sum)
        .expect("library all_reduce");
    c.clone()
        .with_blocking_native(true)
        .all_reduce(&mut blocking, ReduceOp::Sum)
        .expect("blocking all_reduce");
    let want = reference(ReduceOp::Sum, &cols);
    for (name, got) in [("ring", &auto), ("library", &lib), ("blocking", &blocking)] {
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            // sums of n f32 values in some order: within n roundings of
            // the magnitudes' sum
            let mag: f64 = cols.iter().map(|q| f64::from(q[i] as f32).abs()).sum();
            let tol = n as f64 * f64::from(f32::EPSILON) * mag;
            assert!((f64::from(g) - w).abs() <= tol, "{name} [{i}]: {g} vs {w}");
        }
    }
    let mut halves = vec![bf16::ONE; 8];
    assert!(
        c.library_all_reduce(&mut halves, ReduceOp::Sum).is_err(),
        "bf16 is refused"
    );
    let mut x = vec![1.0f32; 8];
    assert!(
        c.library_all_reduce(&mut x, ReduceOp::Max).is_err(),
        "max is refused"
    );
    *checks += 4;
    // the library's reduce-scatter (uneven shards) and all-gather (`Auto`)
    // give the serial reference, blocking and not
    let len = 1000 * n + 3;
    let cols: Vec<Vec<f64>> = (0..n).map(|q| contribution(7, q, len)).collect();
    let mine: Vec<f64> = conv(&cols[r]);
    let sr = shard_range(len, n, r);
    for lib in [c.clone(), c.clone().with_blocking_native(true)] {
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let mut out = vec![0f64; sr.len()];
            lib.library_reduce_scatter(&mine, &mut out, op)
                .expect("library reduce_scatter");
            assert_eq!(
                bits(&out),
                bits(&reference(op, &cols)[sr.clone()]),
                "{op:?}"
            );
        }
        let mut e = vec![0f64; sr.len()];
        assert!(
            lib.library_reduce_scatter(&mine, &mut e, ReduceOp::Max)
                .is_err(),
            "max is refused"
        );
        let mut full = vec![0f64; len];
        lib.all_gather(&mine[sr.clone()], &mut full)
            .expect("native all_gather");
        let want: Vec<f64> = (0..n)
            .flat_map(|q| cols[q][shard_range(len, n, q)].to_vec())
            .collect();
        assert_eq!(bits(&full), bits(&want));
        *checks += 4;
    }
}

fn reproducible_mode_equals_exact_sum(c: &MpiComm, checks: &mut usize) {
    let (n, r) = (c.size(), c.rank());
    let len = 5001;
    let col = |q: usize| -> Vec<f32> {
        let mut s = 0x1234_5678_9abc_def1u64 ^ (q as u64 * 7919);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let m = ((s >> 40) as f32) / (1u64 << 24) as f32;
                let e = ((s >> 8) % 40) as i32 - 30;
                if s.is_multiple_of(2) {
                    m * 2f32.powi(e)
                } else {
                    -m * 2f32.powi(e)
                }
            })
            .collect()
    };
    let want: Vec<f32> = (0..len)
        .map(|i| {
            let mut s = ExactSum::new();
            for q in 0..n {
                s.add(col(q)[i]);
            }
            s.round_to::<f32>()
        })
        .collect();
    for alg in [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Hierarchical,
    ] {
        if alg == Algorithm::Hierarchical && !spans_domains(n) {
            continue;
        }
        let opts = ReduceOptions::new(ReduceOp::Sum)
            .algorithm(alg)
            .reproducible(true);
        let mut b = col(r);
        c.all_reduce_with(&mut b, &opts)
            .expect("reproducible all_reduce");
        assert_eq!(bits(&b), bits(&want), "reproducible {alg:?}");
        let sr = shard_range(len, n, r);
        let mut out = vec![0f32; sr.len()];
        c.reduce_scatter_with(&col(r), &mut out, &opts)
            .expect("reproducible reduce_scatter");
        assert_eq!(bits(&out), bits(&want[sr]), "reproducible rs {alg:?}");
        *checks += 2;
    }
    // exact partials: contributions 0..n+2 spread unevenly over the ranks
    // (rank r takes contribution r, rank 0 also the last two) give the
    // bits of one ExactPartial holding them all
    let m = n + 2;
    let mine: Vec<usize> = (0..m)
        .filter(|&q| if q < n { q == r } else { r == 0 })
        .collect();
    let mut p = ExactPartial::new(len);
    for &q in &mine {
        p.add(&col(q)).expect("add");
    }
    let mut all = ExactPartial::new(len);
    for q in (0..m).rev() {
        all.add(&col(q)).expect("add");
    }
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        let mut want = vec![0f32; len];
        if op == ReduceOp::Sum {
            all.round_to(&mut want).expect("round");
        } else {
            all.mean_to(&mut want).expect("mean");
        }
        let mut got = vec![0f32; len];
        c.all_reduce_exact(&p, &mut got, op)
            .expect("all_reduce_exact");
        assert_eq!(bits(&got), bits(&want), "all_reduce_exact {op:?}");
        let sr = shard_range(len, n, r);
        let mut out = vec![0f32; sr.len()];
        c.reduce_scatter_exact(&p, &mut out, op)
            .expect("reduce_scatter_exact");
        assert_eq!(bits(&out), bits(&want[sr]), "reduce_scatter_exact {op:?}");
        *checks += 2;
    }
    // the values of every contribution added into the shards' owners'
    // accumulators, one reduce-scatter per contribution (every rank takes
    // part in each; a rank without that contribution adds zeros, which
    // change no sum but the count)
    let sr = shard_range(len, n, r);
    let mut acc = ExactPartial::new(sr.len());
    for q in 0..m {
        let x = if mine.contains(&q) {
            col(q)
        } else {
            vec![0f32; len]
        };
        c.reduce_scatter_add_exact(&x, &mut acc)
            .expect("reduce_scatter_add_exact");
    }
    let mut want = vec![0f32; len];
    all.round_to(&mut want).expect("round");
    let mut got = vec![0f32; sr.len()];
    acc.round_to(&mut got).expect("round");
    assert_eq!(bits(&got), bits(&want[sr]), "reduce_scatter_add_exact");
    assert_eq!(acc.count(), (n * m) as u64);
    *checks += 1;
}

fn split_mesh_send_recv_and_non_blocking(c: &MpiComm, checks: &mut usize) {
    let (n, r) = (c.size(), c.rank());
    // split into even and odd ranks, ordered by descending rank
    let sub = c
        .split((r % 2) as u32, (n - r) as u32)
        .expect("split by parity");
    let members: Vec<usize> = (0..n).rev().filter(|q| q % 2 == r % 2).collect();
    assert_eq!(sub.size(), members.len());
    assert_eq!(sub.world_rank_of(sub.rank()), r);
    assert_eq!(
        (0..sub.size())
            .map(|q| sub.world_rank_of(q))
            .collect::<Vec<_>>(),
        members
    );
    let mut x = vec![r as f64; 3];
    sub.all_reduce(&mut x, ReduceOp::Sum)
        .expect("sub all_reduce");
    assert_eq!(x[0], members.iter().sum::<usize>() as f64);
    *checks += 2;
    if n.is_multiple_of(2) {
        let mesh = Mesh::new(c, &[("dp", n / 2), ("tp", 2)]).expect("mesh");
        let tp = mesh.dim("tp").expect("tp");
        let mut y = vec![r as f32; 5];
        tp.all_reduce(&mut y, ReduceOp::Max).expect("tp all_reduce");
        assert_eq!(y[0], (r | 1) as f32, "tp varies fastest");
        *checks += 1;
    }
    // send/recv around the ring, buffered: send before receiving
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    for tag in [0u64, 7, 1 << 30] {
        c.send(right, tag, &[r as f32, tag as f32])
            .expect("send is buffered");
    }
    for tag in [0u64, 7, 1 << 30] {
        let mut got = [0f32; 2];
        c.recv(left, tag, &mut got).expect("recv");
        assert_eq!(got, [left as f32, tag as f32]);
    }
    *checks += 1;
    // a non-blocking all-reduce progresses while this rank does other work
    let len = 1 << 16;
    let p = c
        .all_reduce_async(vec![1f32; len], ReduceOptions::new(ReduceOp::Sum))
        .expect("start");
    let mut z = vec![r as f32; 4];
    c.all_reduce_with(
        &mut z,
        &ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring),
    )
    .expect("a later blocking op while the first is in flight");
    assert_eq!(z[0], (n * (n - 1) / 2) as f32);
    let v = p.wait().expect("wait");
    assert!(v.iter().all(|&e| e == n as f32));
    *checks += 2;
}

fn mismatches_and_timeouts_are_errors(c: &MpiComm, checks: &mut usize) {
    let r = c.rank();
    if c.size() < 2 {
        return; // one rank cannot disagree with or wait for another
    }
    // native path: different lengths are caught by the signature exchange
    let sub = c
        .split_mpi(0, 0)
        .expect("dup")
        .with_timeout(Duration::from_secs(5));
    let mut b = vec![1f32; if r == 0 { 10 } else { 11 }];
    match sub.all_reduce(&mut b, ReduceOp::Sum) {
        Err(Error::Mismatch { peer, .. }) => assert!(r == 0 || peer == 0),
        other => panic!("rank {r}: expected a mismatch, got {other:?}"),
    }
    *checks += 1;
    // exchange path: rank 0 skips the call; rank 1 waits for it and says so
    let sub = c
        .split_mpi(0, 0)
        .expect("dup")
        .with_timeout(Duration::from_secs(2));
    if r != 0 {
        let mut b = vec![1f32; 100];
        let e = sub
            .all_reduce_with(
                &mut b,
                &ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring),
            )
            .expect_err("rank 0 never arrives");
        match e {
            Error::Timeout { waiting_for, .. } => {
                if r == 1 {
                    assert_eq!(waiting_for, vec![0], "rank 1 waits for rank 0");
                }
            }
            other => panic!("rank {r}: expected a timeout, got {other}"),
        }
    }
    *checks += 1;
    let e = c.send(c.size(), 0, &[1f32]).expect_err("bad peer");
    assert!(matches!(e, Error::InvalidArgument { .. }));
    let e = c.send(0, 1 << 40, &[1f32]).expect_err("tag too large");
    assert!(e.to_string().contains("tag"), "{e}");
    *checks += 2;
    c.barrier().expect("barrier after the failures");
}
