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
