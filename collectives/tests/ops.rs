//! Every op, dtype and algorithm against a serial reference.

use std::time::Duration;

use proptest::prelude::*;
use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, Dtype, Element, LocalCluster, Mesh, ReduceOp,
    ReduceOptions, Topology, bf16, f16, shard_range,
};

/// Small integers: every partial sum of ≤ 8 of them is exact in every dtype,
/// so results must match the serial reference bit for bit.
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

/// Runs every op for dtype `T` on one cluster and checks each against the
/// reference; returns a description of the first failure.
fn check_dtype<T: Element>(
    n: usize,
    len: usize,
    seed: u64,
    algorithm: Algorithm,
    topo: Topology,
) -> Result<(), String> {
    let cols: Vec<Vec<f64>> = (0..n).map(|r| contribution(seed, r, len)).collect();
    let root = (seed as usize) % n;
    // all-to-all-v counts: counts[i][j] = elements rank i sends to rank j
    let counts: Vec<Vec<usize>> = (0..n)
        .map(|i| {
            (0..n)
                .map(|j| ((seed as usize) + 3 * i + 5 * j) % 4)
                .collect()
        })
        .collect();
    let results = LocalCluster::builder(n)
        .timeout(Duration::from_secs(20))
        .topology(topo)
        .run_each(|comm| -> Result<(), String> {
            let r = comm.rank();
            let mine: Vec<T> = conv(&cols[r]);
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let want: Vec<T> = conv(&reference(op, &cols));
                let opts = ReduceOptions::new(op).algorithm(algorithm);
                let mut buf = mine.clone();
                comm.all_reduce_with(&mut buf, &opts)
                    .map_err(|e| e.to_string())?;
                if bits(&buf) != bits(&want) {
                    return Err(format!(
                        "all_reduce {op:?} {}: got {buf:?} want {want:?}",
                        T::DTYPE
                    ));
                }
                // with an f32 (or f64) wire
                if T::DTYPE != Dtype::F64 {
                    let mut buf = mine.clone();
                    comm.all_reduce_with(&mut buf, &opts.wire(Dtype::F32))
                        .map_err(|e| e.to_string())?;
                    if bits(&buf) != bits(&want) {
                        return Err(format!("all_reduce wire f32 {op:?} {}", T::DTYPE));
                    }
                }
                let sr = shard_range(len, n, r);
                let mut out = vec![T::ZERO; sr.len()];
                comm.reduce_scatter_with(&mine, &mut out, &opts)
                    .map_err(|e| e.to_string())?;
                if bits(&out) != bits(&want[sr.clone()]) {
                    return Err(format!("reduce_scatter {op:?} {}", T::DTYPE));
                }
                if T::DTYPE != Dtype::F64 {
                    let mut out = vec![T::ZERO; sr.len()];
                    comm.reduce_scatter_with(&mine, &mut out, &opts.wire(Dtype::F32))
                        .map_err(|e| e.to_string())?;
                    if bits(&out) != bits(&want[sr.clone()]) {
                        return Err(format!("reduce_scatter wire f32 {op:?} {}", T::DTYPE));
                    }
                }
                let mut buf = mine.clone();
                comm.reduce_buf(weft_collectives::BufMut::new(&mut buf), root, op, algorithm)
                    .map_err(|e| e.to_string())?;
                if r == root && bits(&buf) != bits(&want) {
                    return Err(format!("reduce {op:?} {} root {root}", T::DTYPE));
                }
            }
            // all-gather: rank r contributes its shard of rank 0's... of the
            // concatenation of every rank's own shard.
            let full: Vec<T> = (0..len).map(|i| T::from_f64(i as f64 % 50.0)).collect();
            let mut out = vec![T::ZERO; len];
            comm.all_gather_with(&full[shard_range(len, n, r)], &mut out, algorithm)
                .map_err(|e| e.to_string())?;
            if bits(&out) != bits(&full) {
                return Err(format!("all_gather {}", T::DTYPE));
            }
            // in place: only the rank's own shard is filled on entry
            let mut inp = vec![T::ZERO; len];
            let sr = shard_range(len, n, r);
            inp[sr.clone()].copy_from_slice(&full[sr]);
            comm.all_gather_in_place_with(&mut inp, algorithm)
                .map_err(|e| e.to_string())?;
            if bits(&inp) != bits(&full) {
                return Err(format!("all_gather in place {}", T::DTYPE));
            }
            let mut b = if r == root {
                full.clone()
            } else {
                vec![T::ZERO; len]
            };
            comm.broadcast_buf(weft_collectives::BufMut::new(&mut b), root, algorithm)
                .map_err(|e| e.to_string())?;
            if bits(&b) != bits(&full) {
                return Err(format!("broadcast {} root {root}", T::DTYPE));
            }
            // all-to-all (equal): block j of rank i is value 100 i + j
            let m = len % 5;
            let send: Vec<T> = (0..n * m)
                .map(|k| T::from_f64((100 * r + k / m.max(1)) as f64))
                .collect();
            let mut recv = vec![T::ZERO; n * m];
            comm.all_to_all(&send, &mut recv)
                .map_err(|e| e.to_string())?;
            let want: Vec<T> = (0..n * m)
                .map(|k| T::from_f64((100 * (k / m.max(1)) + r) as f64))
                .collect();
            if bits(&recv) != bits(&want) {
                return Err(format!("all_to_all {}", T::DTYPE));
            }
            // all-to-all-v: element k of the block for j is 1000 r + 10 j + k
            let send_counts = &counts[r];
            let recv_counts: Vec<usize> = (0..n).map(|i| counts[i][r]).collect();
            let send: Vec<T> = (0..n)
                .flat_map(|j| {
                    (0..send_counts[j]).map(move |k| T::from_f64((1000 * r + 10 * j + k) as f64))
                })
                .collect();
            let mut recv = vec![T::ZERO; recv_counts.iter().sum()];
            comm.all_to_all_v(&send, send_counts, &mut recv, &recv_counts)
                .map_err(|e| e.to_string())?;
            let want: Vec<T> = (0..n)
                .flat_map(|i| {
                    (0..recv_counts[i]).map(move |k| T::from_f64((1000 * i + 10 * r + k) as f64))
                })
                .collect();
            if bits(&recv) != bits(&want) {
                return Err(format!("all_to_all_v {}: {recv:?} vs {want:?}", T::DTYPE));
            }
            comm.barrier().map_err(|e| e.to_string())?;
            Ok(())
        });
    for (r, res) in results.into_iter().enumerate() {
        res.map_err(|e| format!("rank {r}: {e}"))??;
    }
    Ok(())
}

fn topo_for(n: usize, algorithm: Algorithm) -> Option<Topology> {
    if algorithm != Algorithm::Hierarchical {
        return Some(Topology::new(2));
    }
    // domains of k ranks with at least two domains
    (2..n).find(|k| n.is_multiple_of(*k)).map(Topology::new)
}

/// A world size `algorithm` can run on, from a drawn `n`: hierarchical
/// collectives need two or more domains of two or more ranks, so a drawn
/// size without one becomes the next that has one (every case runs).
fn runnable(n: usize, algorithm: Algorithm) -> (usize, Topology) {
    (n..)
        .find_map(|n| topo_for(n, algorithm).map(|t| (n, t)))
        .expect("composite sizes exist")
}

const ALGOS: [Algorithm; 4] = [
    Algorithm::Auto,
    Algorithm::Ring,
    Algorithm::RecursiveDoubling,
    Algorithm::Hierarchical,
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 28, ..ProptestConfig::default() })]

    #[test]
    fn every_op_matches_serial_reference(
        n in 1usize..=8,
        len_kind in 0usize..5,
        extra in 0usize..400,
        seed in any::<u64>(),
        alg in 0usize..4,
        one_domain in any::<bool>(),
    ) {
        let algorithm = ALGOS[alg];
        let (n, mut topo) = runnable(n, algorithm);
        if one_domain && algorithm != Algorithm::Hierarchical {
            // 3 to 16 ranks in one domain: the ring's phases run direct
            topo = Topology::flat();
        }
        let len = match len_kind { 0 => 0, 1 => 1, 2 => n + 1, 3 => 3 * n - 1, _ => extra };
        check_dtype::<f32>(n, len, seed, algorithm, topo).map_err(TestCaseError::fail)?;
        check_dtype::<f64>(n, len, seed, algorithm, topo).map_err(TestCaseError::fail)?;
        check_dtype::<f16>(n, len, seed, algorithm, topo).map_err(TestCaseError::fail)?;
        check_dtype::<bf16>(n, len, seed, algorithm, topo).map_err(TestCaseError::fail)?;
    }
}

#[test]
fn every_world_size_and_algorithm_once() {
    for n in 1..=8 {
        for algorithm in ALGOS {
            if let Some(topo) = topo_for(n, algorithm) {
                check_dtype::<f32>(n, 37, n as u64, algorithm, topo).unwrap();
            }
            if algorithm != Algorithm::Hierarchical {
                check_dtype::<f32>(n, 37, n as u64, algorithm, Topology::flat()).unwrap();
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// With real (rounding) values the ring reduce-scatter adds in the
    /// ring's order, so each rank's shard has exactly the bits of the same
    /// rank's shard of the ring all-reduce: the out-of-place reduce-scatter
    /// (input read in place, no whole-buffer copy) changes no rounding.
    #[test]
    fn ring_reduce_scatter_has_the_bits_of_the_ring_all_reduce(
        n in 2usize..=5,
        len in 0usize..3000,
        seed in any::<u64>(),
        op in 0usize..4,
    ) {
        let op = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min][op];
        let ring = ReduceOptions::new(op).algorithm(Algorithm::Ring);
        let out = LocalCluster::run(n, |comm| {
            let r = comm.rank() as u64;
            let mine: Vec<f32> = contribution(seed ^ r, comm.rank(), len)
                .iter()
                .enumerate()
                .map(|(i, x)| (*x as f32 + 0.1) * ((i as f32 + 1.0) * 0.37 + r as f32).sin())
                .collect();
            let mut all = mine.clone();
            comm.all_reduce_with(&mut all, &ring)?;
            let sr = shard_range(len, n, comm.rank());
            let mut shard = vec![0f32; sr.len()];
            comm.reduce_scatter_with(&mine, &mut shard, &ring)?;
            Ok::<_, weft_collectives::Error>((bits(&all[sr]), bits(&shard)))
        })
        .unwrap();
        for (r, res) in out.into_iter().enumerate() {
            let (want, got) = res.unwrap();
            prop_assert_eq!(got, want, "rank {}", r);
        }
    }
}

#[test]
fn large_buffer_real_values_match_f64_reference() {
    // Non-integer data: compare with an f64 reference within the bound of
    // n − 1 roundings of f32.
    let n = 3;
    let len = 100_003;
    let cols: Vec<Vec<f32>> = (0..n)
        .map(|r| {
            (0..len)
                .map(|i| ((i * 7 + r * 13) as f32 * 0.001).sin())
                .collect()
        })
        .collect();
    let out = LocalCluster::run(n, |comm| {
        let mut b = cols[comm.rank()].clone();
        comm.all_reduce_with(
            &mut b,
            &ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring),
        )?;
        Ok::<_, weft_collectives::Error>(b)
    })
    .unwrap();
    for r in out {
        let r = r.unwrap();
        for i in 0..len {
            let exact: f64 = cols.iter().map(|c| f64::from(c[i])).sum();
            let bound = 3.0
                * f64::from(f32::EPSILON)
                * cols.iter().map(|c| f64::from(c[i].abs())).sum::<f64>();
            assert!(
                (f64::from(r[i]) - exact).abs() <= bound + 1e-30,
                "element {i}"
            );
        }
    }
}

#[test]
fn f16_with_f32_wire_accumulates_in_f32() {
    // 2048 + 7 × 1 = 2055 exactly, which rounds once to 2056 in f16. With an
    // f16 wire the partial sum 2048 + 1 already rounds back to 2048.
    let out = LocalCluster::run(8, |comm| {
        let mut narrow = vec![f16::from_f32(if comm.rank() == 0 { 2048.0 } else { 1.0 }); 16];
        let mut wide = narrow.clone();
        let opts = ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::RecursiveDoubling);
        comm.all_reduce_with(&mut narrow, &opts)?;
        comm.all_reduce_with(&mut wide, &opts.wire(Dtype::F32))?;
        Ok::<_, weft_collectives::Error>((narrow[0].to_f32(), wide[0].to_f32()))
    })
    .unwrap();
    for r in out {
        let (narrow, wide) = r.unwrap();
        assert_eq!(wide, 2056.0);
        assert_eq!(narrow, 2054.0);
    }
    // A narrower wire than the buffer is refused.
    let out = LocalCluster::run(2, |comm| {
        let mut x = vec![1.0f32; 4];
        comm.all_reduce_with(&mut x, &ReduceOptions::new(ReduceOp::Sum).wire(Dtype::BF16))
    })
    .unwrap();
    assert!(
        out[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("narrower")
    );
}

#[test]
fn send_recv_is_buffered_and_ordered() {
    let out = LocalCluster::run(2, |comm| -> Result<Vec<f32>, weft_collectives::Error> {
        let peer = 1 - comm.rank();
        // both send first: must not deadlock
        comm.send(peer, 7, &[comm.rank() as f32; 3])?;
        comm.send(peer, 7, &[10.0 + comm.rank() as f32; 3])?;
        let mut a = [0f32; 3];
        let mut b = [0f32; 3];
        comm.recv(peer, 7, &mut a)?;
        comm.recv(peer, 7, &mut b)?;
        Ok(vec![a[0], b[0]])
    })
    .unwrap();
    assert_eq!(out[0].as_ref().unwrap(), &vec![1.0, 11.0]);
    assert_eq!(out[1].as_ref().unwrap(), &vec![0.0, 10.0]);
}

#[test]
fn split_and_mesh_give_the_right_groups() {
    let out = LocalCluster::run(8, |comm| -> Result<(), weft_collectives::Error> {
        let r = comm.rank();
        let sub = comm.split((r % 2) as u32, (7 - r) as u32)?;
        assert_eq!(sub.size(), 4);
        // key reversed: world rank 7 or 6 is rank 0
        assert_eq!(sub.rank(), (7 - r) / 2);
        let mut x = vec![r as f32];
        sub.all_reduce(&mut x, ReduceOp::Sum)?;
        assert_eq!(x[0], if r % 2 == 0 { 12.0 } else { 16.0 });

        let mesh = Mesh::new(&comm, &[("pp", 2), ("dp", 2), ("tp", 2)])?;
        assert_eq!(mesh.coords(), &[r / 4, (r / 2) % 2, r % 2]);
        assert_eq!(mesh.rank_at(mesh.coords())?, r);
        let tp = mesh.dim("tp")?;
        assert_eq!((tp.size(), tp.rank()), (2, r % 2));
        // tp group = consecutive ranks
        assert_eq!(tp.world_rank_of(0), r - r % 2);
        let mut x = vec![r as f32];
        mesh.dim("dp")?.all_reduce(&mut x, ReduceOp::Sum)?;
        let base = (r / 4) * 4 + r % 2;
        assert_eq!(x[0], (base + base + 2) as f32);
        let dptp = mesh.group(&["dp", "tp"])?;
        assert_eq!(dptp.size(), 4);
        let mut x = vec![1.0f64];
        dptp.all_reduce(&mut x, ReduceOp::Sum)?;
        assert_eq!(x[0], 4.0);
        assert!(mesh.dim("ep").is_err());
        Ok(())
    })
    .unwrap();
    for r in out {
        r.unwrap();
    }
    let err = LocalCluster::run(4, |comm| Mesh::new(&comm, &[("dp", 3)]).map(|_| ())).unwrap();
    assert!(
        err[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("multiply to 3")
    );
}

#[test]
fn non_blocking_all_reduce_progresses_while_the_caller_computes() {
    let out = LocalCluster::run(2, |comm| -> Result<bool, weft_collectives::Error> {
        let buf = vec![1.0f32; 1 << 16];
        let pending = comm.all_reduce_async(buf, ReduceOptions::new(ReduceOp::Sum))?;
        // "compute": spin on the caller thread without calling into the
        // communicator until the operation reports it finished.
        let start = std::time::Instant::now();
        let mut acc = 0u64;
        while !pending.is_finished() && start.elapsed() < Duration::from_secs(20) {
            for i in 0..10_000u64 {
                acc = acc.wrapping_add(i * i);
            }
        }
        let finished_during_compute = pending.is_finished();
        // a blocking op issued after the async one still works
        let mut y = vec![1.0f32; 8];
        comm.all_reduce(&mut y, ReduceOp::Sum)?;
        let x = pending.wait()?;
        assert!(x.iter().all(|&v| v == 2.0) && y[0] == 2.0 && acc != 1);
        let rs = comm.reduce_scatter_async(vec![1.0f32; 10], ReduceOptions::new(ReduceOp::Sum))?;
        let ag = comm.all_gather_async(vec![comm.rank() as f32; 5], 10)?;
        // in place: the rank's shard (of 11: 6 and 5) at its place, the
        // rest overwritten
        let mut full = vec![f32::NAN; 11];
        full[shard_range(11, 2, comm.rank())].fill(comm.rank() as f32 + 1.0);
        let agi = comm.all_gather_in_place_async(full.clone())?;
        // and a function of the gathered buffer, computed where it ran
        let sum = comm.all_gather_in_place_async_then(full, |b| b.iter().sum::<f32>())?;
        assert_eq!(rs.wait()?, vec![2.0; 5]);
        assert_eq!(sum.wait()?, 6.0 * 1.0 + 5.0 * 2.0);
        assert_eq!(ag.wait()?, [vec![0.0; 5], vec![1.0; 5]].concat());
        assert_eq!(agi.wait()?, [vec![1.0; 6], vec![2.0; 5]].concat());
        Ok(finished_during_compute)
    })
    .unwrap();
    for r in out {
        assert!(
            r.unwrap(),
            "the all-reduce did not complete while the caller computed"
        );
    }
}

/// The direct reduce-scatter (3 ranks in one domain) of outputs large
/// enough to be streamed past the cache (8 MiB and more, written tile by
/// tile), with a length that leaves a partial last tile: every element is
/// the serial sum, and the all-reduce (in place, its own chunk one of the
/// terms) agrees bit for bit.
#[test]
fn direct_reduce_scatter_streams_large_outputs_exactly() {
    let n = 3;
    let len = 3 * (2 << 20) + 7;
    let val = |r: usize, i: usize| ((i * 31 + r * 17) % 1021) as f32 - 510.0;
    let out = LocalCluster::run(n, |comm| {
        let r = comm.rank();
        let mine: Vec<f32> = (0..len).map(|i| val(r, i)).collect();
        let sr = shard_range(len, n, r);
        let mut shard = vec![0f32; sr.len()];
        comm.reduce_scatter_with(
            &mine,
            &mut shard,
            &ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring),
        )?;
        let mut all = mine;
        comm.all_reduce(&mut all, ReduceOp::Sum)?;
        Ok::<_, weft_collectives::Error>((sr, shard, all))
    })
    .unwrap();
    for res in out {
        let (sr, shard, all) = res.unwrap();
        assert!(shard.len() * 4 >= 8 << 20);
        for (k, i) in sr.clone().enumerate() {
            let want: f32 = (0..n).map(|r| val(r, i)).sum();
            assert_eq!(shard[k], want, "element {i}");
        }
        assert_eq!(bits(&all[sr]), bits(&shard));
    }
}
