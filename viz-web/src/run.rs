//! What the page knows about a run: one slot per file, filled by
//! [`Run::ingest`] from a name and its text (fetched from the server or
//! dropped onto the page); and about several runs shown together
//! ([`Runs`]: each with the name of its legend).

use std::rc::Rc;

use weft_compare::load::{self, FileKind, Marker, MetricsLog};
use weft_compare::{LoadError, Warning};
use weft_trace::{MetricsEventKind, RunEvent};

use crate::expert::ExpertLoad;
use crate::timeline::Timeline;

/// The state of one file of the run.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Slot<T> {
    /// Not given (yet).
    #[default]
    Absent,
    /// Loaded, with the warnings of loading it.
    Loaded(Rc<T>, Vec<Warning>),
    /// Given but unusable.
    Failed(LoadError),
}

impl<T> Slot<T> {
    /// The value, when loaded.
    #[must_use]
    pub fn get(&self) -> Option<&Rc<T>> {
        match self {
            Self::Loaded(v, _) => Some(v),
            _ => None,
        }
    }
}

fn slot<T>(r: Result<(T, Vec<Warning>), LoadError>) -> Slot<T> {
    match r {
        Ok((v, w)) => Slot::Loaded(Rc::new(v), w),
        Err(e) => Slot::Failed(e),
    }
}

/// Every run file the page has been given.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Run {
    /// `trace.json`.
    pub trace: Slot<Timeline>,
    /// A second trace, drawn below the first for comparison.
    pub compare: Slot<Timeline>,
    /// `metrics.jsonl`.
    pub metrics: Slot<MetricsLog>,
    /// `expert_load.jsonl`.
    pub expert: Slot<ExpertLoad>,
    /// `config.toml`, as text.
    pub config: Slot<String>,
    /// `summary.json`, flattened.
    pub summary: Slot<Vec<(String, String)>>,
    /// `events.jsonl`: the supervisor's and the trainer's health and
    /// recovery events.
    pub events: Slot<Vec<RunEvent>>,
    /// Files that matched no slot.
    pub rejected: Vec<LoadError>,
    /// Names given, in order.
    pub files: Vec<String>,
}

impl Run {
    /// Parse `text` as the run file `name` and put it in its slot. A
    /// second trace goes to [`Run::compare`] (a third replaces it).
    pub fn ingest(&mut self, name: &str, text: &str) {
        self.files.push(name.to_owned());
        match FileKind::detect(name, text) {
            Some(FileKind::Trace) => {
                let s = slot(
                    load::parse_trace(name, text).map(|t| (Timeline::new(name, t), Vec::new())),
                );
                if matches!(self.trace, Slot::Loaded(..)) && matches!(s, Slot::Loaded(..)) {
                    self.compare = s;
                } else {
                    self.trace = s;
                }
            }
            Some(FileKind::Metrics) => self.metrics = slot(load::parse_metrics(name, text)),
            Some(FileKind::ExpertLoad) => {
                self.expert = slot(
                    load::parse_expert_load(name, text)
                        .and_then(|(r, w)| ExpertLoad::new(name, &r).map(|x| (x, w))),
                );
            }
            Some(FileKind::Config) => {
                self.config = Slot::Loaded(Rc::new(text.to_owned()), Vec::new());
            }
            Some(FileKind::Summary) => {
                self.summary = slot(load::parse_summary(name, text).map(|s| (s, Vec::new())));
            }
            Some(FileKind::Events) => self.events = slot(load::parse_events(name, text)),
            None => self.rejected.push(LoadError::Unrecognized {
                file: name.to_owned(),
            }),
        }
    }

    /// The corpus' loss floor, if the summary or config gives one.
    #[must_use]
    pub fn entropy_floor(&self) -> Option<f64> {
        let summary: &[(String, String)] = self.summary.get().map_or(&[], |s| s.as_slice());
        load::entropy_floor(summary, self.config.get().map(|c| c.as_str()))
    }

    /// Every load error, for the banner.
    #[must_use]
    pub fn errors(&self) -> Vec<LoadError> {
        let mut out = Vec::new();
        let mut take = |e: Option<&LoadError>| out.extend(e.cloned());
        fn err<T>(s: &Slot<T>) -> Option<&LoadError> {
            match s {
                Slot::Failed(e) => Some(e),
                _ => None,
            }
        }
        take(err(&self.trace));
        take(err(&self.compare));
        take(err(&self.metrics));
        take(err(&self.expert));
        take(err(&self.summary));
        take(err(&self.events));
        out.extend(self.rejected.iter().cloned());
        out
    }

    /// Every warning, for the banner.
    #[must_use]
    pub fn warnings(&self) -> Vec<Warning> {
        fn w<T>(s: &Slot<T>) -> &[Warning] {
            match s {
                Slot::Loaded(_, w) => w,
                _ => &[],
            }
        }
        [w(&self.metrics), w(&self.expert), w(&self.events)].concat()
    }

    /// The health and recovery events to mark on the metrics charts, by
    /// step: `metrics.jsonl`'s (skips, overflows, spikes, ...) and those of
    /// `events.jsonl` that have a step (failures, restarts, rewinds,
    /// stragglers, ...); at equal steps the metrics file's first.
    /// Evaluations are not among them: they are the loss chart's
    /// evaluation curve.
    #[must_use]
    pub fn markers(&self) -> Vec<Marker> {
        let metrics = self
            .metrics
            .get()
            .into_iter()
            .flat_map(|m| &m.events)
            .filter(|e| !matches!(e.kind, MetricsEventKind::Eval { .. }));
        let events = self.events.get().into_iter().flat_map(|e| e.iter());
        let mut out: Vec<Marker> = metrics
            .map(Marker::of_metrics)
            .chain(events.filter_map(Marker::of_run))
            .collect();
        out.sort_by_key(|m| m.step);
        out
    }
}

/// A run with the name the page shows for it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NamedRun {
    /// The legend's name.
    pub name: String,
    /// Its files.
    pub run: Run,
}

/// The runs on the page, in the order served; never empty. The first is
/// the one the others are compared with, and the one dropped files join.
#[derive(Debug, Clone, PartialEq)]
pub struct Runs(Vec<NamedRun>);

impl Default for Runs {
    fn default() -> Self {
        Self(vec![NamedRun {
            name: "run".to_owned(),
            run: Run::default(),
        }])
    }
}

impl From<Run> for Runs {
    /// One run, named `run`.
    fn from(run: Run) -> Self {
        Self(vec![NamedRun {
            name: "run".to_owned(),
            run,
        }])
    }
}

impl Runs {
    /// Runs from `(name, run)` pairs; `None` when there are none.
    #[must_use]
    pub fn new(runs: Vec<(String, Run)>) -> Option<Self> {
        if runs.is_empty() {
            return None;
        }
        Some(Self(
            runs.into_iter()
                .map(|(name, run)| NamedRun { name, run })
                .collect(),
        ))
    }

    /// The first run.
    #[must_use]
    pub fn first(&self) -> &NamedRun {
        &self.0[0]
    }

    /// Every run, in order.
    #[must_use]
    pub fn all(&self) -> &[NamedRun] {
        &self.0
    }

    /// Name the runs as the server listed them: runs beyond those present
    /// are added empty, names replace the current ones.
    pub fn name(&mut self, names: &[String]) {
        for (i, n) in names.iter().enumerate() {
            if i >= self.0.len() {
                self.0.push(NamedRun::default());
            }
            n.clone_into(&mut self.0[i].name);
        }
    }

    /// Parse `text` as run `index`'s file `name` ([`Run::ingest`]); a run
    /// not yet listed is added, named by its position.
    pub fn ingest(&mut self, index: usize, name: &str, text: &str) {
        while self.0.len() <= index {
            let n = self.0.len() + 1;
            self.0.push(NamedRun {
                name: format!("run {n}"),
                run: Run::default(),
            });
        }
        self.0[index].run.ingest(name, text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ingest_routes_and_keeps_errors() {
        let mut r = Run::default();
        r.ingest(
            "trace.json",
            "{\"traceEvents\":[{\"name\":\"F\",\"ph\":\"X\",\"ts\":0,\"dur\":1}]}",
        );
        r.ingest(
            "other.trace.json",
            "{\"traceEvents\":[{\"name\":\"B\",\"ph\":\"X\",\"ts\":0,\"dur\":2}]}",
        );
        assert!(r.trace.get().is_some() && r.compare.get().is_some());
        r.ingest(
            "expert_load.jsonl",
            "{\"step\":1,\"layer\":0,\"tokens_per_expert\":[1,2],\"dropped\":0}\n{\"step\"",
        );
        assert_eq!(r.expert.get().unwrap().experts, 2);
        assert_eq!(r.warnings().len(), 1);
        r.ingest("metrics.jsonl", "{\"step\":1,\"loss\":[]}\n");
        assert!(matches!(
            &r.metrics,
            Slot::Failed(LoadError::Schema { line: 1, .. })
        ));
        r.ingest("summary.json", "{\"entropy_floor\": 1.5}");
        r.ingest("photo.png", "\u{89}PNG");
        assert_eq!(r.entropy_floor(), Some(1.5));
        let errs = r.errors();
        assert_eq!(errs.len(), 2);
        assert_eq!(errs[1].file(), "photo.png");
    }

    #[test]
    fn events_with_a_step_join_the_metrics_timeline() {
        let mut e = Run::default();
        e.ingest(
            "events.jsonl",
            concat!(
                "{\"time\":1.0,\"event\":\"start\",\"attempt\":0,\"resume\":false,\"pid\":100,\"dp\":2,\"ranks\":2}\n",
                "{\"time\":2.0,\"event\":\"failure\",\"attempt\":0,\"failure\":\"signal 9\",\"last_step\":36,\"rank\":null}\n",
                "{\"time\":2.1,\"event\":\"restart\",\"attempt\":1,\"from_checkpoint_step\":30,\"unverified_checkpoints\":[],\"lost_steps\":6,\"action\":\"restart\",\"dp\":2,\"ranks\":2,\"spares_left\":null,\"excluded_hosts\":[]}\n",
                "{\"time\":3.0,\"event\":\"rewind\",\"step\":45,\"reason\":\"spike\",\"to_step\":40,\"skipped_batches\":[41],\"rewinds\":1}\n",
            ),
        );
        assert_eq!(e.events.get().unwrap().len(), 4);
        let kinds: Vec<(String, u64)> = e.markers().into_iter().map(|m| (m.kind, m.step)).collect();
        assert_eq!(
            kinds,
            [
                ("restart".into(), 30),
                ("failure".into(), 36),
                ("rewind".into(), 45)
            ]
        );
        assert!(
            e.markers()[1].detail.iter().all(|(k, _)| k != "rank"),
            "nulls dropped"
        );
        e.ingest(
            "metrics.jsonl",
            concat!(
                "{\"step\":40,\"event\":\"eval\",\"val_loss\":2.0}\n",
                "{\"step\":40,\"event\":\"spike\",\"loss\":5,\"median\":2,\"batch\":{\"step\":40,\"micro_batches\":1}}\n",
            ),
        );
        // the evaluation is the loss chart's curve, not a health event
        let markers = e.markers();
        let marks: Vec<(u64, &str)> = markers.iter().map(|m| (m.step, m.kind.as_str())).collect();
        assert_eq!(
            marks,
            [
                (30, "restart"),
                (36, "failure"),
                (40, "spike"),
                (45, "rewind")
            ]
        );
        e.ingest("events.jsonl", "{\"time\":1}\n{\"event\":\"x\"}\n");
        assert!(matches!(
            &e.events,
            Slot::Failed(LoadError::Schema { line: 1, .. })
        ));
    }

    #[test]
    fn runs_are_named_by_the_listing_and_filled_by_index() {
        let mut runs = Runs::default();
        runs.ingest(0, "config.toml", "a = 1\n");
        runs.name(&["base".into(), "seed-2".into()]);
        runs.ingest(1, "config.toml", "a = 2\n");
        runs.ingest(3, "config.toml", "a = 3\n");
        let names: Vec<&str> = runs.all().iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["base", "seed-2", "run 3", "run 4"]);
        assert!(runs.first().run.config.get().is_some());
        assert!(Runs::new(Vec::new()).is_none());
    }
}
