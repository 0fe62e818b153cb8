//! What the layout tests check of a trained model on every layout: the
//! whole model gathered on rank 0, and the checkpoint parts each rank
//! writes (`#[path]`-included by the test crates that use it).

use weft_model::{OwnedPart, ParallelGpt, ParamLayout};

/// The whole model's `[parameters, m, v]` gathered on rank 0 (`root`;
/// zeros on the other ranks), and this rank's checkpoint parts.
pub fn gather(g: &ParallelGpt, root: bool) -> ([Vec<f32>; 3], Vec<OwnedPart>) {
    let len = g.whole_layout().len();
    let mut bufs = [vec![0.0f32; len], vec![0.0; len], vec![0.0; len]];
    {
        let [a, b, c] = &mut bufs;
        g.gather_whole(root.then_some([&mut a[..], &mut b[..], &mut c[..]]))
            .unwrap();
    }
    let (parts, _) = g.owned_parts().unwrap();
    (bufs, parts)
}

/// Every element of a sharded checkpoint written by exactly one rank
/// (`parts`: every rank's), with the values gathered on rank 0 (`bufs`).
pub fn check_parts<'a>(
    whole: &ParamLayout,
    bufs: &[Vec<f32>; 3],
    parts: impl IntoIterator<Item = &'a [OwnedPart]>,
    what: &str,
) {
    let mut written = vec![0u8; whole.len()];
    for part in parts.into_iter().flatten() {
        let spec = whole.get(&part.name).unwrap();
        assert_eq!(part.global_shape, spec.global_shape, "{what}");
        let at = spec.offset + part.whole;
        for (k, want) in bufs.iter().enumerate() {
            let got = &part.values[k];
            assert!(
                got.iter()
                    .zip(&want[at..at + got.len()])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: {} values",
                part.name
            );
        }
        for w in &mut written[at..at + part.values[0].len()] {
            *w += 1;
        }
    }
    if let Some(i) = written.iter().position(|&w| w != 1) {
        panic!("{what}: element {i} written {} times", written[i]);
    }
}

/// The relative L2 distance `‖a − b‖ / ‖b‖` of two parameter vectors.
pub fn params_difference(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        d += (f64::from(x) - f64::from(y)).powi(2);
        n += f64::from(y).powi(2);
    }
    (d / n.max(1e-300)).sqrt()
}

/// `|a − b| / |b|`.
pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}
