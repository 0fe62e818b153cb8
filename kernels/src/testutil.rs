//! Test helpers: deterministic random data and a finite-difference
//! gradient checker in f64.

/// `n` values in [-1, 1) from a fixed-seed xorshift generator.
pub(crate) fn rand_vec(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            #[allow(clippy::cast_precision_loss)]
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            2.0 * u - 1.0
        })
        .collect()
}

/// Checks `backward` against central finite differences of
/// `L = Σ out ⊙ r` (r random), perturbing every element of every input.
///
/// Gradient buffers start from random values, so a backward that
/// overwrites instead of accumulating (`+=`) fails. Returns the largest
/// absolute difference found.
pub(crate) fn check_grads(
    inputs: &[Vec<f64>],
    out_len: usize,
    forward: impl Fn(&[Vec<f64>], &mut [f64]),
    backward: impl Fn(&[Vec<f64>], &[f64], &mut [Vec<f64>]),
) -> f64 {
    let r = rand_vec(out_len, 99);
    let loss = |ins: &[Vec<f64>]| {
        let mut out = vec![0.0; out_len];
        forward(ins, &mut out);
        out.iter().zip(&r).map(|(a, b)| a * b).sum::<f64>()
    };
    let start: Vec<Vec<f64>> = inputs
        .iter()
        .enumerate()
        .map(|(i, x)| rand_vec(x.len(), 1000 + i as u64))
        .collect();
    let mut grads = start.clone();
    backward(inputs, &r, &mut grads);
    let h = 1e-5;
    let mut worst = 0.0f64;
    let mut ins = inputs.to_vec();
    for (k, x) in inputs.iter().enumerate() {
        for j in 0..x.len() {
            ins[k][j] = x[j] + h;
            let lp = loss(&ins);
            ins[k][j] = x[j] - h;
            let lm = loss(&ins);
            ins[k][j] = x[j];
            let fd = (lp - lm) / (2.0 * h);
            let an = grads[k][j] - start[k][j];
            let err = (fd - an).abs();
            assert!(
                err <= 1e-6 * fd.abs().max(1.0),
                "input {k} element {j}: analytic {an} vs finite difference {fd}"
            );
            worst = worst.max(err);
        }
    }
    worst
}
