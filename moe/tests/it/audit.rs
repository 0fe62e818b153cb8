use weft_moe::{AuditOptions, DropPolicy, Gate, Router, audit, audit_suite};

use crate::Rng;

fn opts() -> AuditOptions {
    AuditOptions {
        trials: 150,
        batch: 4,
        seq_len: 16,
        logit_scale: 2.0,
        seed: 11,
    }
}

#[test]
fn token_choice_routers_have_no_violations() {
    let mut rng = Rng::new(5);
    let bias = rng.vec(8, 0.5);
    for (router, bias) in [
        (Router::top_k(8, 2), None),
        (Router::top_k(8, 2).with_normalize(true), None),
        (
            Router::top_k(8, 2)
                .with_gate(Gate::Sigmoid)
                .with_normalize(true),
            Some(bias.as_slice()),
        ),
        (
            Router::top_k(8, 2).with_capacity(1.0, DropPolicy::ByPosition),
            None,
        ),
    ] {
        let rep = audit(&router, bias, &opts()).unwrap();
        assert!(rep.causal_by_design);
        assert!(rep.is_clean(), "{rep}");
        assert_eq!(rep.results.iter().map(|r| r.trials).sum::<usize>(), 450);
    }
}

#[test]
fn expert_choice_and_drop_by_score_violate_causality() {
    for router in [
        Router::expert_choice(8, 2, 1.0),
        Router::top_k(8, 2).with_capacity(1.0, DropPolicy::ByScore),
    ] {
        let rep = audit(&router, None, &opts()).unwrap();
        assert!(!rep.causal_by_design);
        // Every kind of perturbation finds violations.
        for r in &rep.results {
            assert!(r.violations() > 0, "{rep}");
        }
        assert!(rep.violation_rate() > 0.05, "{rep}");
    }
}

#[test]
fn the_suite_agrees_with_the_design_claims() {
    let reps = audit_suite(
        8,
        2,
        &AuditOptions {
            trials: 40,
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(reps.len(), 6);
    for r in &reps {
        assert_eq!(r.causal_by_design, r.is_clean(), "{r}");
    }
}
