//! Faults to drill a run with: what `weft train --inject` takes and
//! [`Drill`](crate::Drill) draws.

/// What a [`Fault`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The rank's process is killed (SIGKILL, as by the OOM killer or a
    /// lost node) as the step begins.
    Kill,
    /// The rank stops making progress as the step begins (a rank stuck in
    /// a kernel): only a heartbeat or the collectives' watchdog notices.
    Hang,
    /// The batches of `count` steps from the step (as a fault-free run
    /// reads them) make the gradients non-finite (a parameter reads NaN
    /// while they are trained on, as an overflowing kernel makes it): the
    /// updates are skipped. Every rank's.
    Nan,
    /// The batch the step reads in a fault-free run is garbage (its
    /// targets scrambled, as by a corrupt shard of the corpus): the loss
    /// spikes. Every rank's.
    Spike,
    /// The rank computes `factor` times slower from the step on (a
    /// throttled chip, a noisy neighbour): a straggler.
    Slow,
    /// After the checkpoint of the step is committed, one of its files has
    /// a byte flipped (bit rot, a torn copy): loading it must fail and
    /// fall back.
    CorruptCheckpoint,
    /// The rank's process is killed while the checkpoint of the step is
    /// being written, after its own file and before the commit.
    CrashDuringSave,
}

impl FaultKind {
    /// Every kind with its name.
    pub const ALL: [(FaultKind, &'static str); 7] = [
        (FaultKind::Kill, "kill"),
        (FaultKind::Hang, "hang"),
        (FaultKind::Nan, "nan"),
        (FaultKind::Spike, "spike"),
        (FaultKind::Slow, "slow"),
        (FaultKind::CorruptCheckpoint, "corrupt-checkpoint"),
        (FaultKind::CrashDuringSave, "crash-during-save"),
    ];

    /// The name `--inject` uses.
    #[must_use]
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(k, _)| *k == self)
            .map_or("?", |(_, n)| n)
    }
}

/// A fault injected into a run for tests and drills:
/// `KIND:step=N[,rank=R][,count=C][,factor=F]`, for example
/// `kill:rank=1,step=37`, `hang:step=50`, `nan:step=60,count=3`,
/// `spike:step=45`, `slow:rank=1,factor=3`, `corrupt-checkpoint:step=40`,
/// `crash-during-save:step=80`. Steps are 1-based; `rank` (default 0) is
/// the world rank that suffers it (`nan` and `spike` are faults of the
/// data, every rank's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// The step (1-based) it happens at (from, for `slow`).
    pub step: u64,
    /// The world rank it happens on.
    pub rank: usize,
    /// Consecutive steps (`nan`).
    pub count: u64,
    /// How many times slower (`slow`).
    pub factor: f64,
}

impl std::str::FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let kinds: Vec<&str> = FaultKind::ALL.iter().map(|(_, n)| *n).collect();
        let usage = format!(
            "expected KIND:step=N[,rank=R][,count=C][,factor=F] with KIND one of {}",
            kinds.join(", ")
        );
        let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
        let kind = FaultKind::ALL
            .iter()
            .find(|(_, n)| *n == kind)
            .map(|(k, _)| *k)
            .ok_or_else(|| format!("--inject {s:?}: unknown fault {kind:?}; {usage}"))?;
        let mut fault = Fault {
            kind,
            step: 0,
            rank: 0,
            count: 1,
            factor: 2.0,
        };
        for field in rest.split(',').filter(|f| !f.is_empty()) {
            let (key, value) = field
                .split_once('=')
                .ok_or_else(|| format!("--inject {s:?}: {field:?} is not KEY=VALUE; {usage}"))?;
            let bad = |what: &str| format!("--inject {s:?}: {key}={value:?} is not {what}");
            match key {
                "step" => {
                    fault.step = value
                        .parse()
                        .ok()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| bad("a step ≥ 1"))?;
                }
                "rank" => fault.rank = value.parse().map_err(|_| bad("a rank ≥ 0"))?,
                "count" if kind == FaultKind::Nan => {
                    fault.count = value
                        .parse()
                        .ok()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| bad("a count ≥ 1"))?;
                }
                "factor" if kind == FaultKind::Slow => {
                    fault.factor = value
                        .parse()
                        .ok()
                        // a step's time is multiplied by it: bounded
                        .filter(|f: &f64| (1.0..=1000.0).contains(f))
                        .ok_or_else(|| bad("a factor from 1 to 1000"))?;
                }
                _ => {
                    return Err(format!(
                        "--inject {s:?}: {key:?} is not a setting of {}; {usage}",
                        kind.name()
                    ));
                }
            }
        }
        if fault.step == 0 {
            if kind == FaultKind::Slow {
                fault.step = 1;
            } else {
                return Err(format!("--inject {s:?}: step=N is missing; {usage}"));
            }
        }
        Ok(fault)
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:step={}", self.kind.name(), self.step)?;
        if self.rank != 0 {
            write!(f, ",rank={}", self.rank)?;
        }
        if self.kind == FaultKind::Nan && self.count != 1 {
            write!(f, ",count={}", self.count)?;
        }
        if self.kind == FaultKind::Slow {
            write!(f, ",factor={}", self.factor)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Fault, FaultKind};

    #[test]
    fn faults_parse_print_and_refuse_what_they_cannot_be() {
        for text in [
            "kill:step=37",
            "kill:step=37,rank=1",
            "hang:step=50,rank=2",
            "nan:step=60,count=3",
            "spike:step=45",
            "slow:step=1,rank=1,factor=3",
            "corrupt-checkpoint:step=40",
            "crash-during-save:step=80",
        ] {
            let f: Fault = text.parse().unwrap();
            assert_eq!(f.to_string(), text);
            assert_eq!(f.to_string().parse::<Fault>().unwrap(), f);
        }
        let f: Fault = "kill:rank=1,step=37".parse().unwrap();
        assert_eq!((f.kind, f.rank, f.step), (FaultKind::Kill, 1, 37));
        let slow: Fault = "slow:rank=1,factor=3".parse().unwrap();
        assert_eq!((slow.step, slow.factor), (1, 3.0));
        for (bad, says) in [
            ("explode:step=1", "unknown fault \"explode\""),
            ("kill", "step=N is missing"),
            ("kill:step=0", "a step ≥ 1"),
            ("kill:step=x", "a step ≥ 1"),
            ("kill:step=3,count=2", "\"count\" is not a setting of kill"),
            ("slow:factor=0.5", "a factor from 1 to 1000"),
            ("slow:step=2,factor=1e300", "a factor from 1 to 1000"),
            ("nan:step=3,count=0", "a count ≥ 1"),
            ("hang:rank=-1,step=2", "a rank ≥ 0"),
            ("kill:step", "is not KEY=VALUE"),
        ] {
            let e = bad.parse::<Fault>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
