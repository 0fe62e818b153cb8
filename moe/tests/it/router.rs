use weft_moe::{DROPPED, DropPolicy, Gate, Router};

use crate::Rng;

fn softmax(l: &[f64]) -> Vec<f64> {
    let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = l.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

#[test]
fn softmax_top_k_gates_follow_the_formula() {
    let logits = [0.3, -1.0, 2.0, 0.5, 1.5];
    let p = softmax(&logits);
    let r = Router::top_k(5, 2).route(&logits, &[1], None).unwrap();
    assert_eq!(r.chosen, vec![2, 4]);
    assert!((r.gate[0] - p[2]).abs() < 1e-15 && (r.gate[1] - p[4]).abs() < 1e-15);
    let rn = Router::top_k(5, 2)
        .with_normalize(true)
        .route(&logits, &[1], None)
        .unwrap();
    // Normalised softmax over the top k equals the softmax of their logits.
    let sub = softmax(&[2.0, 1.5]);
    assert!((rn.gate[0] - sub[0]).abs() < 1e-15 && (rn.gate[1] - sub[1]).abs() < 1e-15);
}

#[test]
fn sigmoid_bias_changes_selection_not_gates() {
    let logits = [1.0, 0.9, -2.0, 0.0];
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    let router = Router::top_k(4, 1).with_gate(Gate::Sigmoid);
    let r = router.route(&logits, &[1], None).unwrap();
    assert_eq!((r.chosen[0], r.gate[0]), (0, sig(1.0)));
    // A bias large enough to favour expert 2 selects it; its gate is still
    // the unbiased sigmoid(-2).
    let bias = [0.0, 0.0, 0.95, 0.0];
    let r = router.route(&logits, &[1], Some(&bias)).unwrap();
    assert_eq!(r.chosen[0], 2);
    assert!((r.gate[0] - sig(-2.0)).abs() < 1e-15);
}

#[test]
fn capacity_by_position_respects_prefix_capacities() {
    let mut rng = Rng::new(1);
    let (e, k, t, b) = (4, 2, 24, 3);
    // Skewed logits so experts overflow.
    let mut logits = rng.vec(b * t * e, 1.0);
    for row in logits.chunks_exact_mut(e) {
        row[0] += 2.0;
    }
    let router = Router::top_k(e, k).with_capacity(1.0, DropPolicy::ByPosition);
    let r = router.route(&logits, &[t; 3], None).unwrap();
    assert!(r.dropped > 0);
    let mut dropped = 0;
    for s in 0..b {
        let mut count = vec![0usize; e];
        for pos in 0..t {
            for i in 0..k {
                let slot = (s * t + pos) * k + i;
                if r.kept[slot] {
                    count[r.chosen[slot] as usize] += 1;
                } else {
                    dropped += 1;
                }
            }
            let cap = (k * (pos + 1)).div_ceil(e);
            assert!(
                count.iter().all(|&c| c <= cap),
                "{count:?} > {cap} at {pos}"
            );
        }
    }
    assert_eq!(dropped, r.dropped);
    let load: u64 = r.load().iter().sum();
    assert_eq!(load as usize + r.dropped, b * t * k);
}

#[test]
fn capacity_by_score_keeps_the_highest_scores() {
    let mut rng = Rng::new(2);
    let (e, k, n) = (4, 1, 40);
    let mut logits = rng.vec(n * e, 1.0);
    for row in logits.chunks_exact_mut(e) {
        row[1] += 1.5;
    }
    let r = Router::top_k(e, k)
        .with_capacity(1.0, DropPolicy::ByScore)
        .route(&logits, &[n], None)
        .unwrap();
    let cap = (k * n).div_ceil(e);
    for (j, &l) in r.load().iter().enumerate() {
        assert!(l as usize <= cap);
        // Every dropped assignment of j scores at most the lowest kept one.
        let kept_min = (0..n)
            .filter(|&t| r.chosen[t] == j as u32 && r.kept[t])
            .map(|t| r.scores[t * e + j])
            .fold(f64::INFINITY, f64::min);
        for t in (0..n).filter(|&t| r.chosen[t] == j as u32 && !r.kept[t]) {
            assert!(r.scores[t * e + j] <= kept_min);
        }
    }
    assert!(r.dropped > 0);
}

#[test]
fn expert_choice_gives_each_expert_its_capacity() {
    let mut rng = Rng::new(3);
    let (e, k, n) = (4, 2, 30);
    let logits = rng.vec(n * e, 1.0);
    let r = Router::expert_choice(e, k, 1.0)
        .route(&logits, &[10, 20], None)
        .unwrap();
    let cap = (k * n).div_ceil(e) as u64;
    assert_eq!(r.load(), vec![cap; e]);
    for t in 0..n {
        for j in 0..e {
            let slot = t * e + j;
            assert!(r.chosen[slot] == DROPPED || r.chosen[slot] == j as u32);
        }
    }
}

#[test]
fn invalid_configs_are_named() {
    let err = Router::top_k(4, 5)
        .route(&[0.0f64; 4], &[1], None)
        .unwrap_err();
    assert!(err.to_string().contains("top_k"), "{err}");
    let err = Router::top_k(4, 1)
        .route(&[0.0f64; 3], &[1], None)
        .unwrap_err();
    assert!(err.to_string().contains("logits"), "{err}");
    let err = Router::top_k(4, 1)
        .with_capacity(0.0, DropPolicy::ByScore)
        .validate()
        .unwrap_err();
    assert!(err.to_string().contains("capacity_factor"), "{err}");
}
