//! The validator: structure, exactly-once, local order, deadlock, memory.

use crate::error::{Error, Result, Wait};
use crate::schedule::{Action, ActionKind, Schedule};

/// Check that `schedule` is runnable:
///
/// 1. every action names a micro-batch `< m` and a chunk `< v`;
/// 2. every micro-batch passes every chunk of every stage forward exactly
///    once and backward exactly once (one `BW`, or one `B` and one `W`) —
///    or, in a [forward-only](Schedule::forward_only) schedule, forward
///    exactly once;
/// 3. on each stage a backward comes after its forward and `W` after its
///    `B`;
/// 4. it cannot deadlock: with sends buffered and receives blocking (see
///    [`Schedule`]), every action's inputs are produced before it runs.
///
/// # Errors
/// The first problem found, naming the stage, the step and the action:
/// [`Error::InvalidAction`], [`Error::Duplicate`], [`Error::Missing`],
/// [`Error::OutOfOrder`], or [`Error::Deadlock`] with the cycle of waits.
pub fn validate(schedule: &Schedule) -> Result<()> {
    check_structure(schedule)?;
    crate::simulate::run_engine(schedule, &|_, _| 0.0, 0.0).map(|_| ())
}

/// [`validate`], and also that no stage ever holds more than
/// `max_in_flight[stage]` activation chunks (forwards whose backward has
/// not finished, as counted by [`Schedule::peak_in_flight`]).
///
/// # Errors
/// As [`validate`]; [`Error::MemoryLimit`] at the first step over the
/// limit; [`Error::InvalidParameter`] when `max_in_flight` does not have one
/// entry per stage.
pub fn validate_with_limit(schedule: &Schedule, max_in_flight: &[usize]) -> Result<()> {
    if max_in_flight.len() != schedule.num_stages() {
        return Err(Error::InvalidParameter {
            name: "max_in_flight",
            value: format!("{} entries", max_in_flight.len()),
            expected: format!("one entry per stage ({})", schedule.num_stages()),
        });
    }
    validate(schedule)?;
    for (stage, (list, &limit)) in schedule.stages().iter().zip(max_in_flight).enumerate() {
        let mut now = 0usize;
        for (step, a) in list.iter().enumerate() {
            match a.kind {
                ActionKind::Forward => now += 1,
                ActionKind::Backward | ActionKind::BackwardWeight => now -= 1,
                ActionKind::BackwardInput => {}
            }
            if now > limit {
                return Err(Error::MemoryLimit {
                    stage,
                    step,
                    action: *a,
                    in_flight: now,
                    limit,
                });
            }
        }
    }
    Ok(())
}

/// Steps (positions) of each action kind of one (micro-batch, chunk).
#[derive(Clone, Copy, Default)]
struct Seen {
    f: Option<usize>,
    bw: Option<usize>,
    b: Option<usize>,
    w: Option<usize>,
}

pub(crate) fn check_structure(schedule: &Schedule) -> Result<()> {
    let m = schedule.microbatches();
    let v = schedule.chunks();
    let forward_only = schedule.is_forward_only();
    for (stage, list) in schedule.stages().iter().enumerate() {
        let mut seen = vec![Seen::default(); m * v];
        for (step, a) in list.iter().enumerate() {
            if a.microbatch >= m {
                return Err(Error::InvalidAction {
                    stage,
                    step,
                    action: *a,
                    reason: format!("micro-batch {} out of range (m = {m})", a.microbatch),
                });
            }
            if a.chunk >= v {
                return Err(Error::InvalidAction {
                    stage,
                    step,
                    action: *a,
                    reason: format!("chunk {} out of range (v = {v})", a.chunk),
                });
            }
            let s = &mut seen[a.microbatch * v + a.chunk];
            let dup = |first_step: usize, kind: ActionKind| Error::Duplicate {
                stage,
                step,
                action: *a,
                first_step,
                first: Action { kind, ..*a },
            };
            let order = |needs: ActionKind| Error::OutOfOrder {
                stage,
                step,
                action: *a,
                needs: Action { kind: needs, ..*a },
            };
            match a.kind {
                ActionKind::Forward => {
                    if let Some(f) = s.f {
                        return Err(dup(f, ActionKind::Forward));
                    }
                    s.f = Some(step);
                }
                ActionKind::Backward => {
                    for (prev, kind) in [
                        (s.bw, ActionKind::Backward),
                        (s.b, ActionKind::BackwardInput),
                        (s.w, ActionKind::BackwardWeight),
                    ] {
                        if let Some(p) = prev {
                            return Err(dup(p, kind));
                        }
                    }
                    if s.f.is_none() {
                        return Err(order(ActionKind::Forward));
                    }
                    s.bw = Some(step);
                }
                ActionKind::BackwardInput => {
                    for (prev, kind) in [
                        (s.b, ActionKind::BackwardInput),
                        (s.bw, ActionKind::Backward),
                    ] {
                        if let Some(p) = prev {
                            return Err(dup(p, kind));
                        }
                    }
                    if s.f.is_none() {
                        return Err(order(ActionKind::Forward));
                    }
                    s.b = Some(step);
                }
                ActionKind::BackwardWeight => {
                    for (prev, kind) in [
                        (s.w, ActionKind::BackwardWeight),
                        (s.bw, ActionKind::Backward),
                    ] {
                        if let Some(p) = prev {
                            return Err(dup(p, kind));
                        }
                    }
                    if s.b.is_none() {
                        return Err(order(ActionKind::BackwardInput));
                    }
                    s.w = Some(step);
                }
            }
        }
        for mb in 0..m {
            for chunk in 0..v {
                let s = seen[mb * v + chunk];
                let missing = |kind| Error::Missing {
                    stage,
                    action: Action {
                        kind,
                        microbatch: mb,
                        chunk,
                    },
                };
                if s.f.is_none() {
                    return Err(missing(ActionKind::Forward));
                }
                if forward_only {
                    continue;
                }
                match (s.bw, s.b, s.w) {
                    (Some(_), None, None) | (None, Some(_), Some(_)) => {}
                    (None, Some(_), None) => return Err(missing(ActionKind::BackwardWeight)),
                    // W without B was rejected as out of order above.
                    _ => return Err(missing(ActionKind::Backward)),
                }
            }
        }
    }
    Ok(())
}

/// Build the deadlock error from the stuck state: follow, from a stuck
/// stage, the stage that must produce what it waits for, until a stage
/// repeats; that loop is the cycle.
pub(crate) fn deadlock(stuck: &[Option<(usize, Action, Action, usize)>]) -> Error {
    let start = stuck.iter().position(Option::is_some).unwrap_or(0);
    let mut order = Vec::new();
    let mut visited = vec![usize::MAX; stuck.len()];
    let mut cur = start;
    while visited[cur] == usize::MAX {
        visited[cur] = order.len();
        let Some((step, action, waits_for, on_stage)) = stuck[cur] else {
            break;
        };
        order.push(Wait {
            stage: cur,
            step,
            action,
            waits_for,
            on_stage,
        });
        cur = on_stage;
    }
    let from = if visited[cur] == usize::MAX {
        0
    } else {
        visited[cur]
    };
    Error::Deadlock {
        cycle: order[from.min(order.len())..].to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Placement;

    fn sched(m: usize, p: usize, text: &[&str]) -> Schedule {
        let stages = text
            .iter()
            .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
            .collect();
        Schedule::new(
            "t",
            m,
            Placement::Interleaved {
                stages: p,
                chunks: 1,
            },
            stages,
        )
        .unwrap()
    }

    #[test]
    fn accepts_a_hand_written_1f1b() {
        let s = sched(3, 2, &["F0 F1 BW0 F2 BW1 BW2", "F0 BW0 F1 BW1 F2 BW2"]);
        validate(&s).unwrap();
        validate_with_limit(&s, &[2, 1]).unwrap();
        let err = validate_with_limit(&s, &[1, 1]).unwrap_err();
        assert_eq!(
            err,
            Error::MemoryLimit {
                stage: 0,
                step: 1,
                action: Action::forward(1, 0),
                in_flight: 2,
                limit: 1
            }
        );
        assert!(validate_with_limit(&s, &[2]).is_err());
    }

    #[test]
    fn names_duplicates_and_missing_actions() {
        let s = sched(2, 1, &["F0 F1 BW0 BW1 F1"]);
        let err = validate(&s).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Duplicate {
                    stage: 0,
                    step: 4,
                    first_step: 1,
                    ..
                }
            ),
            "{err}"
        );
        let s = sched(2, 1, &["F0 F1 BW0"]);
        assert_eq!(
            validate(&s).unwrap_err(),
            Error::Missing {
                stage: 0,
                action: Action::backward(1, 0)
            }
        );
        let s = sched(1, 1, &["F0 B0"]);
        assert_eq!(
            validate(&s).unwrap_err(),
            Error::Missing {
                stage: 0,
                action: Action::backward_weight(0, 0)
            }
        );
        let s = sched(1, 1, &["F0 B0 W0 BW0"]);
        assert!(matches!(
            validate(&s).unwrap_err(),
            Error::Duplicate { step: 3, .. }
        ));
        let s = sched(1, 1, &["F0 F3 BW0"]);
        let err = validate(&s).unwrap_err();
        assert!(
            err.to_string()
                .contains("stage 0, step 1 (F3): micro-batch 3 out of range"),
            "{err}"
        );
    }

    #[test]
    fn names_local_order_violations() {
        let s = sched(1, 1, &["BW0 F0"]);
        let err = validate(&s).unwrap_err();
        assert_eq!(
            err,
            Error::OutOfOrder {
                stage: 0,
                step: 0,
                action: Action::backward(0, 0),
                needs: Action::forward(0, 0)
            }
        );
        let s = sched(1, 1, &["F0 W0 B0"]);
        assert!(matches!(
            validate(&s).unwrap_err(),
            Error::OutOfOrder { step: 1, .. }
        ));
    }

    #[test]
    fn finds_the_deadlock_cycle() {
        // Stage 0 waits for the gradient of micro-batch 0 before it sends
        // micro-batch 1 forward; stage 1 wants F1 before it runs BW0.
        let s = sched(2, 2, &["F0 BW0 F1 BW1", "F0 F1 BW0 BW1"]);
        let err = validate(&s).unwrap_err();
        let Error::Deadlock { cycle } = &err else {
            panic!("{err}")
        };
        assert_eq!(cycle.len(), 2);
        assert!(cycle.iter().any(|w| w.stage == 0
            && w.step == 1
            && w.action == Action::backward(0, 0)
            && w.waits_for == Action::backward(0, 0)
            && w.on_stage == 1));
        assert!(cycle.iter().any(|w| w.stage == 1
            && w.step == 1
            && w.waits_for == Action::forward(1, 0)
            && w.on_stage == 0));
        assert!(err.to_string().starts_with("deadlock: stage"), "{err}");
    }

    #[test]
    fn a_deadlock_names_the_backward_its_producer_lists() {
        // split backwards: stage 0 waits for stage 1's input gradient B0
        // (not a whole BW0, which stage 1 does not list)
        let s = sched(2, 2, &["F0 B0 F1 W0 B1 W1", "F0 F1 B0 W0 B1 W1"]);
        let err = validate(&s).unwrap_err();
        let Error::Deadlock { cycle } = &err else {
            panic!("{err}")
        };
        assert!(
            cycle.iter().any(|w| w.stage == 0
                && w.waits_for == Action::backward_input(0, 0)
                && w.on_stage == 1),
            "{err}"
        );
    }
}
