//! Reproducible mode: bitwise identical sums for any world size, algorithm
//! and order, equal to numerics' ExactSum rounded once.

use proptest::prelude::*;
use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, Element, LocalCluster, ReduceOp, ReduceOptions,
    Topology, bf16, shard_range,
};
use weft_numerics::ExactSum;

fn data(seed: u64, k: usize, len: usize) -> Vec<Vec<f32>> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..k)
        .map(|_| {
            (0..len)
                .map(|_| {
                    let u = next();
                    // wide exponent spread, both signs, some exact zeros
                    let mant = ((u >> 40) as f32) / (1u64 << 24) as f32;
                    let e = ((u >> 8) % 40) as i32 - 30;
                    let v = mant * 2f32.powi(e);
                    if u % 17 == 0 {
                        0.0
                    } else if u % 2 == 0 {
                        v
                    } else {
                        -v
                    }
                })
                .collect()
        })
        .collect()
}

fn exact<T: Element>(cols: &[Vec<T>]) -> Vec<T> {
    (0..cols[0].len())
        .map(|i| {
            let mut s = ExactSum::new();
            for c in cols {
                s.add(c[i]);
            }
            s.round_to::<T>()
        })
        .collect()
}

fn repro_all_reduce<T: Element>(
    cols: &[Vec<T>],
    algorithm: Algorithm,
    topo: Topology,
) -> Vec<Vec<T>> {
    let n = cols.len();
    LocalCluster::builder(n)
        .topology(topo)
        .run_each(|comm| {
            let mut b = cols[comm.rank()].clone();
            let opts = ReduceOptions::new(ReduceOp::Sum)
                .algorithm(algorithm)
                .reproducible(true);
            comm.all_reduce_with(&mut b, &opts)?;
            // reduce-scatter too
            let r = shard_range(b.len(), n, comm.rank());
            let mut out = vec![T::ZERO; r.len()];
            comm.reduce_scatter_with(&cols[comm.rank()], &mut out, &opts)?;
            assert_eq!(bits(&out), bits(&b[r]));
            Ok::<_, weft_collectives::Error>(b)
        })
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect()
}

fn bits<T: Element>(xs: &[T]) -> Vec<u64> {
    xs.iter().map(|x| x.to_f64().to_bits()).collect()
}

const ALGOS: [Algorithm; 3] = [
    Algorithm::Ring,
    Algorithm::RecursiveDoubling,
    Algorithm::Hierarchical,
];

#[test]
fn equals_exact_sum_for_every_world_size_and_algorithm() {
    let len = 301;
    for n in 1..=8 {
        let cols = data(n as u64 * 77, n, len);
        let want = bits(&exact(&cols));
        for alg in ALGOS {
            let topo = if alg == Algorithm::Hierarchical {
                match (2..n).find(|k| n % k == 0) {
                    Some(k) => Topology::new(k),
                    None => continue,
                }
            } else {
                Topology::flat()
            };
            for (r, got) in repro_all_reduce(&cols, alg, topo).iter().enumerate() {
                assert_eq!(bits(got), want, "n={n} {alg:?} rank {r}");
            }
        }
    }
}

#[test]
fn same_contributions_on_more_ranks_give_the_same_bits() {
    // {a, b, c} on 3 ranks vs {c, 0, a, 0, 0, b, 0, 0} on 8 ranks.
    let cols = data(5, 3, 1000);
    let zeros = vec![0.0f32; 1000];
    let eight = vec![
        cols[2].clone(),
        zeros.clone(),
        cols[0].clone(),
        zeros.clone(),
        zeros.clone(),
        cols[1].clone(),
        zeros.clone(),
        zeros,
    ];
    let a = repro_all_reduce(&cols, Algorithm::Ring, Topology::flat());
    let b = repro_all_reduce(&eight, Algorithm::RecursiveDoubling, Topology::flat());
    let c = repro_all_reduce(&eight, Algorithm::Hierarchical, Topology::new(4));
    assert_eq!(bits(&a[0]), bits(&b[5]));
    assert_eq!(bits(&a[1]), bits(&c[7]));
    // while the plain ring's result does depend on the grouping
    let plain = |cols: &[Vec<f32>]| {
        LocalCluster::run(cols.len(), |comm| {
            let mut b = cols[comm.rank()].clone();
            comm.all_reduce_with(
                &mut b,
                &ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring),
            )?;
            Ok::<_, weft_collectives::Error>(b)
        })
        .unwrap()
        .remove(0)
        .unwrap()
    };
    assert_ne!(bits(&plain(&cols)), bits(&plain(&eight)));
}

#[test]
fn bf16_repro_matches_exact_sum() {
    let cols: Vec<Vec<bf16>> = data(9, 5, 200)
        .iter()
        .map(|c| c.iter().map(|&x| bf16::from_f32(x)).collect())
        .collect();
    let want = bits(&exact(&cols));
    for got in repro_all_reduce(&cols, Algorithm::Ring, Topology::flat()) {
        assert_eq!(bits(&got), want);
    }
}

/// Two ranks add each element's two values once, in f64, and halve there
/// for the mean: the result must be the exact sum (or half of it) rounded
/// once, for f32, bf16 and f16, reduce-scattered and all-reduced — with
/// the values where a narrow addition would differ: pairs whose sum
/// overflows the format but whose mean does not, subnormals whose mean
/// lies below the format's grid, ties, and the specials.
#[test]
fn two_ranks_sum_and_mean_round_once() {
    fn check<T: Element>(cols: &[Vec<f32>]) {
        let cols: Vec<Vec<T>> = cols
            .iter()
            .map(|c| c.iter().map(|&x| T::from_f32(x)).collect())
            .collect();
        let len = cols[0].len();
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let scale = if op == ReduceOp::Avg { 0.5 } else { 1.0 };
            let want: Vec<u64> = (0..len)
                .map(|i| {
                    let mut s = ExactSum::new();
                    for c in &cols {
                        // exact: halving an f32, bf16 or f16 value in f64
                        s.add(c[i].to_f64() * scale);
                    }
                    s.round_to::<T>()
                })
                .collect::<Vec<T>>()
                .iter()
                .map(|x| x.to_f64().to_bits())
                .collect();
            let got = LocalCluster::run(2, |comm| {
                let opts = ReduceOptions::new(op)
                    .algorithm(Algorithm::Ring)
                    .reproducible(true);
                let mut b = cols[comm.rank()].clone();
                comm.all_reduce_with(&mut b, &opts)?;
                let r = shard_range(len, 2, comm.rank());
                let mut out = vec![T::ZERO; r.len()];
                comm.reduce_scatter_with(&cols[comm.rank()], &mut out, &opts)?;
                assert_eq!(bits(&out), bits(&b[r]), "{:?} {op:?}", T::DTYPE);
                Ok::<_, weft_collectives::Error>(b)
            })
            .unwrap();
            for b in got {
                let b = b.unwrap();
                for (i, (g, w)) in bits(&b).iter().zip(&want).enumerate() {
                    let nan = f64::from_bits(*w).is_nan();
                    assert!(
                        g == w || (nan && f64::from_bits(*g).is_nan()),
                        "{:?} {op:?} element {i}: {} against {}",
                        T::DTYPE,
                        f64::from_bits(*g),
                        f64::from_bits(*w)
                    );
                }
            }
        }
    }
    let mut cols = data(4242, 2, 700);
    let pairs: [(f32, f32); 12] = [
        (f32::MAX, f32::MAX),
        (-f32::MAX, -3e38),
        (6e4, 6e4),
        (3.3e38, 1e38),
        (f32::from_bits(1), 0.0),
        (f32::from_bits(3), f32::from_bits(2)),
        (1.0, f32::EPSILON / 2.0),
        (-0.0, -0.0),
        (-0.0, 0.0),
        (f32::INFINITY, 1.0),
        (f32::INFINITY, f32::NEG_INFINITY),
        (f32::NAN, 2.0),
    ];
    for (k, (x, y)) in pairs.into_iter().enumerate() {
        // in both ranks' halves
        for at in [3 * k, 350 + 3 * k] {
            cols[0][at] = x;
            cols[1][at] = y;
        }
    }
    check::<f32>(&cols);
    check::<bf16>(&cols);
    check::<weft_collectives::f16>(&cols);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn any_rank_order_gives_the_same_bits(
        n in 2usize..=6,
        len in 0usize..200,
        seed in any::<u64>(),
        rot in 0usize..6,
        alg in 0usize..2,
    ) {
        let cols = data(seed, n, len);
        let mut rotated = cols.clone();
        rotated.rotate_left(rot % n);
        rotated.swap(0, n - 1);
        let a = repro_all_reduce(&cols, ALGOS[alg], Topology::flat());
        let b = repro_all_reduce(&rotated, ALGOS[1 - alg], Topology::flat());
        prop_assert_eq!(bits(&a[0]), bits(&b[n - 1]));
        prop_assert_eq!(bits(&a[0]), bits(&exact(&cols)));
    }
}

#[test]
fn max_is_refused_in_reproducible_mode() {
    let out = LocalCluster::run(2, |comm| {
        let mut x = vec![1.0f32; 3];
        comm.all_reduce_with(
            &mut x,
            &ReduceOptions::new(ReduceOp::Max).reproducible(true),
        )
    })
    .unwrap();
    assert!(
        out[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("reproducible")
    );
}

/// Blocks of 64 values spanning at most `spread` binades below a base
/// exponent drawn from the whole f32 range (subnormals included): with
/// `spread` ≤ 27 every step of the ring takes the two-word fast paths.
fn narrow_blocks(seed: u64, k: usize, len: usize, spread: u32) -> Vec<Vec<f32>> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let bases: Vec<u32> = (0..len.div_ceil(64))
        .map(|_| (next() % 250) as u32 + 1)
        .collect();
    (0..k)
        .map(|_| {
            (0..len)
                .map(|i| {
                    let u = next();
                    let ex = bases[i / 64].saturating_sub((u >> 8) as u32 % (spread + 1));
                    let frac = (u >> 32) as u32 & 0x7f_ffff;
                    f32::from_bits((u32::from(u.is_multiple_of(2)) << 31) | (ex << 23) | frac)
                })
                .collect()
        })
        .collect()
}

#[test]
fn narrow_blocks_take_the_fast_paths_and_stay_exact() {
    for (n, spread) in [(2, 27), (3, 27), (4, 20), (5, 27), (3, 28), (4, 40)] {
        let cols = narrow_blocks(n as u64 * 1000 + u64::from(spread), n, 64 * 7 + 5, spread);
        let want = bits(&exact(&cols));
        for (r, got) in repro_all_reduce(&cols, Algorithm::Ring, Topology::flat())
            .iter()
            .enumerate()
        {
            assert_eq!(bits(got), want, "n={n} spread {spread} rank {r}");
        }
        // and the exact mean: the sum divided by n, rounded once
        let avg = LocalCluster::run(n, |comm| {
            let mut b = cols[comm.rank()].clone();
            let opts = ReduceOptions::new(ReduceOp::Avg)
                .algorithm(Algorithm::Ring)
                .reproducible(true);
            comm.all_reduce_with(&mut b, &opts)?;
            Ok::<_, weft_collectives::Error>(b)
        })
        .unwrap();
        let rd = LocalCluster::run(n, |comm| {
            let mut b = cols[comm.rank()].clone();
            let opts = ReduceOptions::new(ReduceOp::Avg)
                .algorithm(Algorithm::RecursiveDoubling)
                .reproducible(true);
            comm.all_reduce_with(&mut b, &opts)?;
            Ok::<_, weft_collectives::Error>(b)
        })
        .unwrap();
        assert_eq!(
            bits(avg[0].as_ref().unwrap()),
            bits(rd[n - 1].as_ref().unwrap())
        );
    }
}

/// The direct reduce-scatter (3 to 16 ranks in one domain) and the
/// fixed-lane ring (ranks in several domains, or more than 16): narrow
/// gradient-like blocks take i64 lanes; specials (±∞, NaN, −0.0,
/// subnormals, f32::MAX), blocks spanning wide ranges and ranks far above
/// or below the others fall back to the general encoding block by block;
/// every result is the exact sum (or mean) rounded once, the same bits as
/// recursive doubling.
#[test]
fn lane_paths_are_exact_with_specials_and_odd_lengths() {
    let specials = [
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -0.0,
        f32::from_bits(1),
        -f32::MIN_POSITIVE,
        f32::MAX,
        1e30,
        1e-30,
    ];
    for n in (3..=8usize).chain([17]) {
        let lens = if n > 8 {
            vec![3, 64 * n + 5]
        } else {
            vec![0, 1, 5, 64 * n + 3, 64 * 3 * n]
        };
        for len in lens {
            let mut cols = narrow_blocks(n as u64 * 7 + len as u64, n, len, 12);
            if len > 0 {
                // a special per rank at a different place; rank 1 a
                // thousand times larger in its second block
                for (r, c) in cols.iter_mut().enumerate() {
                    c[(r * 37 + 11) % len] = specials[(r + n) % specials.len()];
                }
                for x in cols[1].iter_mut().skip(64).take(64) {
                    *x *= 1024.0;
                }
            }
            let want = bits(&exact(&cols));
            // one domain: direct; a domain per rank: the fixed-lane ring
            for topo in [Topology::flat(), Topology::new(1)] {
                for (r, got) in repro_all_reduce(&cols, Algorithm::Ring, topo)
                    .iter()
                    .enumerate()
                {
                    assert_eq!(bits(got), want, "n={n} len={len} {topo:?} rank {r}");
                }
            }
            let mean = |alg: Algorithm| {
                LocalCluster::run(n, |comm| {
                    let mut b = cols[comm.rank()].clone();
                    let opts = ReduceOptions::new(ReduceOp::Avg)
                        .algorithm(alg)
                        .reproducible(true);
                    comm.all_reduce_with(&mut b, &opts)?;
                    Ok::<_, weft_collectives::Error>(bits(&b))
                })
                .unwrap()
                .into_iter()
                .map(|r| r.unwrap())
                .collect::<Vec<_>>()
            };
            let (ring, rd) = (mean(Algorithm::Ring), mean(Algorithm::RecursiveDoubling));
            assert!(ring.iter().all(|b| *b == rd[0]), "avg n={n} len={len}");
        }
    }
}

/// The drift meter on bf16 gradients on the wire: four ranks' gradient-like
/// values (99.9% small, mixed sign with a positive mean; 0.1% large), each
/// rank's rounded to bf16 and reduce-scattered in bf16 — plain (each hop
/// adds in f32 and rounds once to bf16) and reproducible (the exact sum,
/// rounded once) — against the exact sum of the f32 values. The signed
/// error relative to Σ|x| over 128 trials × 4096 elements: its mean (the
/// bias, what compounds over steps) must stay below 2% of its spread (what
/// averages out) on both paths. Measured (512 trials): plain −1.5e-5 with
/// spread 2.3e-3, reproducible −7.5e-6 with spread 1.7e-3 — under 1% of
/// the spread, yet detectable (9.5 and 6.5 standard errors): round to
/// nearest is unbiased only where the values' density is flat across a
/// bf16 step, and a sum of gradients with a positive mean is not. A
/// control, bf16 rounding toward zero, shows a bias as large as its spread.
#[test]
#[allow(clippy::print_stderr, clippy::needless_range_loop)]
fn bf16_gradients_on_the_wire_add_no_bias() {
    const N: usize = 4;
    const LEN: usize = 4096;
    const TRIALS: u64 = 128;
    // (mean, std, z) of the relative errors
    let stats = |e: &[f64]| {
        let n = e.len() as f64;
        let mean = e.iter().sum::<f64>() / n;
        let sd = (e.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        (mean, sd, mean.abs() / (sd / n.sqrt()))
    };
    let gradient_like = |seed: u64| -> Vec<Vec<f32>> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut u = move || (next() >> 11) as f64 / (1u64 << 53) as f64;
        (0..N)
            .map(|_| {
                (0..LEN)
                    .map(|_| {
                        let v = if u() < 1e-3 {
                            (0.5 + 1.5 * u()) * if u() < 0.5 { 1.0 } else { -1.0 }
                        } else {
                            -1e-3 + 4e-3 * u()
                        };
                        v as f32
                    })
                    .collect()
            })
            .collect()
    };
    let truncate = |x: f32| bf16::from_bits((x.to_bits() >> 16) as u16);
    let (mut plain, mut repro, mut control) = (Vec::new(), Vec::new(), Vec::new());
    for t in 0..TRIALS {
        let cols = gradient_like(t);
        let sums: Vec<Vec<Vec<bf16>>> = [false, true]
            .into_iter()
            .map(|reproducible| {
                LocalCluster::run(N, |comm| {
                    let x: Vec<bf16> = cols[comm.rank()]
                        .iter()
                        .map(|&v| bf16::from_f32(v))
                        .collect();
                    let mut out = vec![bf16::ZERO; shard_range(LEN, N, comm.rank()).len()];
                    let opts = ReduceOptions::new(ReduceOp::Sum)
                        .algorithm(Algorithm::Ring)
                        .reproducible(reproducible);
                    comm.reduce_scatter_with(&x, &mut out, &opts)?;
                    Ok::<_, weft_collectives::Error>(out)
                })
                .unwrap()
                .into_iter()
                .map(Result::unwrap)
                .collect()
            })
            .collect();
        for i in 0..LEN {
            let (exact, mag) = (0..N).fold((0.0f64, 0.0f64), |(s, m), r| {
                let v = f64::from(cols[r][i]);
                (s + v, m + v.abs())
            });
            let owner = (0..N)
                .find(|&r| shard_range(LEN, N, r).contains(&i))
                .unwrap();
            let at = i - shard_range(LEN, N, owner).start;
            plain.push((sums[0][owner][at].to_f64() - exact) / mag);
            repro.push((sums[1][owner][at].to_f64() - exact) / mag);
            // the control: each value and the sum truncated to bf16
            let t: f32 = (0..N).map(|r| truncate(cols[r][i]).to_f32()).sum();
            control.push((truncate(t).to_f64() - exact) / mag);
        }
    }
    for (name, e) in [
        ("plain", &plain),
        ("reproducible", &repro),
        ("truncating control", &control),
    ] {
        let (bias, spread, z) = stats(e);
        eprintln!(
            "bf16 wire, {name}: relative bias {bias:.2e}, spread {spread:.2e}, bias/se {z:.1}"
        );
    }
    let biased = |e: &[f64], share: f64| {
        let (bias, spread, _) = stats(e);
        bias.abs() > share * spread
    };
    assert!(
        !biased(&plain, 0.02),
        "plain bf16 wire: {:?}",
        stats(&plain)
    );
    assert!(
        !biased(&repro, 0.02),
        "reproducible bf16 wire: {:?}",
        stats(&repro)
    );
    assert!(
        biased(&control, 0.5),
        "the meter misses a biased rounding: {:?}",
        stats(&control)
    );
}

/// `reduce_scatter_add_exact` over `n` ranks holding `per` micro-batches
/// each (of the `n · per` columns of `cols`): every rank's shard of the
/// exact sum of all of them, rounded once.
fn add_exact_over(cols: &[Vec<f32>], n: usize) -> Vec<f32> {
    let per = cols.len() / n;
    let len = cols[0].len();
    let shards = LocalCluster::run(n, |comm| {
        let r = shard_range(len, n, comm.rank());
        let mut acc = weft_collectives::repro::ExactPartial::new(r.len());
        for col in &cols[comm.rank() * per..(comm.rank() + 1) * per] {
            comm.reduce_scatter_add_exact(col, &mut acc)?;
        }
        assert_eq!(acc.count(), cols.len() as u64);
        let mut out = vec![0f32; r.len()];
        acc.round_to(&mut out)?;
        Ok::<_, weft_collectives::Error>(out)
    })
    .unwrap();
    shards.into_iter().flat_map(|s| s.unwrap()).collect()
}

#[test]
fn reduce_scatter_add_exact_sums_every_rank_and_micro_batch_once() {
    // 12 contributions split over 1, 2, 3, 4 and 6 ranks, uneven shards
    let len = 1000 + 7;
    let cols = data(99, 12, len);
    let want = exact(&cols);
    for n in [1, 2, 3, 4, 6] {
        assert_eq!(bits(&add_exact_over(&cols, n)), bits(&want), "{n} ranks");
    }
}

#[test]
fn reduce_scatter_add_exact_refuses_a_wrong_accumulator_and_a_mixed_up_call() {
    let out = LocalCluster::run(2, |comm| {
        let x = vec![1.0f32; 8];
        let mut wrong = weft_collectives::repro::ExactPartial::new(3);
        assert!(comm.reduce_scatter_add_exact(&x, &mut wrong).is_err());
        // rank 0 adds, rank 1 runs the encoded reduce-scatter: a mismatch
        let mut acc = weft_collectives::repro::ExactPartial::new(4);
        acc.add(&[1.0f32; 4])?;
        if comm.rank() == 0 {
            comm.reduce_scatter_add_exact(&x, &mut acc).map(|_| ())
        } else {
            let whole = weft_collectives::repro::ExactPartial::new(8);
            let mut o = vec![0f32; 4];
            comm.reduce_scatter_exact(&whole, &mut o, ReduceOp::Sum)
        }
    })
    .unwrap();
    assert!(out.iter().all(Result::is_err), "{out:?}");
}

/// Repeated exact hierarchical all-reduces keep their scratch bounded:
/// the recursive-doubling rounds across domains once asked the buffer
/// pool for as much as their encoding's *capacity*, which `Vec::reserve`
/// then doubled, so each call's buffers grew the next call's request and
/// a few dozen calls of 1 MiB asked for tens of gigabytes. Forty calls of
/// 64 Ki elements over two domains of two ranks, each bitwise the exact
/// sum.
#[test]
fn repeated_hierarchical_exact_all_reduces_stay_bounded() {
    let cols = data(11, 4, 1 << 16);
    let want = bits(&exact(&cols));
    LocalCluster::builder(4)
        .topology(Topology::new(2))
        .run_each(|comm| {
            let opts = ReduceOptions::new(ReduceOp::Sum)
                .algorithm(Algorithm::Hierarchical)
                .reproducible(true);
            for _ in 0..40 {
                let mut b = cols[comm.rank()].clone();
                comm.all_reduce_with(&mut b, &opts)?;
                assert_eq!(bits(&b), want);
            }
            Ok::<_, weft_collectives::Error>(())
        })
        .into_iter()
        .for_each(|r| r.unwrap().unwrap());
}
