//! `ExactSum` against an independent oracle (arbitrary-precision integers
//! from `num-bigint`), and its order- and partition-independence.

use num_bigint::BigInt;
use num_traits::{Signed, Zero};
use proptest::prelude::*;
use weft_numerics::{ExactSum, bf16, f16};

/// `x · 2^1074` as an exact integer (every finite f64 is a multiple of
/// 2^-1074).
fn scaled(x: f64) -> BigInt {
    assert!(x.is_finite());
    let b = x.to_bits();
    let e = ((b >> 52) & 0x7ff) as i64;
    let frac = b & 0x000f_ffff_ffff_ffff;
    let m = if e == 0 { frac } else { frac | (1 << 52) };
    let v = BigInt::from(m) << (e.max(1) - 1) as usize;
    if x.is_sign_negative() { -v } else { v }
}

fn oracle_sum(xs: &[f64]) -> BigInt {
    xs.iter()
        .map(|&x| scaled(x))
        .fold(BigInt::zero(), |a, b| a + b)
}

/// Checks that `r` is `s · 2^-1074` rounded to nearest-even among the values
/// of a format whose neighbours of `r` are `down` and `up` (both given as
/// f64, infinite when there is none) and whose overflow threshold (max
/// finite plus half an ulp, scaled by 2^1074) is `overflow`; at the
/// threshold itself the tie goes to infinity (the max's significand is odd).
fn check_rounding(
    s: &BigInt,
    r: f64,
    down: f64,
    up: f64,
    mantissa_odd: bool,
    overflow: &BigInt,
    ctx: &str,
) {
    if r.is_infinite() {
        let t = overflow.clone();
        if r > 0.0 {
            assert!(*s >= t, "{ctx}: rounded to +inf below the threshold");
        } else {
            assert!(*s <= -t, "{ctx}: rounded to -inf above the threshold");
        }
        return;
    }
    let d = (s - scaled(r)).abs();
    for n in [down, up] {
        if n.is_finite() {
            let dn = (s - scaled(n)).abs();
            assert!(
                d <= dn,
                "{ctx}: {r:e} is farther from the exact sum than {n:e}"
            );
            if d == dn && !d.is_zero() {
                assert!(!mantissa_odd, "{ctx}: tie rounded to an odd significand");
            }
        } else {
            // The neighbour beyond the largest finite value is the overflow
            // threshold's other side: the exact value must not reach it.
            assert!(s.abs() < *overflow, "{ctx}: should have overflowed");
        }
    }
}

fn check_f64(xs: &[f64]) {
    let mut acc = ExactSum::new();
    acc.add_slice(xs);
    let s = oracle_sum(xs);
    let r = acc.to_f64();
    let f64_overflow = scaled(f64::MAX) + scaled(2f64.powi(970));
    check_rounding(
        &s,
        r,
        r.next_down(),
        r.next_up(),
        r.to_bits() & 1 == 1,
        &f64_overflow,
        "f64",
    );
    let r32 = acc.to_f32();
    let f32_overflow = scaled(f64::from(f32::MAX) + 2f64.powi(103));
    check_rounding(
        &s,
        f64::from(r32),
        f64::from(r32.next_down()),
        f64::from(r32.next_up()),
        r32.to_bits() & 1 == 1,
        &f32_overflow,
        "f32",
    );
}

/// Finite f64 values from raw bits: every exponent, subnormals included.
fn any_finite_f64() -> impl Strategy<Value = f64> {
    any::<u64>()
        .prop_map(f64::from_bits)
        .prop_filter("finite", |x| x.is_finite())
}

/// f64 values of moderate, clustered magnitude, signs mixed.
fn clustered_f64() -> impl Strategy<Value = f64> {
    (any::<u64>(), -60i32..60).prop_map(|(b, e)| {
        let m = f64::from_bits((b >> 12) | 0x3ff0_0000_0000_0000);
        let v = m * 2f64.powi(e);
        if b & 1 == 1 { -v } else { v }
    })
}

/// Values followed by the negation of most of them plus a few tiny ones:
/// catastrophic cancellation, where the true sum is far below the inputs.
fn cancelling() -> impl Strategy<Value = Vec<f64>> {
    (
        prop::collection::vec(clustered_f64(), 1..60),
        prop::collection::vec(
            any::<u64>().prop_map(|b| f64::from_bits(b & 0x000f_ffff_ffff_ffff)),
            0..4,
        ),
    )
        .prop_map(|(xs, tiny)| {
            let mut v = xs.clone();
            v.extend(xs.iter().skip(1).map(|x| -x));
            v.extend(tiny);
            v
        })
}

/// Sums that land exactly on a rounding tie of f64 or of f32 (or just off
/// it, by a tiny amount of either sign), split over several addends.
fn ties() -> impl Strategy<Value = Vec<f64>> {
    (
        clustered_f64(),
        any::<bool>(),
        0u8..3,
        any::<bool>(),
        -3i32..3,
    )
        .prop_map(|(x, f32_tie, nudge, neg, k)| {
            let half_ulp = if f32_tie {
                let y = x as f32;
                f64::from(y.next_up() - y) / 2.0
            } else {
                (x.next_up() - x) / 2.0
            };
            let base = if f32_tie { f64::from(x as f32) } else { x };
            let h = if neg { -half_ulp } else { half_ulp };
            // The half ulp arrives in two pieces, with a large cancelling pair.
            let big = base * 2f64.powi(k + 30);
            let mut v = vec![base, h / 2.0, big, h / 2.0, -big];
            match nudge {
                1 => v.push(2f64.powi(-1000)),
                2 => v.push(-(2f64.powi(-1000))),
                _ => {}
            }
            v
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn matches_oracle_at_ties(xs in ties()) {
        check_f64(&xs);
    }

    #[test]
    fn matches_oracle_full_range(xs in prop::collection::vec(any_finite_f64(), 0..40)) {
        check_f64(&xs);
    }

    #[test]
    fn matches_oracle_clustered(xs in prop::collection::vec(clustered_f64(), 0..300)) {
        check_f64(&xs);
    }

    #[test]
    fn matches_oracle_cancellation(xs in cancelling()) {
        check_f64(&xs);
    }

    #[test]
    fn matches_oracle_f32_inputs(bits in prop::collection::vec(any::<u32>(), 0..300)) {
        let xs: Vec<f32> = bits.into_iter().map(f32::from_bits).filter(|x| x.is_finite()).collect();
        let mut a = ExactSum::new();
        a.add_slice(&xs);
        let wide: Vec<f64> = xs.iter().map(|&x| f64::from(x)).collect();
        let mut b = ExactSum::new();
        b.add_slice(&wide);
        // Both exact, by two different code paths.
        prop_assert_eq!(&a, &b);
        check_f64(&wide);
    }

    #[test]
    fn sixteen_bit_inputs_are_exact(bits in prop::collection::vec(any::<u16>(), 0..300)) {
        let h: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b)).filter(|x| x.is_finite()).collect();
        let b16: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits(b)).filter(|x| x.is_finite()).collect();
        for wide in [
            h.iter().map(|x| x.to_f64()).collect::<Vec<_>>(),
            b16.iter().map(|x| x.to_f64()).collect::<Vec<_>>(),
        ] {
            check_f64(&wide);
        }
        let mut a = ExactSum::new();
        a.add_slice(&h);
        let mut b = ExactSum::new();
        b.add_slice(&h.iter().map(|x| x.to_f64()).collect::<Vec<_>>());
        prop_assert_eq!(a, b);
    }

    /// Any permutation, any partition into pieces summed separately and
    /// merged in any order: bitwise the same accumulator and result.
    #[test]
    fn order_and_partition_independent(
        (xs, perm) in prop::collection::vec(any::<u32>().prop_map(f32::from_bits), 0..200)
            .prop_flat_map(|xs| { let n = xs.len(); (Just(xs), Just((0..n).collect::<Vec<_>>()).prop_shuffle()) }),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
        merge_order in any::<u64>(),
    ) {
        let mut whole = ExactSum::new();
        whole.add_slice(&xs);
        let shuffled: Vec<f32> = perm.iter().map(|&i| xs[i]).collect();
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c.index(shuffled.len() + 1)).collect();
        bounds.push(0);
        bounds.push(shuffled.len());
        bounds.sort_unstable();
        let mut parts: Vec<ExactSum> = bounds.windows(2).map(|w| {
            let mut p = ExactSum::new();
            p.add_slice(&shuffled[w[0]..w[1]]);
            p
        }).collect();
        // Merge in a pseudo-random tree order.
        let mut state = merge_order | 1;
        while parts.len() > 1 {
            state ^= state << 13; state ^= state >> 7; state ^= state << 17;
            let i = (state % parts.len() as u64) as usize;
            let p = parts.swap_remove(i);
            let j = (state / 7 % parts.len() as u64) as usize;
            parts[j].merge(&p);
        }
        let merged = parts.pop().unwrap_or_default();
        prop_assert_eq!(&merged, &whole);
        prop_assert_eq!(merged.to_f32().to_bits(), whole.to_f32().to_bits());
        prop_assert_eq!(merged.to_f64().to_bits(), whole.to_f64().to_bits());
        let bytes = merged.to_bytes();
        prop_assert_eq!(ExactSum::from_bytes(&bytes).unwrap(), whole);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Long inputs cross the 4096-element chunks of the fast path.
    #[test]
    fn long_inputs_match_oracle_and_any_split(
        xs in prop::collection::vec(clustered_f64(), 4000..12000),
        tiny_every in 50usize..500,
        split in any::<prop::sample::Index>(),
    ) {
        let mut xs = xs;
        for i in (0..xs.len()).step_by(tiny_every) {
            xs[i] *= 2f64.powi(-900); // forces several exponent windows
        }
        check_f64(&xs);
        let k = split.index(xs.len());
        let mut a = ExactSum::new();
        a.add_slice(&xs[..k]);
        let mut b = ExactSum::new();
        b.add_slice(&xs[k..]);
        b.merge(&a);
        let mut whole = ExactSum::new();
        whole.add_slice(&xs);
        prop_assert_eq!(b, whole);
        let f: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
        let mut c = ExactSum::new();
        c.add_slice(&f);
        let fw: Vec<f64> = f.iter().map(|&x| f64::from(x)).collect();
        check_f64(&fw);
        let mut d = ExactSum::new();
        for &x in &f { d.add(x); }
        prop_assert_eq!(c, d);
    }
}

#[test]
fn decoding_garbage_never_panics() {
    let mut s = 1u64;
    for len in 0..400 {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect();
        let _ = ExactSum::from_bytes(&bytes);
        let mut framed = b"WXS1".to_vec();
        framed.extend_from_slice(&bytes);
        if let Ok(v) = ExactSum::from_bytes(&framed) {
            let _ = v.to_f64();
        }
    }
}
