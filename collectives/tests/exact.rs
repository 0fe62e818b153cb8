//! Exact partials for data parallelism: M contributions accumulated on one
//! rank or split over N ranks (any split, any order) give the same bits,
//! equal to numerics' ExactSum rounded once (sum) and to the correctly
//! rounded quotient of that exact sum by M (mean).

use proptest::prelude::*;
use weft_collectives::repro::{BLOCK, ExactPartial};
use weft_collectives::{
    Communicator, CommunicatorExt, Element, LocalCluster, OpKind, ReduceOp, Topology, bf16,
    shard_range,
};
use weft_numerics::ExactSum;

fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// `m` contributions of `len` values: gradient-like (narrow blocks, the
/// fast path) when `wide` is false, else spanning 60 binades with zeros,
/// −0.0 and, with `special`, a NaN or ∞ here and there.
fn contributions(seed: u64, m: usize, len: usize, wide: bool, special: bool) -> Vec<Vec<f32>> {
    let mut next = rng(seed);
    (0..m)
        .map(|_| {
            (0..len)
                .map(|i| {
                    let u = next();
                    let mant = 1.0 + ((u >> 40) as f32) / (1u64 << 24) as f32;
                    let e = if wide {
                        ((u >> 8) % 60) as i32 - 40
                    } else {
                        -12 - ((i / BLOCK) % 5) as i32 - ((u >> 8) % 6) as i32
                    };
                    let v = mant * 2f32.powi(e);
                    match u % 101 {
                        0 if wide => 0.0,
                        1 if wide => -0.0,
                        2 if special => f32::INFINITY,
                        3 if special => f32::NAN,
                        _ if u.is_multiple_of(2) => v,
                        _ => -v,
                    }
                })
                .collect()
        })
        .collect()
}

fn bits<T: Element>(xs: &[T]) -> Vec<u64> {
    xs.iter()
        .map(|x| {
            let v = x.to_f64();
            if v.is_nan() { u64::MAX } else { v.to_bits() }
        })
        .collect()
}

fn exact_sum<T: Element>(cols: &[Vec<T>], i: usize) -> ExactSum {
    let mut s = ExactSum::new();
    for c in cols {
        s.add(c[i]);
    }
    s
}

/// The f32 nearest to (exact sum)/m, ties to even, found by comparing the
/// exact residuals |S − m·c| of the neighbours c of an approximation.
fn mean_ref(cols: &[Vec<f32>], i: usize) -> f32 {
    let m = cols.len();
    let approx = (exact_sum(cols, i).to_f64() / m as f64) as f32;
    if !approx.is_finite() {
        return approx;
    }
    // sign · (S − m·c), exactly
    let res = |c: f32, sign: f32| -> ExactSum {
        let mut r = ExactSum::new();
        for col in cols {
            r.add(sign * col[i]);
        }
        for _ in 0..m {
            r.add(-sign * c);
        }
        r
    };
    let sign = |c: f32| {
        if res(c, 1.0).to_f64() < 0.0 {
            -1.0
        } else {
            1.0
        }
    };
    let step = |c: f32, up: bool| {
        if c == 0.0 {
            return if up {
                f32::from_bits(1)
            } else {
                -f32::from_bits(1)
            };
        }
        let b = c.to_bits();
        f32::from_bits(if (c > 0.0) == up { b + 1 } else { b - 1 })
    };
    let mut best = step(approx, false);
    for c in [approx, step(approx, true)] {
        // |S − m·best| − |S − m·c|
        let mut d = res(best, sign(best));
        d.merge(&res(c, -sign(c)));
        let d = d.to_f64();
        if d > 0.0 || (d == 0.0 && c.to_bits().is_multiple_of(2)) {
            best = c;
        }
    }
    best
}

/// Runs `split[r]` contributions on rank r; every rank returns the
/// all-reduced sum and mean and the reduce-scattered sum shard.
fn run_split(cols: &[Vec<f32>], split: &[Vec<usize>]) -> Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let n = split.len();
    let len = cols[0].len();
    LocalCluster::run(n, |comm| {
        let mut p = ExactPartial::new(len);
        for &k in &split[comm.rank()] {
            p.add(&cols[k])?;
        }
        let mut sum = vec![0f32; len];
        comm.all_reduce_exact(&p, &mut sum, ReduceOp::Sum)?;
        let mut mean = vec![0f32; len];
        comm.all_reduce_exact(&p, &mut mean, ReduceOp::Avg)?;
        let mut shard = vec![0f32; shard_range(len, n, comm.rank()).len()];
        comm.reduce_scatter_exact(&p, &mut shard, ReduceOp::Sum)?;
        Ok::<_, weft_collectives::Error>((sum, mean, shard))
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

fn check_split(cols: &[Vec<f32>], split: &[Vec<usize>]) {
    let len = cols[0].len();
    let n = split.len();
    let want_sum: Vec<f32> = (0..len).map(|i| exact_sum(cols, i).to_f32()).collect();
    let want_mean: Vec<f32> = (0..len).map(|i| mean_ref(cols, i)).collect();
    // one rank, all contributions in order
    let mut one = ExactPartial::new(len);
    for c in cols {
        one.add(c).unwrap();
    }
    let mut s1 = vec![0f32; len];
    one.round_to(&mut s1).unwrap();
    let mut m1 = vec![0f32; len];
    one.mean_to(&mut m1).unwrap();
    assert_eq!(bits(&s1), bits(&want_sum), "one rank sum vs ExactSum");
    assert_eq!(bits(&m1), bits(&want_mean), "one rank mean vs reference");
    for (r, (sum, mean, shard)) in run_split(cols, split).iter().enumerate() {
        assert_eq!(bits(sum), bits(&want_sum), "split {split:?} rank {r} sum");
        assert_eq!(
            bits(mean),
            bits(&want_mean),
            "split {split:?} rank {r} mean"
        );
        let sr = shard_range(len, n, r);
        assert_eq!(bits(shard), bits(&want_sum[sr]), "rank {r} shard");
    }
}

/// A random uneven split of `0..m` over `n` ranks (some may get none), in
/// a random order.
fn random_split(next: &mut impl FnMut() -> u64, m: usize, n: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..m).collect();
    for i in (1..m).rev() {
        order.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    let mut split = vec![Vec::new(); n];
    for k in order {
        split[(next() % n as u64) as usize].push(k);
    }
    split
}

#[test]
fn any_split_gives_the_bits_of_one_rank() {
    let mut next = rng(42);
    for case in 0..12u64 {
        let m = 1 + (next() % 8) as usize;
        let n = 1 + (case % 4) as usize;
        let len = [0usize, 1, 63, 64, 65, 130, 301][(next() % 7) as usize];
        let wide = case % 3 == 2;
        let cols = contributions(case * 31 + 7, m, len, wide, false);
        let split = random_split(&mut next, m, n);
        check_split(&cols, &split);
    }
}

#[test]
fn specials_and_wide_blocks_stay_exact() {
    // NaN, ±∞, −0.0 and blocks spanning 60 binades over 3 ranks
    let cols = contributions(5, 5, 200, true, true);
    let split = vec![vec![4, 0], vec![], vec![2, 3, 1]];
    let want: Vec<u64> = bits(
        &(0..200)
            .map(|i| exact_sum(&cols, i).to_f32())
            .collect::<Vec<_>>(),
    );
    for (sum, _, _) in run_split(&cols, &split) {
        assert_eq!(bits(&sum), want);
    }
    // only −0.0 contributions sum to −0.0
    let z = vec![vec![-0.0f32; 70]; 3];
    for (sum, mean, _) in run_split(&z, &[vec![0], vec![1, 2]]) {
        assert!(
            sum.iter()
                .chain(&mean)
                .all(|x| x.to_bits() == (-0.0f32).to_bits())
        );
    }
}

#[test]
fn thousands_of_micro_batches_widen_blocks_exactly() {
    // 3000 large same-sign contributions carry past two words.
    let len = 70;
    let col: Vec<f32> = (0..len).map(|i| 3.0e30 - i as f32 * 1e23).collect();
    let mut p = ExactPartial::new(len);
    let mut s = vec![ExactSum::new(); len];
    for k in 0..3000 {
        let c: Vec<f32> = col.iter().map(|x| x * (1.0 + k as f32 * 1e-4)).collect();
        p.add(&c).unwrap();
        for (acc, x) in s.iter_mut().zip(&c) {
            acc.add(*x);
        }
    }
    let mut got = vec![0f64; len];
    p.round_to(&mut got).unwrap();
    let want: Vec<f64> = s.iter().map(|x| x.to_f64()).collect();
    assert_eq!(bits(&got), bits(&want));
    // the widened partial reduces like any other (one rank adds nothing)
    let outs = LocalCluster::run(2, |comm| {
        let mut out = vec![0f64; len];
        let mine = if comm.rank() == 0 {
            p.clone()
        } else {
            ExactPartial::new(len)
        };
        comm.all_reduce_exact(&mine, &mut out, ReduceOp::Sum)?;
        Ok::<_, weft_collectives::Error>(out)
    })
    .unwrap();
    for out in outs {
        assert_eq!(bits(&out.unwrap()), bits(&want));
    }
}

#[test]
fn bf16_and_mixed_dtypes_accumulate_exactly() {
    let cols = contributions(9, 4, 150, true, false);
    let b: Vec<Vec<bf16>> = cols
        .iter()
        .map(|c| c.iter().map(|&x| bf16::from_f32(x)).collect())
        .collect();
    let mut p = ExactPartial::new(150);
    p.add(&b[0]).unwrap();
    p.add(&cols[1]).unwrap();
    p.add(&b[2]).unwrap();
    p.add(&cols[3]).unwrap();
    let mut got = vec![bf16::ZERO; 150];
    p.round_to(&mut got).unwrap();
    for i in 0..150 {
        let mut s = ExactSum::new();
        s.add(b[0][i]);
        s.add(cols[1][i]);
        s.add(b[2][i]);
        s.add(cols[3][i]);
        assert_eq!(
            got[i].to_bits(),
            s.round_to::<bf16>().to_bits(),
            "element {i}"
        );
    }
}

#[test]
fn wrong_lengths_and_ops_are_typed_errors() {
    let mut p = ExactPartial::new(10);
    assert!(
        p.add(&[1.0f32; 9])
            .unwrap_err()
            .to_string()
            .contains("9 elements")
    );
    p.add(&[1.0f32; 10]).unwrap();
    let out = LocalCluster::run(2, |comm| {
        let mut o = vec![0f32; 11];
        let a = comm
            .all_reduce_exact(&p, &mut o, ReduceOp::Sum)
            .unwrap_err();
        let mut o = vec![0f32; 10];
        let b = comm
            .all_reduce_exact(&p, &mut o, ReduceOp::Max)
            .unwrap_err();
        (a.to_string(), b.to_string())
    })
    .unwrap();
    assert!(out[0].0.contains("11 elements"), "{}", out[0].0);
    assert!(out[0].1.contains("max"), "{}", out[0].1);
}

/// With no contribution anywhere the sum is +0.0 (the empty sum), with
/// or without a divisor and on any number of ranks; a rank without
/// contributions leaves the others' sum unchanged, −0.0 included.
#[test]
fn empty_partials_sum_to_positive_zero() {
    let len = 2 * BLOCK + 5;
    for n in [1usize, 2, 3, 5] {
        for with_neg_zero in [false, true] {
            let outs = LocalCluster::run(n, |comm| {
                let mut p = ExactPartial::new(len);
                if with_neg_zero && comm.rank() == n - 1 {
                    p.add(&vec![-0.0f32; len])?;
                }
                let r = shard_range(len, n, comm.rank());
                let mut sum = vec![1f32; len];
                comm.all_reduce_exact(&p, &mut sum, ReduceOp::Sum)?;
                let mut mean = vec![1f32; len];
                comm.all_reduce_exact(&p, &mut mean, ReduceOp::Avg)?;
                let mut div = vec![1f32; len];
                comm.all_reduce_exact_div(&p, &mut div, 3)?;
                let mut shard = vec![1f32; r.len()];
                comm.reduce_scatter_exact_div(&p, &mut shard, 7)?;
                let mut shard_sum = vec![1f32; r.len()];
                comm.reduce_scatter_exact(&p, &mut shard_sum, ReduceOp::Sum)?;
                Ok::<_, weft_collectives::Error>([sum, mean, div, shard, shard_sum])
            })
            .unwrap();
            let want = if with_neg_zero { -0.0f32 } else { 0.0 };
            for (r, o) in outs.into_iter().enumerate() {
                for (k, v) in o.unwrap().iter().enumerate() {
                    assert!(
                        v.iter().all(|x| x.to_bits() == want.to_bits()),
                        "{n} ranks, rank {r}, output {k}, -0.0 added: {with_neg_zero}"
                    );
                }
            }
        }
    }
}

/// Ranks whose partials differ in length get a typed error, not a hang.
#[test]
fn mismatched_partial_lengths_are_reported() {
    let outs = LocalCluster::run(2, |comm| {
        let len = 100 + comm.rank();
        let mut p = ExactPartial::new(len);
        p.add(&vec![1.0f32; len])?;
        let mut out = vec![0f32; len];
        comm.all_reduce_exact(&p, &mut out, ReduceOp::Sum)
    })
    .unwrap();
    // (one rank sees the mismatch, the other may see the abort it causes;
    // both name the two calls)
    for o in outs {
        let e = o.unwrap_err().to_string();
        assert!(e.contains("f32 x 100") && e.contains("f32 x 101"), "{e}");
    }
}

#[test]
fn traffic_counts_the_encoded_partials() {
    // gradient-like values, two contributions per rank (one would travel
    // as values, see below): every block is two words (8 + 64·8 bytes)
    let (n, len) = (3usize, 1000usize);
    let cols = contributions(3, 2 * n, len, false, false);
    let per_rank = LocalCluster::run(n, |comm| {
        let mut p = ExactPartial::new(len);
        p.add(&cols[comm.rank()])?;
        p.add(&cols[n + comm.rank()])?;
        let before = comm.traffic();
        let mut out = vec![0f32; len];
        comm.all_reduce_exact(&p, &mut out, ReduceOp::Sum)?;
        Ok::<_, weft_collectives::Error>((comm.traffic().since(&before), p.encoded_bytes()))
    })
    .unwrap();
    let block_bytes = |b: usize| 8 + 8 * BLOCK.min(len - b * BLOCK);
    let cover = |c: usize| {
        let r = shard_range(len, n, c);
        (r.start / BLOCK..r.end.div_ceil(BLOCK))
            .map(block_bytes)
            .sum::<usize>()
    };
    for (me, r) in per_rank.into_iter().enumerate() {
        let (t, enc) = r.unwrap();
        assert_eq!(
            enc,
            (0..len.div_ceil(BLOCK)).map(block_bytes).sum::<usize>()
        );
        // reduce-scatter: n − 1 encoded chunk covers; all-gather (direct
        // in one domain): this rank's native chunk to each peer;
        let rs: usize = (0..n - 1).map(|s| cover((me + 2 * n - s - 1) % n)).sum();
        let ag = (n - 1) * 4 * shard_range(len, n, me).len();
        // (a sum exchanges no counts)
        assert_eq!(t.sent_by(OpKind::AllReduce), (rs + ag) as u64, "rank {me}");
        assert_eq!(t.total_sent(), (rs + ag) as u64);
    }
}

/// One f32 contribution on every rank: the partials hold the values, and
/// a large enough reduction learns so from the ranks' counts (16 bytes per
/// rank, gathered) and moves the values, 4 bytes per element (in one
/// domain; across domains the ring's later steps carry encoded partial
/// sums), with the bits of the encoded route: against one rank holding every
/// contribution, for sums, means and quotients, f32 results, two ranks and
/// three (direct in one domain, the ring across domains), with special
/// and wide blocks among gradient-like ones.
#[test]
fn single_contributions_travel_as_values() {
    let len = 20_000;
    for n in [2usize, 3] {
        let mut cols = contributions(40 + n as u64, n, len, false, false);
        let wide = contributions(50, n, 2 * BLOCK + 3, true, true);
        for (c, w) in cols.iter_mut().zip(&wide) {
            c[len / 2..len / 2 + w.len()].copy_from_slice(w);
        }
        let mut one = ExactPartial::new(len);
        for c in &cols {
            one.add(c).unwrap();
        }
        let mut sum = vec![0f32; len];
        one.round_to(&mut sum).unwrap();
        let mut mean = vec![0f32; len];
        one.mean_to(&mut mean).unwrap();
        let mut by7 = vec![0f32; len];
        one.div_to(&mut by7, 7).unwrap();
        for topo in [Topology::flat(), Topology::new(1)] {
            let outs = LocalCluster::builder(n).topology(topo).run_each(|comm| {
                let mut p = ExactPartial::new(len);
                p.add(&cols[comm.rank()])?;
                assert_eq!(p.encoded_bytes(), 4 * len);
                let before = comm.traffic();
                let mut s = vec![0f32; len];
                comm.all_reduce_exact(&p, &mut s, ReduceOp::Sum)?;
                let t = comm.traffic().since(&before);
                let mut m = vec![0f32; len];
                comm.all_reduce_exact(&p, &mut m, ReduceOp::Avg)?;
                let r = shard_range(len, n, comm.rank());
                let mut q = vec![0f32; r.len()];
                comm.reduce_scatter_exact_div(&p, &mut q, 7)?;
                Ok::<_, weft_collectives::Error>((s, m, q, r, t))
            });
            for (me, out) in outs.into_iter().enumerate() {
                let (s, m, q, r, t) = out.unwrap().unwrap();
                assert_eq!(bits(&s), bits(&sum), "n={n} {topo:?} sum");
                assert_eq!(bits(&m), bits(&mean), "n={n} {topo:?} mean");
                assert_eq!(bits(&q), bits(&by7[r]), "n={n} {topo:?} /7");
                if topo != Topology::flat() {
                    // (the ring's later steps carry encoded partial sums)
                    continue;
                }
                // the counts, the values of the other ranks' chunks, then
                // the all-gather of rounded values (this rank's chunk to
                // each peer: one step with two ranks, direct with three)
                let chunks: usize = (0..n)
                    .filter(|&k| k != me)
                    .map(|k| 4 * shard_range(len, n, k).len())
                    .sum();
                let ag = (n - 1) * 4 * shard_range(len, n, me).len();
                let want = 16 * (n - 1) + chunks + ag;
                assert_eq!(t.total_sent(), want as u64, "n={n} {topo:?} rank {me}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn random_contributions_and_splits_match(
        m in 1usize..=8,
        n in 1usize..=4,
        len in 0usize..260,
        seed in any::<u64>(),
        wide in any::<bool>(),
    ) {
        let cols = contributions(seed, m, len, wide, false);
        let mut next = rng(seed ^ 0x9e37_79b9);
        let split = random_split(&mut next, m, n);
        check_split(&cols, &split);
    }
}

#[test]
fn merged_partials_equal_one_partial() {
    let cols = contributions(77, 5, 333, true, true);
    let mut a = ExactPartial::new(333);
    let mut b = ExactPartial::new(333);
    let mut all = ExactPartial::new(333);
    for (k, c) in cols.iter().enumerate() {
        if k % 2 == 0 { a.add(c) } else { b.add(c) }.unwrap();
        all.add(c).unwrap();
    }
    a.merge_from(&b).unwrap();
    a.merge_from(&ExactPartial::new(333)).unwrap();
    assert_eq!(a.count(), 5);
    let (mut x, mut y) = (vec![0f32; 333], vec![0f32; 333]);
    a.round_to(&mut x).unwrap();
    all.round_to(&mut y).unwrap();
    assert_eq!(bits(&x), bits(&y));
    a.mean_to(&mut x).unwrap();
    all.mean_to(&mut y).unwrap();
    assert_eq!(bits(&x), bits(&y));
    // and it still accumulates and reduces afterwards
    a.add(&cols[0]).unwrap();
    all.add(&cols[0]).unwrap();
    let outs = LocalCluster::run(2, |comm| {
        let mut out = vec![0f32; 333];
        let p = if comm.rank() == 1 {
            a.clone()
        } else {
            ExactPartial::new(333)
        };
        comm.all_reduce_exact(&p, &mut out, ReduceOp::Sum)?;
        Ok::<_, weft_collectives::Error>(out)
    })
    .unwrap();
    all.round_to(&mut y).unwrap();
    for out in outs {
        assert_eq!(bits(&out.unwrap()), bits(&y));
    }
    assert!(a.merge_from(&ExactPartial::new(3)).is_err());
}

#[test]
fn direct_reduction_of_partials_matches_for_larger_groups() {
    // 5 to 16 ranks in one domain reduce partials directly (every piece at
    // once); 17 take the ring; specials and wide blocks included
    let mut next = rng(7);
    for (k, n) in [5usize, 8, 16, 17].into_iter().enumerate() {
        let m = n + 3;
        let len = [3usize, 130, 64 * n + 5][k % 3];
        let cols = contributions(k as u64 + 90, m, len, k % 2 == 1, k == 2);
        let split = random_split(&mut next, m, n);
        check_split(&cols, &split);
    }
}

#[test]
fn explicit_divisors_round_the_exact_quotient_once() {
    // The mean over a count the partials do not hold: dividing the exact
    // sum of m contributions by k is the mean of those m plus k − m zero
    // contributions, for any split over ranks.
    let mut next = rng(7);
    let (m, len) = (5, 3 * BLOCK + 9);
    let cols = contributions(11, m, len, true, false);
    for k in [m as u64, 8, 13] {
        let mut padded = cols.clone();
        padded.resize(k as usize, vec![0.0; len]);
        let want: Vec<f32> = (0..len).map(|i| mean_ref(&padded, i)).collect();
        let mut one = ExactPartial::new(len);
        for c in &cols {
            one.add(c).unwrap();
        }
        let mut got = vec![0f32; len];
        one.div_to(&mut got, k).unwrap();
        assert_eq!(bits(&got), bits(&want), "one rank, divisor {k}");
        for n in [2, 3] {
            let split = random_split(&mut next, m, n);
            let outs = LocalCluster::run(n, |comm| {
                let mut p = ExactPartial::new(len);
                for &j in &split[comm.rank()] {
                    p.add(&cols[j])?;
                }
                let mut out = vec![0f32; len];
                comm.all_reduce_exact_div(&p, &mut out, k)?;
                let r = shard_range(len, comm.size(), comm.rank());
                let mut shard = vec![0f32; r.len()];
                comm.reduce_scatter_exact_div(&p, &mut shard, k)?;
                Ok::<_, weft_collectives::Error>((out, r, shard))
            })
            .unwrap();
            for out in outs {
                let (out, r, shard) = out.unwrap();
                assert_eq!(bits(&out), bits(&want), "{n} ranks, divisor {k}");
                assert_eq!(
                    bits(&shard),
                    bits(&want[r]),
                    "{n} ranks, divisor {k}, shard"
                );
            }
        }
    }
    let p = ExactPartial::new(4);
    let e = LocalCluster::run(1, |comm| comm.all_reduce_exact_div(&p, &mut [0f32; 4], 0))
        .unwrap()
        .remove(0)
        .unwrap_err();
    assert!(
        matches!(
            e,
            weft_collectives::Error::InvalidArgument { arg: "divisor", .. }
        ),
        "{e}"
    );
}

/// Outputs of 8 MiB or more are written through an L1 tile streamed past
/// the cache: a reduce-scatter whose shards are just above that, with an
/// odd shard boundary (blocks straddle tiles and shards) and blocks of
/// every kind (narrow, wide, special) spread along it, gives the exact
/// sum's bits on both ranks — against `ExactSum` at a sample of elements
/// in every tile region, and against one rank's merged partial everywhere.
#[test]
fn streamed_outputs_round_every_block_exactly() {
    let len = 2 * (8 << 20) / 4 + 2 * 37 + 1;
    let narrow = contributions(5, 2, len, false, false);
    let wide = contributions(6, 2, 3 * BLOCK + 5, true, true);
    let mut cols = narrow;
    for (c, w) in cols.iter_mut().zip(&wide) {
        // wide and special blocks near the start, the shard boundary and
        // the end
        for at in [100, len / 2 - BLOCK, len - w.len()] {
            c[at..at + w.len()].copy_from_slice(w);
        }
    }
    let mut one = ExactPartial::new(len);
    for c in &cols {
        one.add(c).unwrap();
    }
    let mut want = vec![0f32; len];
    one.round_to(&mut want).unwrap();
    for i in (0..len)
        .step_by(4099)
        .chain([len / 2, len / 2 + 1, len - 1])
    {
        assert_eq!(
            bits(&[want[i]]),
            bits(&[exact_sum(&cols, i).round_to::<f32>()]),
            "element {i}"
        );
    }
    let outs = LocalCluster::run(2, |comm| {
        let mut p = ExactPartial::new(len);
        p.add(&cols[comm.rank()])?;
        let r = shard_range(len, 2, comm.rank());
        let mut shard = vec![0f32; r.len()];
        comm.reduce_scatter_exact(&p, &mut shard, ReduceOp::Sum)?;
        Ok::<_, weft_collectives::Error>((r, shard))
    })
    .unwrap();
    for out in outs {
        let (r, shard) = out.unwrap();
        assert!(shard.len() * 4 >= 8 << 20);
        assert!(bits(&shard) == bits(&want[r.clone()]), "shard {r:?}");
    }
}
