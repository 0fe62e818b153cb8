//! Learning-rate schedule: linear warmup, then cosine decay to a floor.

use crate::config::OptimConfig;

/// The learning rate of optimizer step `step` (0-based) of `total` steps.
///
/// * warmup (`step < warmup_steps`): `lr · (step + 1) / warmup_steps`, so the
///   first step already moves and the last warmup step reaches `lr`;
/// * then cosine decay from `lr` at the end of warmup to
///   `lr · min_lr_ratio` at the last step:
///   `min + ½·(1 + cos(π·p))·(lr − min)` with `p` going from 0 to 1.
///
/// ```
/// use weft_trainer::config::OptimConfig;
/// use weft_trainer::schedule::lr_at;
/// let o = OptimConfig { lr: 1.0, min_lr_ratio: 0.1, warmup_steps: 10, ..Default::default() };
/// assert_eq!(lr_at(&o, 4, 110), 0.5);
/// assert_eq!(lr_at(&o, 9, 110), 1.0);
/// assert!((lr_at(&o, 109, 110) - 0.1).abs() < 1e-12);
/// ```
pub fn lr_at(optim: &OptimConfig, step: u64, total: u64) -> f64 {
    let peak = optim.lr;
    let floor = peak * optim.min_lr_ratio;
    let warmup = optim.warmup_steps;
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let decay_steps = total.saturating_sub(warmup).saturating_sub(1);
    if decay_steps == 0 {
        return peak;
    }
    let p = ((step - warmup) as f64 / decay_steps as f64).min(1.0);
    floor + 0.5 * (1.0 + (std::f64::consts::PI * p).cos()) * (peak - floor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_is_linear_and_decay_monotone() {
        let o = OptimConfig {
            lr: 3e-3,
            min_lr_ratio: 0.1,
            warmup_steps: 50,
            ..Default::default()
        };
        for s in 0..50 {
            assert!((lr_at(&o, s, 600) - 3e-3 * (s + 1) as f64 / 50.0).abs() < 1e-15);
        }
        let mut prev = f64::INFINITY;
        for s in 50..600 {
            let lr = lr_at(&o, s, 600);
            assert!(lr <= prev && lr >= 3e-4 - 1e-15, "step {s}: {lr}");
            prev = lr;
        }
        // Halfway through the decay, the cosine is at its midpoint.
        let mid = 50 + 549 / 2;
        let expect = 3e-4
            + 0.5 * (1.0 + (std::f64::consts::PI * ((mid - 50) as f64 / 549.0)).cos()) * 2.7e-3;
        assert!((lr_at(&o, mid, 600) - expect).abs() < 1e-15);
        assert!((lr_at(&o, 599, 600) - 3e-4).abs() < 1e-15);
    }

    #[test]
    fn degenerate_schedules() {
        let o = OptimConfig {
            lr: 1.0,
            warmup_steps: 0,
            ..Default::default()
        };
        assert_eq!(lr_at(&o, 0, 1), 1.0);
        let o = OptimConfig {
            lr: 1.0,
            warmup_steps: 10,
            ..Default::default()
        };
        assert_eq!(
            lr_at(&o, 20, 5),
            1.0,
            "past the end of a run shorter than warmup"
        );
    }
}
