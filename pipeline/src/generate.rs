//! Schedule generators.
//!
//! Bubbles below are for one iteration under uniform per-stage costs
//! `F`, `B`, `W` (whole backward `B + W`) and zero latency; "idle per
//! stage" is the bubble time, and the bubble fraction is idle over idle plus
//! busy. Memory is in activation chunks (one chunk = `1/v` of a stage's
//! activations `M_B`) as counted by [`Schedule::peak_in_flight`].

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::schedule::{Action, ActionKind, Placement, Schedule};

/// The schedules this crate generates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum ScheduleKind {
    /// [`gpipe`].
    #[cfg_attr(feature = "serde", serde(rename = "gpipe"))]
    GPipe,
    /// [`one_f_one_b`] (the default).
    #[default]
    #[cfg_attr(feature = "serde", serde(rename = "1f1b"))]
    OneFOneB,
    /// [`interleaved`].
    #[cfg_attr(feature = "serde", serde(rename = "interleaved"))]
    Interleaved,
    /// [`zb_h1`].
    #[cfg_attr(feature = "serde", serde(rename = "zb-h1"))]
    ZbH1,
    /// [`zb_h2`].
    #[cfg_attr(feature = "serde", serde(rename = "zb-h2"))]
    ZbH2,
    /// [`zb_v`].
    #[cfg_attr(feature = "serde", serde(rename = "zb-v"))]
    ZbV,
}

const NAMES: &str = "gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v";

/// The most forward passes (stages × micro-batches × chunks) a generated
/// schedule holds: 2^21, a few hundred MiB of actions and timeline. Far
/// above any real job's; it stops sizes typed by mistake from allocating
/// without bound.
pub const MAX_SCHEDULE_PASSES: usize = 1 << 21;

impl ScheduleKind {
    /// Every kind.
    pub const ALL: [Self; 6] = [
        Self::GPipe,
        Self::OneFOneB,
        Self::Interleaved,
        Self::ZbH1,
        Self::ZbH2,
        Self::ZbV,
    ];

    /// The name accepted by [`FromStr`] and written into schedules.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::GPipe => "gpipe",
            Self::OneFOneB => "1f1b",
            Self::Interleaved => "interleaved",
            Self::ZbH1 => "zb-h1",
            Self::ZbH2 => "zb-h2",
            Self::ZbV => "zb-v",
        }
    }

    /// Chunks per stage used when the caller gives none: 2 for
    /// interleaved and ZB-V, 1 otherwise.
    #[must_use]
    pub fn default_chunks(self) -> usize {
        self.chunks(2)
    }

    /// Chunks per stage this kind runs when interleaving asks for
    /// `interleaved` of them: that many for [`Interleaved`](Self::Interleaved),
    /// always 2 for [`ZbV`](Self::ZbV) (its V), 1 for every other kind.
    #[must_use]
    pub fn chunks(self, interleaved: usize) -> usize {
        match self {
            Self::Interleaved => interleaved,
            Self::ZbV => 2,
            _ => 1,
        }
    }

    /// Whether the backward is split into its input (B) and weight (W)
    /// halves (the zero-bubble kinds).
    #[must_use]
    pub fn splits_backward(self) -> bool {
        matches!(self, Self::ZbH1 | Self::ZbH2 | Self::ZbV)
    }

    /// Generate the schedule for `stages` stages, `microbatches`
    /// micro-batches and `chunks` chunks per stage.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] naming the parameter when the kind does
    /// not allow the combination (zero stages or micro-batches; chunks other
    /// than 1 for single-chunk schedules or other than 2 for ZB-V;
    /// interleaving with `m` not a multiple of `p`; more than
    /// [`MAX_SCHEDULE_PASSES`] forward passes in all).
    pub fn generate(self, stages: usize, microbatches: usize, chunks: usize) -> Result<Schedule> {
        let passes = stages
            .checked_mul(microbatches)
            .and_then(|n| n.checked_mul(chunks));
        if passes.is_none_or(|n| n > MAX_SCHEDULE_PASSES) {
            return Err(Error::InvalidParameter {
                name: "microbatches",
                value: microbatches.to_string(),
                expected: format!(
                    "stages × micro-batches × chunks ({stages} × {microbatches} × {chunks}) at most {MAX_SCHEDULE_PASSES}, the bound on a schedule's size"
                ),
            });
        }
        let want = |v: usize| {
            if chunks == v {
                Ok(())
            } else {
                Err(Error::InvalidParameter {
                    name: "chunks",
                    value: chunks.to_string(),
                    expected: format!("{v} for schedule {}", self.name()),
                })
            }
        };
        match self {
            Self::GPipe => want(1).and_then(|()| gpipe(stages, microbatches)),
            Self::OneFOneB => want(1).and_then(|()| one_f_one_b(stages, microbatches)),
            Self::Interleaved => interleaved(stages, microbatches, chunks),
            Self::ZbH1 => want(1).and_then(|()| zb_h1(stages, microbatches)),
            Self::ZbH2 => want(1).and_then(|()| zb_h2(stages, microbatches)),
            Self::ZbV => want(2).and_then(|()| zb_v(stages, microbatches)),
        }
    }

    /// The bubble fraction the paper's formula predicts for uniform
    /// per-stage costs `f`, `b`, `w` and zero latency — with iterations
    /// back to back for the zero-bubble kinds, as Qi et al. count them —
    /// or `None` where the paper gives no closed form (ZB-V).
    ///
    /// * GPipe, 1F1B (Huang et al.; Narayanan et al.): `(p−1)/(m+p−1)`.
    /// * Interleaved (Narayanan et al. 2021): bubble time `(p−1)/v` stage
    ///   passes against `m` busy ones: `(p−1)/(v·m+p−1)`.
    /// * ZB-H1 (Qi et al., Table 2): idle `(p−1)(F+B−W)` per stage.
    /// * ZB-H2: idle `max(0, (p−1)(F+B−2W))` per stage.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn expected_bubble(
        self,
        stages: usize,
        microbatches: usize,
        chunks: usize,
        f: f64,
        b: f64,
        w: f64,
    ) -> Option<f64> {
        let (p, m, v) = (stages as f64, microbatches as f64, chunks as f64);
        let busy = m * (f + b + w);
        let frac = |idle: f64| idle / (idle + busy);
        match self {
            Self::GPipe | Self::OneFOneB => Some((p - 1.0) / (m + p - 1.0)),
            Self::Interleaved => Some((p - 1.0) / (v * m + p - 1.0)),
            Self::ZbH1 => Some(frac((p - 1.0) * (f + b - w).max(0.0))),
            Self::ZbH2 => Some(frac((p - 1.0) * (f + b - 2.0 * w).max(0.0))),
            Self::ZbV => None,
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let norm = s.trim().to_ascii_lowercase().replace('_', "-");
        Ok(match norm.as_str() {
            "gpipe" => Self::GPipe,
            "1f1b" | "pipedream-flush" => Self::OneFOneB,
            "interleaved" | "interleaved-1f1b" => Self::Interleaved,
            "zb-h1" | "zbh1" => Self::ZbH1,
            "zb-h2" | "zbh2" => Self::ZbH2,
            "zb-v" | "zbv" => Self::ZbV,
            _ => {
                return Err(Error::UnknownSchedule {
                    name: s.to_owned(),
                    expected: NAMES,
                });
            }
        })
    }
}

fn check_pm(stages: usize, microbatches: usize) -> Result<()> {
    if stages == 0 {
        return Err(Error::InvalidParameter {
            name: "stages",
            value: "0".into(),
            expected: "at least 1".into(),
        });
    }
    if microbatches == 0 {
        return Err(Error::InvalidParameter {
            name: "microbatches",
            value: "0".into(),
            expected: "at least 1".into(),
        });
    }
    Ok(())
}

fn plain(stages: usize) -> Placement {
    Placement::Interleaved { stages, chunks: 1 }
}

/// GPipe (Huang et al. 2019): every stage runs all `m` forwards, then all
/// `m` whole backwards.
///
/// Bubble `(p−1)/(m+p−1)`; every stage holds all `m` micro-batches'
/// activations at its peak.
///
/// # Errors
/// [`Error::InvalidParameter`] when `stages` or `microbatches` is 0.
pub fn gpipe(stages: usize, microbatches: usize) -> Result<Schedule> {
    check_pm(stages, microbatches)?;
    let list: Vec<Action> = (0..microbatches)
        .map(|i| Action::forward(i, 0))
        .chain((0..microbatches).map(|i| Action::backward(i, 0)))
        .collect();
    Schedule::new("gpipe", microbatches, plain(stages), vec![list; stages])
}

/// 1F1B, PipeDream-Flush (Narayanan et al. 2021): stage `i` runs
/// `min(p−1−i, m)` warm-up forwards, then alternates one forward and one
/// whole backward, then drains the remaining backwards.
///
/// Bubble `(p−1)/(m+p−1)`, as GPipe; stage `i` holds at most `min(p−i, m)`
/// micro-batches (stage 0: `p`).
///
/// # Errors
/// [`Error::InvalidParameter`] when `stages` or `microbatches` is 0.
pub fn one_f_one_b(stages: usize, microbatches: usize) -> Result<Schedule> {
    check_pm(stages, microbatches)?;
    let lists = (0..stages)
        .map(|i| {
            let warm = (stages - 1 - i).min(microbatches);
            let mut list: Vec<Action> = (0..warm).map(|k| Action::forward(k, 0)).collect();
            for k in 0..microbatches - warm {
                list.push(Action::forward(warm + k, 0));
                list.push(Action::backward(k, 0));
            }
            list.extend((microbatches - warm..microbatches).map(|k| Action::backward(k, 0)));
            list
        })
        .collect();
    Schedule::new("1f1b", microbatches, plain(stages), lists)
}

/// Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's virtual
/// pipeline): each stage holds `v` chunks ([`Placement::Interleaved`]);
/// micro-batches go through in groups of `p`, and stage `i` warms up with
/// `min((p−i−1)·2 + (v−1)·p, m·v)` chunk forwards before alternating.
///
/// Bubble `(p−1)/(v·m+p−1)` (the 1F1B bubble time divided by `v`); stage
/// `i` holds at most `min((p−i−1)·2 + (v−1)·p + 1, m·v)` chunk activations
/// (each `1/v` of a stage's), i.e. stage 0 about `p·(1 + (p−2)/(v·p))`
/// stages' worth — slightly more than 1F1B.
///
/// # Errors
/// [`Error::InvalidParameter`] when a count is 0 or, for `v > 1`, `m` is
/// not a multiple of `p` (Megatron-LM's requirement).
pub fn interleaved(stages: usize, microbatches: usize, chunks: usize) -> Result<Schedule> {
    check_pm(stages, microbatches)?;
    if chunks == 0 {
        return Err(Error::InvalidParameter {
            name: "chunks",
            value: "0".into(),
            expected: "at least 1".into(),
        });
    }
    if chunks > 1 && !microbatches.is_multiple_of(stages) {
        return Err(Error::InvalidParameter {
            name: "microbatches",
            value: microbatches.to_string(),
            expected: format!("a multiple of stages ({stages}) for interleaved 1F1B"),
        });
    }
    let (p, v, m) = (stages, chunks, microbatches);
    let total = m * v;
    // k-th forward (or backward) of a stage: its chunk and micro-batch.
    let chunk_of = |k: usize, forward: bool| {
        let c = (k % (p * v)) / p;
        if forward { c } else { v - 1 - c }
    };
    let mb_of = |k: usize| (k / (p * v)) * p + k % p;
    let lists = (0..p)
        .map(|i| {
            let warm = if v == 1 {
                (p - 1 - i).min(m)
            } else {
                ((p - i - 1) * 2 + (v - 1) * p).min(total)
            };
            let fwd = |k: usize| Action::forward(mb_of(k), chunk_of(k, true));
            let bwd = |k: usize| Action::backward(mb_of(k), chunk_of(k, false));
            let mut list: Vec<Action> = (0..warm).map(fwd).collect();
            for k in 0..total - warm {
                list.push(fwd(warm + k));
                list.push(bwd(k));
            }
            list.extend((total - warm..total).map(bwd));
            list
        })
        .collect();
    Schedule::new(
        "interleaved",
        m,
        Placement::Interleaved {
            stages: p,
            chunks: v,
        },
        lists,
    )
}

/// ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §2.1): 1F1B
/// with the backward split into `B` and `W`; stage `i` keeps at most
/// `p − i` micro-batches between `F` and `B` (as 1F1B), `B` runs as soon
/// as its gradient arrives, and stage `i` may postpone up to `i` of its
/// `W`s to fill what would be bubbles, so no stage holds more than stage
/// 0's `p` micro-batches. Stage `i`: `p−1−i` warm-up forwards, then for
/// each micro-batch `k` the next forward, `B_k`, and (once `k ≥ i`) the
/// oldest pending `W`; the postponed `W`s close the list.
///
/// Bubble: idle `(p−1)(F+B−W)` per stage — a third of 1F1B's
/// `(p−1)(F+B+W)` when `F = B = W`; peak memory as 1F1B (`p` micro-batches,
/// counting those waiting for `W`, on every stage).
///
/// # Errors
/// [`Error::InvalidParameter`] when `stages` or `microbatches` is 0.
pub fn zb_h1(stages: usize, microbatches: usize) -> Result<Schedule> {
    check_pm(stages, microbatches)?;
    let m = microbatches;
    let lists = (0..stages)
        .map(|i| {
            let warm = (stages - 1 - i).min(m);
            let mut list: Vec<Action> = (0..warm).map(|k| Action::forward(k, 0)).collect();
            let mut next_w = 0;
            for k in 0..m {
                if warm + k < m {
                    list.push(Action::forward(warm + k, 0));
                }
                list.push(Action::backward_input(k, 0));
                // Stage i postpones its first W until i Bs have run.
                if k >= i {
                    list.push(Action::backward_weight(next_w, 0));
                    next_w += 1;
                }
            }
            list.extend((next_w..m).map(|k| Action::backward_weight(k, 0)));
            list
        })
        .collect();
    Schedule::new("zb-h1", m, plain(stages), lists)
}

/// ZB-H2 (Qi et al. 2024, §2.2): as ZB-H1 but stage `i` may keep
/// `2(p − i) − 1` micro-batches between `F` and `B` and `2p − 1` before
/// `W`, so extra warm-up forwards fill the start-up bubble and postponed
/// `W`s fill the tail.
///
/// Bubble: idle `max(0, (p−1)(F+B−2W))` per stage when iterations run back
/// to back (the paper's optimizer post-validation; see
/// [`steady_state_period`](crate::steady_state_period)) — zero for
/// `F = B = W`. Within a single synchronised iteration the parallelogram's
/// `(p−1)F` start-up skew remains. Peak memory `(2p−1)` micro-batches on
/// stage 0, the paper's `(2p−1)·M_B`.
///
/// # Errors
/// [`Error::InvalidParameter`] when `stages` or `microbatches` is 0.
pub fn zb_h2(stages: usize, microbatches: usize) -> Result<Schedule> {
    check_pm(stages, microbatches)?;
    let act: Vec<usize> = (0..stages).map(|i| 2 * (stages - i) - 1).collect();
    list_schedule(
        "zb-h2",
        microbatches,
        plain(stages),
        &act,
        &vec![2 * stages - 1; stages],
    )
}

/// ZB-V (Qi et al. 2024, §6 of the arXiv version): two chunks per stage in
/// the V layout ([`Placement::VShape`]: stage 0 holds the first and the
/// last chunk), split backward, and every stage limited to `2p` chunk
/// activations — `p·M_B`, the same peak as 1F1B. The order is derived by
/// list scheduling under `F = B = W` per chunk.
///
/// # Errors
/// [`Error::InvalidParameter`] when `stages` or `microbatches` is 0.
pub fn zb_v(stages: usize, microbatches: usize) -> Result<Schedule> {
    check_pm(stages, microbatches)?;
    let limits = vec![2 * stages; stages];
    list_schedule(
        "zb-v",
        microbatches,
        Placement::VShape { stages },
        &limits,
        &limits,
    )
}

/// Derive a split-backward schedule by list scheduling under unit costs
/// (`F = B = W = 1` per chunk, no latency): whenever a stage is free it runs
/// the first of
/// 1. a ready `B` (lowest micro-batch, then deepest chunk) — it is on the
///    critical path;
/// 2. a ready `F` (deepest chunk first, then lowest micro-batch) if the
///    stage has fewer than `max_activations[stage]` chunks between `F` and
///    `B` and fewer than `max_in_flight[stage]` between `F` and `W`;
/// 3. the oldest pending `W`.
///
/// This is the greedy of Qi et al.'s automatic scheduler with the memory
/// limit as a count of chunks; ZB-H1, ZB-H2 and ZB-V are instances.
///
/// # Errors
/// [`Error::InvalidParameter`] when the limits do not have one positive
/// entry per stage, or are too small for any progress.
pub fn list_schedule(
    name: &str,
    microbatches: usize,
    placement: Placement,
    max_activations: &[usize],
    max_in_flight: &[usize],
) -> Result<Schedule> {
    let limits = max_in_flight;
    let p = placement.stages();
    let v = placement.chunks();
    let m = microbatches;
    let nvs = placement.virtual_stages();
    if limits.len() != p
        || limits.contains(&0)
        || max_activations.len() != p
        || max_activations.contains(&0)
    {
        return Err(Error::InvalidParameter {
            name: "limits",
            value: format!("{max_activations:?} / {limits:?}"),
            expected: format!("{p} positive limits, one per stage"),
        });
    }
    let idx = |mb: usize, vs: usize| mb * nvs + vs;
    // End times (in unit steps) of forwards and of input gradients.
    let mut fwd = vec![usize::MAX; m * nvs];
    let mut grad = vec![usize::MAX; m * nvs];
    let mut next_f = vec![vec![0usize; v]; p];
    let mut next_b = vec![vec![0usize; v]; p];
    let mut pending_w: Vec<std::collections::VecDeque<(usize, usize)>> =
        vec![Default::default(); p];
    let mut in_flight = vec![0usize; p];
    let mut activations = vec![0usize; p];
    let mut lists: Vec<Vec<Action>> = vec![Vec::with_capacity(3 * m * v); p];
    let total = 3 * m * nvs;
    let mut done = 0usize;
    let mut t = 0usize;
    while done < total {
        let mut started: Vec<(usize, Action, usize)> = Vec::new();
        for stage in 0..p {
            // 1. a ready B
            let mut best_b: Option<(usize, usize, usize)> = None; // (mb, vs, chunk)
            for (c, &mb) in next_b[stage].iter().enumerate() {
                if mb >= m {
                    continue;
                }
                let vs = placement.virtual_stage(stage, c);
                let ok = fwd[idx(mb, vs)] <= t && (vs + 1 == nvs || grad[idx(mb, vs + 1)] <= t);
                if ok
                    && best_b.is_none_or(|(bm, bvs, _)| {
                        (mb, std::cmp::Reverse(vs)) < (bm, std::cmp::Reverse(bvs))
                    })
                {
                    best_b = Some((mb, vs, c));
                }
            }
            if let Some((mb, vs, c)) = best_b {
                next_b[stage][c] += 1;
                activations[stage] -= 1;
                pending_w[stage].push_back((mb, c));
                started.push((stage, Action::backward_input(mb, c), vs));
                continue;
            }
            // 2. a ready F under the limit
            if in_flight[stage] < limits[stage] && activations[stage] < max_activations[stage] {
                let mut best_f: Option<(usize, usize, usize)> = None;
                for (c, &mb) in next_f[stage].iter().enumerate() {
                    if mb >= m {
                        continue;
                    }
                    let vs = placement.virtual_stage(stage, c);
                    let ok = vs == 0 || fwd[idx(mb, vs - 1)] <= t;
                    if ok
                        && best_f.is_none_or(|(bm, bvs, _)| {
                            (std::cmp::Reverse(vs), mb) < (std::cmp::Reverse(bvs), bm)
                        })
                    {
                        best_f = Some((mb, vs, c));
                    }
                }
                if let Some((mb, vs, c)) = best_f {
                    next_f[stage][c] += 1;
                    in_flight[stage] += 1;
                    activations[stage] += 1;
                    started.push((stage, Action::forward(mb, c), vs));
                    continue;
                }
            }
            // 3. the oldest W
            if let Some((mb, c)) = pending_w[stage].pop_front() {
                in_flight[stage] -= 1;
                let vs = placement.virtual_stage(stage, c);
                started.push((stage, Action::backward_weight(mb, c), vs));
            }
        }
        if started.is_empty() {
            return Err(Error::InvalidParameter {
                name: "limits",
                value: format!("{limits:?}"),
                expected: format!(
                    "in-flight limits large enough for {name} to make progress (stuck at step {t})"
                ),
            });
        }
        for (stage, a, vs) in started {
            match a.kind {
                ActionKind::Forward => fwd[idx(a.microbatch, vs)] = t + 1,
                ActionKind::BackwardInput => grad[idx(a.microbatch, vs)] = t + 1,
                _ => {}
            }
            lists[stage].push(a);
            done += 1;
        }
        t += 1;
    }
    Schedule::new(name, m, placement, lists)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unknown_names_are_listed() {
        for k in ScheduleKind::ALL {
            assert_eq!(k.name().parse::<ScheduleKind>().unwrap(), k);
        }
        assert_eq!("ZB_H1".parse::<ScheduleKind>().unwrap(), ScheduleKind::ZbH1);
        let err = "dualpipe2".parse::<ScheduleKind>().unwrap_err();
        assert!(err.to_string().contains("gpipe, 1f1b"), "{err}");
    }

    #[test]
    fn bad_parameters_are_named() {
        let e = ScheduleKind::OneFOneB.generate(0, 4, 1).unwrap_err();
        assert!(e.to_string().contains("stages = 0"), "{e}");
        let e = ScheduleKind::GPipe.generate(2, 0, 1).unwrap_err();
        assert!(e.to_string().contains("microbatches = 0"), "{e}");
        let e = ScheduleKind::Interleaved.generate(4, 6, 2).unwrap_err();
        assert!(e.to_string().contains("multiple of stages (4)"), "{e}");
        let e = ScheduleKind::OneFOneB.generate(4, 8, 2).unwrap_err();
        assert!(e.to_string().contains("chunks = 2"), "{e}");
        let e = ScheduleKind::ZbV.generate(4, 8, 3).unwrap_err();
        assert!(e.to_string().contains("2 for schedule zb-v"), "{e}");
        let e = list_schedule("x", 4, plain(2), &[1], &[1]).unwrap_err();
        assert!(e.to_string().contains("limits"), "{e}");
    }

    #[test]
    fn one_f_one_b_matches_the_textbook_order() {
        let s = one_f_one_b(4, 8).unwrap();
        let text: Vec<String> = s.stage(1).iter().map(ToString::to_string).collect();
        assert_eq!(
            text.join(" "),
            "F0 F1 F2 BW0 F3 BW1 F4 BW2 F5 BW3 F6 BW4 F7 BW5 BW6 BW7"
        );
        assert_eq!(s.peak_in_flight(), vec![4, 3, 2, 1]);
    }

    #[test]
    fn interleaved_follows_megatron_chunk_order() {
        let s = interleaved(2, 4, 2).unwrap();
        // Stage 0 (p=2, v=2): warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards:
        // mb 0,1 on chunk 0, then mb 0,1 on chunk 1.
        let text: Vec<String> = s.stage(0).iter().take(5).map(ToString::to_string).collect();
        assert_eq!(text.join(" "), "F0 F1 F0.1 F1.1 F2");
        // First backward goes through the last chunk.
        assert_eq!(s.stage(0)[5], Action::backward(0, 1));
    }
}
