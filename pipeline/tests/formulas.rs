//! Simulated bubbles against the papers' formulas (GPipe: Huang et al.
//! 2019; 1F1B and interleaved: Narayanan et al. 2021; ZB-H1/ZB-H2: Qi et
//! al. 2024, Table 2), and property tests that every generated schedule
//! validates.

use proptest::prelude::*;
use weft_pipeline::{
    Costs, Schedule, ScheduleKind, simulate, steady_state_period, validate, validate_with_limit,
};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * (1.0 + a.abs().max(b.abs()))
}

fn unit(s: &Schedule) -> Costs {
    Costs::per_stage(s, 1.0, 1.0, 1.0, 0.0)
}

#[test]
fn gpipe_and_1f1b_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1() {
    for p in 1..=8usize {
        for m in [1usize, 2, 3, 5, 8, 13, 32] {
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let s = kind.generate(p, m, 1).unwrap();
                // Unit costs, and also an unequal F : BW ratio (1 : 2).
                for c in [
                    unit(&s),
                    Costs::per_stage(&s, 1.0, 1.0, 0.0, 0.0),
                    Costs::per_stage(&s, 1.0, 1.5, 0.5, 0.0),
                ] {
                    let t = simulate(&s, &c).unwrap();
                    let want = (p as f64 - 1.0) / (m as f64 + p as f64 - 1.0);
                    assert!(
                        close(t.bubble_fraction(), want),
                        "{kind} p={p} m={m}: {} vs {want}",
                        t.bubble_fraction()
                    );
                }
            }
        }
    }
}

#[test]
fn memory_of_gpipe_and_1f1b_is_as_documented() {
    let (p, m) = (4, 8);
    assert_eq!(
        ScheduleKind::GPipe
            .generate(p, m, 1)
            .unwrap()
            .peak_in_flight(),
        vec![8; 4]
    );
    assert_eq!(
        ScheduleKind::OneFOneB
            .generate(p, m, 1)
            .unwrap()
            .peak_in_flight(),
        vec![4, 3, 2, 1]
    );
    let s = ScheduleKind::OneFOneB.generate(p, m, 1).unwrap();
    assert_eq!(
        simulate(&s, &unit(&s)).unwrap().peak_memory(),
        vec![4.0, 3.0, 2.0, 1.0]
    );
}

#[test]
fn interleaving_divides_the_bubble_time_by_v() {
    for p in [2usize, 4, 8] {
        for v in [1usize, 2, 3, 4] {
            for groups in [1usize, 2, 4] {
                let m = p * groups;
                let s = ScheduleKind::Interleaved.generate(p, m, v).unwrap();
                let t = simulate(&s, &unit(&s)).unwrap();
                // Per-stage idle time: (p-1)/v of one stage's F+B+W.
                let idle = t.idle(0);
                assert!(
                    close(idle, 3.0 * (p as f64 - 1.0) / v as f64),
                    "p={p} v={v} m={m}: idle {idle}"
                );
                let want = (p as f64 - 1.0) / (v as f64 * m as f64 + p as f64 - 1.0);
                assert!(close(t.bubble_fraction(), want), "p={p} v={v} m={m}");
            }
        }
    }
}

#[test]
fn zb_h1_bubble_is_a_third_of_1f1b_at_the_same_memory() {
    for p in 2..=8usize {
        for m in [p, 2 * p, 3 * p + 1, 32] {
            let one = ScheduleKind::OneFOneB.generate(p, m, 1).unwrap();
            let zb = ScheduleKind::ZbH1.generate(p, m, 1).unwrap();
            let t1 = simulate(&one, &unit(&one)).unwrap();
            let tz = simulate(&zb, &unit(&zb)).unwrap();
            // Qi et al. Table 2: 1F1B idles (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W).
            assert!(close(t1.idle(0), 3.0 * (p as f64 - 1.0)));
            for st in 0..p {
                assert!(
                    close(tz.idle(st), p as f64 - 1.0),
                    "p={p} m={m} stage {st}: {}",
                    tz.idle(st)
                );
            }
            assert!(tz.bubble_fraction() < t1.bubble_fraction());
            let expected = ScheduleKind::ZbH1
                .expected_bubble(p, m, 1, 1.0, 1.0, 1.0)
                .unwrap();
            assert!(close(tz.bubble_fraction(), expected));
            // Same peak memory as 1F1B: at most p micro-batches anywhere.
            assert_eq!(*zb.peak_in_flight().iter().max().unwrap(), p);
            assert_eq!(zb.peak_in_flight()[0], one.peak_in_flight()[0]);
        }
    }
}

#[test]
fn zb_h2_reaches_zero_bubble_at_2p_minus_1_memory() {
    for p in 2..=8usize {
        for m in [2 * p, 32] {
            let s = ScheduleKind::ZbH2.generate(p, m, 1).unwrap();
            let c = unit(&s);
            let t = simulate(&s, &c).unwrap();
            let period = steady_state_period(&s, &c).unwrap();
            // Back to back (the paper's post-validation), each stage is busy
            // the whole period: zero bubble.
            assert!(
                close(period, 3.0 * m as f64),
                "p={p} m={m}: period {period}"
            );
            assert!(t.bubble_fraction_at_period(period).abs() < 1e-12);
            // Memory: (2p-1) micro-batches on stage 0, as the paper states.
            assert_eq!(s.peak_in_flight()[0], 2 * p - 1);
            // Within one synchronised iteration only the (p-1)F start-up skew remains.
            assert!(close(t.makespan(), 3.0 * m as f64 + p as f64 - 1.0));
            // 1F1B and ZB-H1 gain nothing from running back to back.
            let h1 = ScheduleKind::ZbH1.generate(p, m, 1).unwrap();
            let c1 = unit(&h1);
            assert!(close(
                steady_state_period(&h1, &c1).unwrap(),
                simulate(&h1, &c1).unwrap().makespan()
            ));
        }
    }
}

#[test]
fn zb_v_beats_1f1b_at_the_same_memory() {
    for p in 2..=8usize {
        for m in [2 * p, 32] {
            let s = ScheduleKind::ZbV.generate(p, m, 2).unwrap();
            let t = simulate(&s, &unit(&s)).unwrap();
            let one = ScheduleKind::OneFOneB.generate(p, m, 1).unwrap();
            let t1 = simulate(&one, &unit(&one)).unwrap();
            let h1 = ScheduleKind::ZbH1.generate(p, m, 1).unwrap();
            let th1 = simulate(&h1, &unit(&h1)).unwrap();
            // 2p chunks of half a stage each: p·M_B, 1F1B's stage-0 peak.
            assert!(
                t.peak_memory().iter().all(|&x| x <= p as f64 + 1e-12),
                "{:?}",
                t.peak_memory()
            );
            assert!(t.bubble_fraction() < th1.bubble_fraction(), "p={p} m={m}");
            assert!(t.bubble_fraction() < t1.bubble_fraction() / 3.0);
        }
    }
}

#[test]
fn p2p_latency_lengthens_the_pipeline_by_the_hops_on_the_critical_path() {
    // 1F1B, p stages: the first forward crosses p-1 links, the last
    // backward p-1 links back; with latency L the makespan grows by 2(p-1)L.
    let (p, m, lat) = (4, 8, 0.25);
    let s = ScheduleKind::OneFOneB.generate(p, m, 1).unwrap();
    let t0 = simulate(&s, &Costs::per_stage(&s, 1.0, 1.0, 1.0, 0.0)).unwrap();
    let tl = simulate(&s, &Costs::per_stage(&s, 1.0, 1.0, 1.0, lat)).unwrap();
    assert!(tl.makespan() >= t0.makespan() + 2.0 * (p as f64 - 1.0) * lat - 1e-12);
}

#[test]
fn every_generator_validates_for_all_p_up_to_8_and_m_up_to_32() {
    for kind in ScheduleKind::ALL {
        for p in 1..=8usize {
            for m in 1..=32usize {
                let v = kind.default_chunks();
                if kind == ScheduleKind::Interleaved && !m.is_multiple_of(p) {
                    assert!(kind.generate(p, m, v).is_err());
                    continue;
                }
                let s = kind.generate(p, m, v).unwrap();
                if let Err(e) = validate(&s) {
                    panic!("{kind} p={p} m={m} v={v}: {e}");
                }
            }
        }
    }
}

/// The chunks per stage `kind` takes for a drawn `v` (interleaved: `v`,
/// with `m` a multiple of `p`; ZB-V: 2; the others: 1).
fn chunks(kind: ScheduleKind, v: usize) -> usize {
    match kind {
        ScheduleKind::Interleaved => v,
        ScheduleKind::ZbV => 2,
        _ => 1,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn every_generated_schedule_validates(
        p in 1usize..=8, m in 1usize..=32, v in 1usize..=4, k in 0usize..ScheduleKind::ALL.len(),
    ) {
        let kind = ScheduleKind::ALL[k];
        let m = if kind == ScheduleKind::Interleaved && v > 1 { (m / p).max(1) * p } else { m };
        // every drawn case runs: m was made a multiple of p above
        let v = chunks(kind, v);
        let s = kind.generate(p, m, v).unwrap();
        prop_assert_eq!(s.num_stages(), p);
        prop_assert_eq!(s.microbatches(), m);
        validate(&s).unwrap();
        // The documented memory bounds hold.
        let peak = s.peak_in_flight();
        let bound: Vec<usize> = match kind {
            ScheduleKind::GPipe => vec![m; p],
            ScheduleKind::OneFOneB => (0..p).map(|i| (p - i).min(m)).collect(),
            ScheduleKind::Interleaved if v == 1 => (0..p).map(|i| (p - i).min(m)).collect(),
            ScheduleKind::Interleaved => (0..p).map(|i| ((p - i - 1) * 2 + (v - 1) * p + 1).min(m * v)).collect(),
            ScheduleKind::ZbH1 => vec![p.min(m); p],
            ScheduleKind::ZbH2 => vec![(2 * p - 1).min(m); p],
            _ => vec![2 * p; p],
        };
        validate_with_limit(&s, &bound).unwrap();
        prop_assert!(peak.iter().zip(&bound).all(|(a, b)| a <= b));
        // The text format round-trips.
        prop_assert_eq!(&Schedule::parse(&s.to_string()).unwrap(), &s);
    }

    #[test]
    fn a_moved_action_is_caught_or_still_runs(
        p in 2usize..6, m in 2usize..10, k in 0usize..ScheduleKind::ALL.len(),
        stage in 0usize..6, from in 0usize..200, to in 0usize..200,
    ) {
        // Reordering a stage's list never breaks exactly-once; it either
        // validates (and then simulates) or fails with an error, never a panic or hang.
        let kind = ScheduleKind::ALL[k];
        let m = if kind == ScheduleKind::Interleaved { p * (m / p).max(1) } else { m };
        let s = kind.generate(p, m, kind.default_chunks()).unwrap();
        let stage = stage % p;
        let mut lists = s.stages().to_vec();
        let n = lists[stage].len();
        let a = lists[stage].remove(from % n);
        lists[stage].insert(to % n, a);
        let moved = Schedule::new("moved", m, s.placement(), lists).unwrap();
        match validate(&moved) {
            Ok(()) => { simulate(&moved, &Costs::per_stage(&moved, 1.0, 2.0, 1.0, 0.1)).unwrap(); }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }
}
