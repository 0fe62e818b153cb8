//! The schedule representation and its text format.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// What an action computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// `F`: forward of one micro-batch through one chunk; keeps its
    /// activations for the backward.
    Forward,
    /// `BW`: the whole backward (input and weight gradients together);
    /// frees the activations.
    Backward,
    /// `B`: backward for the input only (the gradient sent upstream); frees
    /// most activations, keeps what the weight gradient needs.
    BackwardInput,
    /// `W`: backward for the weights only; frees the rest.
    BackwardWeight,
}

impl ActionKind {
    /// The short name used in schedule text and traces: `F`, `BW`, `B`, `W`.
    #[must_use]
    pub fn symbol(self) -> &'static str {
        match self {
            Self::Forward => "F",
            Self::Backward => "BW",
            Self::BackwardInput => "B",
            Self::BackwardWeight => "W",
        }
    }
}

/// One unit of work on a stage: `kind` for `microbatch` through the stage's
/// model chunk `chunk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Action {
    /// What is computed.
    pub kind: ActionKind,
    /// Micro-batch index, `0..m`.
    pub microbatch: usize,
    /// Model chunk of the stage, `0..v`.
    pub chunk: usize,
}

impl Action {
    /// Forward of `microbatch` through `chunk`.
    #[must_use]
    pub fn forward(microbatch: usize, chunk: usize) -> Self {
        Self {
            kind: ActionKind::Forward,
            microbatch,
            chunk,
        }
    }
    /// Whole backward of `microbatch` through `chunk`.
    #[must_use]
    pub fn backward(microbatch: usize, chunk: usize) -> Self {
        Self {
            kind: ActionKind::Backward,
            microbatch,
            chunk,
        }
    }
    /// Input-gradient backward (B) of `microbatch` through `chunk`.
    #[must_use]
    pub fn backward_input(microbatch: usize, chunk: usize) -> Self {
        Self {
            kind: ActionKind::BackwardInput,
            microbatch,
            chunk,
        }
    }
    /// Weight-gradient backward (W) of `microbatch` through `chunk`.
    #[must_use]
    pub fn backward_weight(microbatch: usize, chunk: usize) -> Self {
        Self {
            kind: ActionKind::BackwardWeight,
            microbatch,
            chunk,
        }
    }
}

impl fmt::Display for Action {
    /// `F3` (chunk 0) or `F3.1` (micro-batch 3, chunk 1).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.kind.symbol(), self.microbatch)?;
        if self.chunk != 0 {
            write!(f, ".{}", self.chunk)?;
        }
        Ok(())
    }
}

impl FromStr for Action {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let split = s
            .find(|c: char| c.is_ascii_digit())
            .ok_or_else(|| format!("{s:?} has no micro-batch number (expected e.g. F3 or B3.1)"))?;
        let (sym, rest) = s.split_at(split);
        let kind = match sym {
            "F" => ActionKind::Forward,
            "BW" => ActionKind::Backward,
            "B" => ActionKind::BackwardInput,
            "W" => ActionKind::BackwardWeight,
            _ => {
                return Err(format!(
                    "{s:?}: unknown action {sym:?} (expected F, B, W or BW)"
                ));
            }
        };
        let (mb, chunk) = match rest.split_once('.') {
            Some((a, b)) => (a, Some(b)),
            None => (rest, None),
        };
        let num = |t: &str| {
            t.parse::<usize>()
                .map_err(|_| format!("{s:?}: {t:?} is not a non-negative integer"))
        };
        Ok(Self {
            kind,
            microbatch: num(mb)?,
            chunk: chunk.map(num).transpose()?.unwrap_or(0),
        })
    }
}

/// How the model's chunks sit on the stages.
///
/// The layer stack is cut into `stages × chunks` contiguous *virtual
/// stages*, numbered in forward order. The placement says which virtual
/// stage each (stage, chunk) holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Megatron-LM's interleaving: chunk `c` of stage `i` holds virtual
    /// stage `c·p + i`, so a micro-batch loops `v` times around the stages.
    /// With one chunk this is the plain layout of GPipe and 1F1B.
    Interleaved {
        /// Stages `p`.
        stages: usize,
        /// Chunks per stage `v`.
        chunks: usize,
    },
    /// The V layout of ZB-V (and DualPipeV): two chunks per stage, chunk 0
    /// of stage `i` holds virtual stage `i`, chunk 1 holds `2p − 1 − i`, so
    /// the first and last layers both sit on stage 0 and the turn of the V
    /// is local to stage `p − 1`.
    VShape {
        /// Stages `p`.
        stages: usize,
    },
}

impl Placement {
    /// Stages `p`.
    #[must_use]
    pub fn stages(self) -> usize {
        match self {
            Self::Interleaved { stages, .. } | Self::VShape { stages } => stages,
        }
    }

    /// Chunks per stage `v`.
    #[must_use]
    pub fn chunks(self) -> usize {
        match self {
            Self::Interleaved { chunks, .. } => chunks,
            Self::VShape { .. } => 2,
        }
    }

    /// Number of virtual stages, `p·v`.
    #[must_use]
    pub fn virtual_stages(self) -> usize {
        self.stages() * self.chunks()
    }

    /// The virtual stage that (`stage`, `chunk`) holds.
    #[must_use]
    pub fn virtual_stage(self, stage: usize, chunk: usize) -> usize {
        match self {
            Self::Interleaved { stages, .. } => chunk * stages + stage,
            Self::VShape { stages } => {
                if chunk == 0 {
                    stage
                } else {
                    2 * stages - 1 - stage
                }
            }
        }
    }

    /// The (stage, chunk) holding virtual stage `vs`.
    #[must_use]
    pub fn location(self, vs: usize) -> (usize, usize) {
        match self {
            Self::Interleaved { stages, .. } => (vs % stages, vs / stages),
            Self::VShape { stages } => {
                if vs < stages {
                    (vs, 0)
                } else {
                    (2 * stages - 1 - vs, 1)
                }
            }
        }
    }
}

/// A pipeline schedule: for each stage, the ordered list of actions it runs.
///
/// # Communication
/// Communication is implied by the dependencies: the forward of a
/// micro-batch through virtual stage `s` receives the output of virtual
/// stage `s − 1`, and its input-gradient backward (`B` or `BW`) receives
/// the gradient from virtual stage `s + 1` (the last virtual stage starts
/// from the loss). When producer and consumer sit on different stages that
/// is a send and a receive; on the same stage it is a local hand-over.
/// Sends are posted without waiting (buffered, like `isend` or a channel);
/// a receive blocks its stage until the message is there. Under these
/// semantics a schedule cannot deadlock exactly when the dependencies plus
/// each stage's list order form no cycle, which is what
/// [`validate`](crate::validate()) checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub(crate) name: String,
    pub(crate) microbatches: usize,
    pub(crate) placement: Placement,
    pub(crate) stages: Vec<Vec<Action>>,
}

impl Schedule {
    /// A schedule from explicit per-stage action lists (not yet validated:
    /// call [`validate`](crate::validate())).
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] when `placement` has no stages or no
    /// chunks, or `stages.len()` differs from the placement's stage count.
    pub fn new(
        name: impl Into<String>,
        microbatches: usize,
        placement: Placement,
        stages: Vec<Vec<Action>>,
    ) -> Result<Self> {
        if placement.stages() == 0 {
            return Err(Error::InvalidParameter {
                name: "stages",
                value: "0".into(),
                expected: "at least 1".into(),
            });
        }
        if placement.chunks() == 0 {
            return Err(Error::InvalidParameter {
                name: "chunks",
                value: "0".into(),
                expected: "at least 1".into(),
            });
        }
        if stages.len() != placement.stages() {
            return Err(Error::InvalidParameter {
                name: "stages",
                value: stages.len().to_string(),
                expected: format!("{} action lists, one per stage", placement.stages()),
            });
        }
        Ok(Self {
            name: name.into(),
            microbatches,
            placement,
            stages,
        })
    }

    /// The schedule's name (`1f1b`, `zb-h1`, ... or a user's).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Micro-batches `m`.
    #[must_use]
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }
    /// Stages `p`.
    #[must_use]
    pub fn num_stages(&self) -> usize {
        self.placement.stages()
    }
    /// Chunks per stage `v`.
    #[must_use]
    pub fn chunks(&self) -> usize {
        self.placement.chunks()
    }
    /// Where chunks sit.
    #[must_use]
    pub fn placement(&self) -> Placement {
        self.placement
    }
    /// The ordered actions of `stage`.
    ///
    /// # Panics
    /// When `stage >= num_stages()`.
    #[must_use]
    pub fn stage(&self, stage: usize) -> &[Action] {
        &self.stages[stage]
    }
    /// All stages' action lists.
    #[must_use]
    pub fn stages(&self) -> &[Vec<Action>] {
        &self.stages
    }
    /// A forward-only schedule (evaluation of a pipelined model, without
    /// gathering it anywhere) over `placement` — a training schedule's, so
    /// the stages it placed run it: on every stage the forwards of
    /// micro-batch 0 through each of its chunks in model order, then of
    /// micro-batch 1, and so on. Each micro-batch's activations are dropped
    /// after its forward, so one slot per chunk suffices.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] for zero stages, chunks or micro-batches.
    pub fn forward_only(placement: Placement, microbatches: usize) -> Result<Self> {
        if microbatches == 0 {
            return Err(Error::InvalidParameter {
                name: "microbatches",
                value: "0".into(),
                expected: "at least 1".into(),
            });
        }
        let stages = placement.stages();
        let lists: Vec<Vec<Action>> = (0..stages)
            .map(|i| {
                // this stage's chunks in the order a micro-batch reaches them
                let mut chunks: Vec<usize> = (0..placement.chunks()).collect();
                chunks.sort_by_key(|&c| placement.virtual_stage(i, c));
                (0..microbatches)
                    .flat_map(|mb| chunks.iter().map(move |&c| Action::forward(mb, c)))
                    .collect()
            })
            .collect();
        Self::new("forward", microbatches, placement, lists)
    }

    /// Whether the schedule runs forwards only (no action is a backward):
    /// the executor then drops each micro-batch after its forward.
    #[must_use]
    pub fn is_forward_only(&self) -> bool {
        self.stages
            .iter()
            .flatten()
            .all(|a| a.kind == ActionKind::Forward)
    }

    /// Whether any action splits the backward into `B` and `W`.
    #[must_use]
    pub fn splits_backward(&self) -> bool {
        self.stages.iter().flatten().any(|a| {
            matches!(
                a.kind,
                ActionKind::BackwardInput | ActionKind::BackwardWeight
            )
        })
    }

    /// Peak number of activation chunks alive on each stage: forwards done
    /// whose backward is not finished (`BW`, or `W` for a split backward).
    /// It depends on list order only, not on timing. One chunk holds `1/v`
    /// of a stage's layers, so for `v = 1` this is micro-batches in flight.
    #[must_use]
    pub fn peak_in_flight(&self) -> Vec<usize> {
        if self.is_forward_only() {
            return vec![usize::from(self.microbatches > 0); self.stages.len()];
        }
        self.stages
            .iter()
            .map(|list| {
                let (mut now, mut peak) = (0usize, 0usize);
                for a in list {
                    match a.kind {
                        ActionKind::Forward => {
                            now += 1;
                            peak = peak.max(now);
                        }
                        ActionKind::Backward | ActionKind::BackwardWeight => {
                            now = now.saturating_sub(1);
                        }
                        ActionKind::BackwardInput => {}
                    }
                }
                peak
            })
            .collect()
    }

    /// Parse the text format written by [`Display`](fmt::Display):
    ///
    /// ```text
    /// # comments and blank lines are ignored
    /// name 1f1b
    /// microbatches 4
    /// placement interleaved stages=2 chunks=1     (or: placement v stages=2)
    /// stage 0: F0 F1 BW0 F2 BW1 F3 BW2 BW3
    /// stage 1: F0 BW0 F1 BW1 F2 BW2 F3 BW3
    /// ```
    ///
    /// Actions are `F`, `B`, `W` or `BW` followed by the micro-batch and,
    /// for chunks other than 0, `.chunk` (`F3.1`). The result is not
    /// validated: call [`validate`](crate::validate()).
    ///
    /// # Errors
    /// [`Error::Parse`] naming the line and what was expected.
    pub fn parse(text: &str) -> Result<Self> {
        let mut name = String::from("custom");
        let mut microbatches = None;
        let mut placement = None;
        let mut stages: Vec<Option<Vec<Action>>> = Vec::new();
        let perr = |line: usize, message: String| Error::Parse { line, message };
        for (i, raw) in text.lines().enumerate() {
            let line_no = i + 1;
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let (head, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
            let rest = rest.trim();
            match head {
                "name" => name = rest.to_owned(),
                "microbatches" => {
                    microbatches = Some(rest.parse::<usize>().map_err(|_| {
                        perr(
                            line_no,
                            format!("microbatches {rest:?}: expected a non-negative integer"),
                        )
                    })?);
                }
                "placement" => {
                    let p = parse_placement(rest).map_err(|m| perr(line_no, m))?;
                    stages = vec![None; p.stages()];
                    placement = Some(p);
                }
                "stage" => {
                    let Some(p) = placement else {
                        return Err(perr(
                            line_no,
                            "a `placement` line must come before the stages".into(),
                        ));
                    };
                    let (idx, actions) = rest.split_once(':').ok_or_else(|| {
                        perr(line_no, "expected `stage N: ACTION ACTION ...`".into())
                    })?;
                    let idx: usize = idx.trim().parse().map_err(|_| {
                        perr(
                            line_no,
                            format!("stage index {:?} is not an integer", idx.trim()),
                        )
                    })?;
                    if idx >= p.stages() {
                        return Err(perr(
                            line_no,
                            format!(
                                "stage {idx} out of range: the placement has {} stages",
                                p.stages()
                            ),
                        ));
                    }
                    if stages[idx].is_some() {
                        return Err(perr(line_no, format!("stage {idx} listed twice")));
                    }
                    let list = actions
                        .split_whitespace()
                        .map(|t| t.parse::<Action>().map_err(|m| perr(line_no, m)))
                        .collect::<Result<Vec<_>>>()?;
                    stages[idx] = Some(list);
                }
                other => {
                    return Err(perr(
                        line_no,
                        format!(
                            "unknown keyword {other:?} (expected name, microbatches, placement or stage)"
                        ),
                    ));
                }
            }
        }
        let last = text.lines().count().max(1);
        let placement = placement.ok_or_else(|| perr(last, "no `placement` line".into()))?;
        let microbatches =
            microbatches.ok_or_else(|| perr(last, "no `microbatches` line".into()))?;
        let stages = stages
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.ok_or_else(|| perr(last, format!("stage {i} is not listed"))))
            .collect::<Result<Vec<_>>>()?;
        Self::new(name, microbatches, placement, stages)
    }
}

fn parse_placement(rest: &str) -> Result<Placement, String> {
    let mut words = rest.split_whitespace();
    let layout = words.next().unwrap_or("");
    let (mut stages, mut chunks) = (None, None);
    for w in words {
        let (k, v) = w
            .split_once('=')
            .ok_or_else(|| format!("{w:?}: expected key=value"))?;
        let n: usize = v
            .parse()
            .map_err(|_| format!("{k} = {v:?}: expected a positive integer"))?;
        if n == 0 {
            return Err(format!("{k} = 0: expected a positive integer"));
        }
        match k {
            "stages" => stages = Some(n),
            "chunks" => chunks = Some(n),
            _ => {
                return Err(format!(
                    "unknown placement key {k:?} (expected stages, chunks)"
                ));
            }
        }
    }
    let stages = stages.ok_or("placement needs stages=N")?;
    match layout {
        "interleaved" => Ok(Placement::Interleaved {
            stages,
            chunks: chunks.unwrap_or(1),
        }),
        "v" => match chunks {
            None | Some(2) => Ok(Placement::VShape { stages }),
            Some(c) => Err(format!("placement v has 2 chunks per stage, not {c}")),
        },
        other => Err(format!(
            "unknown placement {other:?} (expected `interleaved` or `v`)"
        )),
    }
}

impl fmt::Display for Schedule {
    /// The text format read by [`Schedule::parse`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "name {}", self.name)?;
        writeln!(f, "microbatches {}", self.microbatches)?;
        match self.placement {
            Placement::Interleaved { stages, chunks } => {
                writeln!(f, "placement interleaved stages={stages} chunks={chunks}")?;
            }
            Placement::VShape { stages } => writeln!(f, "placement v stages={stages}")?,
        }
        for (i, list) in self.stages.iter().enumerate() {
            write!(f, "stage {i}:")?;
            for a in list {
                write!(f, " {a}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_print_and_parse() {
        for a in [
            Action::forward(3, 0),
            Action::backward(0, 0),
            Action::backward_input(12, 1),
            Action::backward_weight(7, 3),
        ] {
            assert_eq!(a.to_string().parse::<Action>().unwrap(), a);
        }
        assert_eq!(Action::forward(3, 1).to_string(), "F3.1");
        assert!(
            "X3".parse::<Action>()
                .unwrap_err()
                .contains("unknown action")
        );
        assert!(
            "F".parse::<Action>()
                .unwrap_err()
                .contains("no micro-batch")
        );
        assert!("F3.x".parse::<Action>().unwrap_err().contains("\"x\""));
    }

    #[test]
    fn placements_are_bijections() {
        for p in [
            Placement::Interleaved {
                stages: 4,
                chunks: 3,
            },
            Placement::VShape { stages: 5 },
        ] {
            let mut seen = vec![false; p.virtual_stages()];
            for s in 0..p.stages() {
                for c in 0..p.chunks() {
                    let vs = p.virtual_stage(s, c);
                    assert!(!seen[vs]);
                    seen[vs] = true;
                    assert_eq!(p.location(vs), (s, c));
                }
            }
        }
        let v = Placement::VShape { stages: 4 };
        assert_eq!(v.virtual_stage(0, 1), 7);
        assert_eq!(v.virtual_stage(3, 0), 3);
        assert_eq!(v.virtual_stage(3, 1), 4);
    }

    #[test]
    fn text_round_trip_and_errors_name_the_line() {
        let text = "# two stages\nname demo\nmicrobatches 2\nplacement interleaved stages=2\nstage 0: F0 F1 BW0 BW1\nstage 1: F0 BW0 F1 BW1\n";
        let s = Schedule::parse(text).unwrap();
        assert_eq!(s.num_stages(), 2);
        assert_eq!(s.stage(1)[1], Action::backward(0, 0));
        assert_eq!(Schedule::parse(&s.to_string()).unwrap(), s);
        assert_eq!(s.peak_in_flight(), vec![2, 1]);

        let bad = "microbatches 2\nplacement interleaved stages=2\nstage 0: F0 Q1\n";
        let err = Schedule::parse(bad).unwrap_err();
        assert!(matches!(err, Error::Parse { line: 3, .. }), "{err}");
        assert!(err.to_string().contains("unknown action"), "{err}");
        let err = Schedule::parse("microbatches 2\nplacement interleaved stages=2\nstage 0: F0\n")
            .unwrap_err();
        assert!(err.to_string().contains("stage 1 is not listed"), "{err}");
        let err = Schedule::parse("placement v stages=2 chunks=3\n").unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        let err = Schedule::parse("stage 0: F0\n").unwrap_err();
        assert!(err.to_string().contains("placement"), "{err}");
    }
}
