use weft_moe::{AuxLoss, AuxScope, BiasBalancer, Gate, LoadStats, Router};

use crate::Rng;

#[test]
fn aux_loss_is_coef_at_balance_and_coef_times_e_at_collapse() {
    let (e, n) = (4, 8);
    // Equal probabilities, tokens spread evenly over experts by a tiny
    // logit nudge: f_e = 1/E, P_e ~ 1/E, L ~ α.
    let mut logits = vec![0.0f64; n * e];
    for t in 0..n {
        logits[t * e + t % e] = 1e-9;
    }
    let r = Router::top_k(e, 1).route(&logits, &[n], None).unwrap();
    let l = AuxLoss::new(0.01).forward(&r, &[n]).unwrap();
    assert!((l - 0.01).abs() < 1e-9, "{l}");
    // Everything on expert 0 with probability ~1: L ~ α E.
    let mut logits = vec![0.0f64; n * e];
    for t in 0..n {
        logits[t * e] = 50.0;
    }
    let r = Router::top_k(e, 1).route(&logits, &[n], None).unwrap();
    let l = AuxLoss::new(0.01).forward(&r, &[n]).unwrap();
    assert!((l - 0.04).abs() < 1e-9, "{l}");
}

#[test]
fn aux_loss_matches_the_switch_formula_and_its_gradient_finite_differences() {
    let mut rng = Rng::new(7);
    let (e, k) = (6, 2);
    let lens = [5, 7];
    let n = 12;
    for gate in [Gate::Softmax, Gate::Sigmoid] {
        for scope in [AuxScope::Batch, AuxScope::Sequence] {
            let router = Router::top_k(e, k).with_gate(gate);
            let aux = AuxLoss { coef: 0.3, scope };
            let logits = rng.vec(n * e, 2.0);
            let r = router.route(&logits, &lens, None).unwrap();
            // Direct formula.
            let groups: Vec<(usize, usize)> = match scope {
                AuxScope::Batch => vec![(0, n)],
                _ => vec![(0, 5), (5, 7)],
            };
            let mut want = 0.0;
            for &(s, len) in &groups {
                let mut f = vec![0.0; e];
                let mut p = vec![0.0; e];
                for t in s..s + len {
                    for i in 0..k {
                        f[r.chosen[t * k + i] as usize] += 1.0 / (k * len) as f64;
                    }
                    let row = &r.scores[t * e..(t + 1) * e];
                    let tot: f64 = row.iter().sum();
                    for j in 0..e {
                        p[j] += row[j] / tot / len as f64;
                    }
                }
                want += 0.3 * e as f64 * (0..e).map(|j| f[j] * p[j]).sum::<f64>();
            }
            want /= groups.len() as f64;
            let got = aux.forward(&r, &lens).unwrap();
            assert!((got - want).abs() < 1e-14, "{got} vs {want}");
            // Gradient against central differences (f held fixed: the
            // selection does not change for a tiny step).
            let mut dl = vec![0.0; n * e];
            aux.backward(&mut dl, &r, &lens).unwrap();
            let h = 1e-6;
            for i in 0..n * e {
                let mut lp = logits.clone();
                lp[i] += h;
                let mut lm = logits.clone();
                lm[i] -= h;
                let rp = router.route(&lp, &lens, None).unwrap();
                let rm = router.route(&lm, &lens, None).unwrap();
                assert_eq!(rp.chosen, r.chosen);
                assert_eq!(rm.chosen, r.chosen);
                let fd = (aux.forward(&rp, &lens).unwrap() - aux.forward(&rm, &lens).unwrap())
                    / (2.0 * h);
                assert!(
                    (fd - dl[i]).abs() < 1e-8,
                    "{gate:?} {scope:?} {i}: {fd} vs {}",
                    dl[i]
                );
            }
        }
    }
}

#[test]
fn bias_update_follows_the_sign_rule() {
    let mut bias = vec![0.0f32; 4];
    BiasBalancer::new(0.1)
        .update(&mut bias, &[10, 2, 4, 4])
        .unwrap();
    assert_eq!(bias, vec![-0.1, 0.1, 0.1, 0.1]);
    BiasBalancer::new(0.1)
        .update(&mut bias, &[5, 5, 5, 5])
        .unwrap();
    assert_eq!(bias, vec![-0.1, 0.1, 0.1, 0.1]);
    assert!(BiasBalancer::new(0.1).update(&mut bias, &[1]).is_err());
}

/// DeepSeek-V3's claim, on a skewed router: bias balancing drives MaxVio
/// down while the gate weights stay the unbiased scores.
#[test]
fn bias_balancing_reduces_max_vio_on_skewed_routers() {
    let mut rng = Rng::new(9);
    let (e, k, n) = (8, 2, 512);
    let skew: Vec<f64> = (0..e).map(|j| 0.4 * j as f64).collect();
    let router = Router::top_k(e, k)
        .with_gate(Gate::Sigmoid)
        .with_normalize(true);
    let bal = BiasBalancer::new(0.01);
    let mut bias = vec![0.0f64; e];
    let mut first = None;
    let mut last = LoadStats::default();
    let mut tail = 0.0;
    for step in 0..300 {
        let mut logits = rng.vec(n * e, 1.0);
        for row in logits.chunks_exact_mut(e) {
            for (x, s) in row.iter_mut().zip(&skew) {
                *x += s;
            }
        }
        let r = router.route(&logits, &[n], Some(&bias)).unwrap();
        last = LoadStats::from_routing(&r);
        first.get_or_insert(last.max_vio().unwrap());
        if step >= 250 {
            tail += last.max_vio().unwrap() / 50.0;
        }
        bal.update(&mut bias, &last.tokens_per_expert).unwrap();
    }
    let first = first.unwrap();
    assert!(first > 2.0, "{first}");
    // Without balancing MaxVio stays at `first` (the skew is fixed); with
    // it the last 50 steps average under a sixth of that.
    assert!(tail < first / 6.0, "MaxVio {first} -> {tail}");
    assert!(last.entropy() > 0.0 && last.entropy() <= (e as f64).ln());
}

#[test]
fn load_statistics() {
    let s = LoadStats {
        tokens_per_expert: vec![6, 2, 0, 4],
        dropped: 3,
        tokens: 6,
        entropy_sum: 3.0,
    };
    assert_eq!(s.mean_load(), 3.0);
    assert_eq!(s.max_over_mean(), Some(2.0));
    assert_eq!(s.max_vio(), Some(1.0));
    assert_eq!(s.entropy(), 0.5);
    let rec = s.to_record(7, 2);
    assert_eq!(rec.max_over_mean(), s.max_over_mean());
    assert_eq!((rec.step, rec.layer, rec.dropped), (7, 2, 3));
    let mut m = LoadStats::default();
    m.merge(&s);
    m.merge(&s);
    assert_eq!(m.tokens_per_expert, vec![12, 4, 0, 8]);
    assert_eq!(m.max_vio(), Some(1.0));
}

/// Router entropy against hand-computed values: the mean over tokens of
/// `−Σ_e q_e ln q_e`, with `q` the softmax (or the sigmoid scores
/// normalised over experts), ignoring the selection bias.
#[test]
fn router_entropy_matches_hand_computed_values() {
    let ln = f64::ln;
    // Softmax: [ln 2, 0, 0] gives q = (1/2, 1/4, 1/4), entropy
    // ½ln2 + 2·¼ln4 = 1.5 ln 2; [0, 0, 0] is uniform, ln 3.
    let logits = [ln(2.0), 0.0, 0.0, 0.0, 0.0, 0.0];
    let want = (1.5 * ln(2.0) + ln(3.0)) / 2.0;
    let r = Router::top_k(3, 1).route(&logits, &[2], None).unwrap();
    let s = LoadStats::from_routing(&r);
    assert_eq!(s.tokens, 2);
    assert!(
        (s.entropy() - want).abs() < 1e-15,
        "{} vs {want}",
        s.entropy()
    );
    // The selection bias changes the choice, not the router's distribution.
    let biased = Router::top_k(3, 1)
        .route(&logits, &[2], Some(&[0.0, 0.0, 5.0]))
        .unwrap();
    assert_ne!(biased.chosen, r.chosen);
    assert_eq!(LoadStats::from_routing(&biased).entropy_sum, s.entropy_sum);
    // Sigmoid: [ln 3, −ln 3, 0] gives scores (3/4, 1/4, 1/2), normalised
    // q = (1/2, 1/6, 1/3): entropy ½ln2 + ⅙ln6 + ⅓ln3.
    let sig = Router::top_k(3, 2).with_gate(Gate::Sigmoid);
    let r = sig.route(&[ln(3.0), -ln(3.0), 0.0], &[1], None).unwrap();
    let want_sig = 0.5 * ln(2.0) + ln(6.0) / 6.0 + ln(3.0) / 3.0;
    let s_sig = LoadStats::from_routing(&r);
    assert!((s_sig.entropy() - want_sig).abs() < 1e-15);
    // Merging keeps sum and count: the mean over all three tokens.
    let mut m = s.clone();
    m.merge(&s_sig);
    assert_eq!(m.tokens, 3);
    let want_all = (1.5 * ln(2.0) + ln(3.0) + want_sig) / 3.0;
    assert!((m.entropy() - want_all).abs() < 1e-15);
    // The expert_load.jsonl line carries it; an empty layer has none.
    assert_eq!(m.to_record(4, 1).router_entropy, Some(m.entropy()));
    assert_eq!(LoadStats::default().to_record(4, 1).router_entropy, None);
    // f32 routing agrees to f32 precision.
    let l32: Vec<f32> = logits.iter().map(|&x| x as f32).collect();
    let r32 = Router::top_k(3, 1).route(&l32, &[2], None).unwrap();
    assert!((LoadStats::from_routing(&r32).entropy() - want).abs() < 1e-6);
}

/// Statistics summed over ranks: every rank ends with the global load.
#[test]
fn load_stats_all_reduce_over_ranks() {
    let per_rank = |r: usize| LoadStats {
        tokens_per_expert: vec![r as u64, 2 * r as u64 + 1, 7],
        dropped: r as u64,
        tokens: 5,
        entropy_sum: 0.5 + r as f64,
    };
    let mut want = LoadStats::default();
    for r in 0..3 {
        want.merge(&per_rank(r));
    }
    let got = weft_collectives::LocalCluster::run(3, |comm| {
        let mut s = per_rank(weft_collectives::Communicator::rank(&comm));
        s.all_reduce(&comm).unwrap();
        s
    })
    .unwrap();
    for s in got {
        assert_eq!(s, want);
    }
}
