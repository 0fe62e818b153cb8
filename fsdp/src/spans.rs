//! The span log: what ran when, on the compute and communication tracks.

use std::time::Instant;

use weft_trace::TraceEvent;

/// Which track a span belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Track {
    /// Model computation (and the optimizer) on the training thread.
    Compute,
    /// A collective, from the moment it was issued until it completed (on
    /// its own progress thread, so it may overlap compute spans).
    Comm,
    /// Time the training thread spent blocked waiting for a collective:
    /// the *exposed* communication.
    Wait,
}

impl Track {
    /// The thread id used for the track in Chrome traces.
    pub const fn tid(self) -> u64 {
        match self {
            Track::Compute => 0,
            Track::Comm => 1,
            Track::Wait => 2,
        }
    }

    /// The track's name.
    pub const fn name(self) -> &'static str {
        match self {
            Track::Compute => "compute",
            Track::Comm => "comm",
            Track::Wait => "comm wait",
        }
    }
}

/// One timed operation.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// Its track.
    pub track: Track,
    /// What ran: `forward`, `backward`, `all_gather`, `reduce_scatter`,
    /// `all_reduce`, `optimizer`, ...
    pub op: &'static str,
    /// The unit it worked on, if any.
    pub unit: Option<usize>,
    /// The micro-batch (local index), if any.
    pub micro: Option<usize>,
    /// Start, seconds since the FSDP state was built.
    pub start: f64,
    /// End, seconds since the FSDP state was built.
    pub end: f64,
}

/// The spans of the steps since the last [`clear`](Self::clear).
#[derive(Clone, Debug)]
pub struct SpanLog {
    epoch: Instant,
    spans: Vec<Span>,
    enabled: bool,
}

impl SpanLog {
    pub(crate) fn new() -> Self {
        SpanLog {
            epoch: Instant::now(),
            spans: Vec::new(),
            enabled: true,
        }
    }

    /// The instant times are measured from.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Every span recorded, in the order they ended.
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// Forgets the recorded spans (the trainer calls it after writing them).
    pub fn clear(&mut self) {
        self.spans.clear();
    }

    /// Turns recording on or off (on by default).
    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
    }

    pub(crate) fn secs(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.epoch).as_secs_f64()
    }

    pub(crate) fn push(
        &mut self,
        track: Track,
        op: &'static str,
        unit: Option<usize>,
        micro: Option<usize>,
        start: Instant,
        end: Instant,
    ) {
        if self.enabled {
            let (start, end) = (self.secs(start), self.secs(end));
            self.spans.push(Span {
                track,
                op,
                unit,
                micro,
                start,
                end,
            });
        }
    }

    /// Seconds on `track`, summed over its spans.
    pub fn total(&self, track: Track) -> f64 {
        self.spans
            .iter()
            .filter(|s| s.track == track)
            .map(|s| s.end - s.start)
            .sum()
    }

    /// Chrome trace events for the spans: process `pid`, one thread per
    /// [`Track`] (named), times in µs since the FSDP state's epoch plus
    /// `offset_us` (to place them on the trainer's own clock). Each event
    /// carries `unit` and `micro` arguments.
    pub fn trace_events(&self, pid: u64, offset_us: f64) -> Vec<TraceEvent> {
        let mut out: Vec<TraceEvent> = [Track::Compute, Track::Comm, Track::Wait]
            .into_iter()
            .map(|t| TraceEvent::thread_name(pid, t.tid(), t.name()))
            .collect();
        for s in &self.spans {
            let mut e = TraceEvent::complete(
                s.op,
                offset_us + s.start * 1e6,
                (s.end - s.start) * 1e6,
                pid,
                s.track.tid(),
            )
            .with_cat(if s.track == Track::Compute {
                "fsdp.compute"
            } else {
                "fsdp.comm"
            });
            if let Some(u) = s.unit {
                e = e.with_arg("unit", u as i64);
            }
            if let Some(m) = s.micro {
                e = e.with_arg("micro", m as i64);
            }
            out.push(e);
        }
        out
    }

    /// The spans as lanes of one model chunk of a rank in a job's trace:
    /// [`trace_events`](Self::trace_events) placed on a clock that
    /// started at `origin` (µs), on threads `first_tid + 3·chunk + track`
    /// (named `fsdp compute`, or `fsdp chunk 1 compute` past the first
    /// chunk), each slice carrying its training `step` in `args.step`.
    /// The process is 0: the caller sets it.
    #[must_use]
    pub fn lanes(
        &self,
        chunk: usize,
        first_tid: u64,
        origin: Instant,
        step: u64,
    ) -> Vec<TraceEvent> {
        let offset = if self.epoch >= origin {
            self.epoch.duration_since(origin).as_secs_f64()
        } else {
            -origin.duration_since(self.epoch).as_secs_f64()
        };
        let base = first_tid + 3 * chunk as u64;
        self.trace_events(0, offset * 1e6)
            .into_iter()
            .map(|mut e| {
                e.tid += base;
                if e.ph == weft_trace::Phase::Complete {
                    e.args.insert("step".to_owned(), step.into());
                    return e;
                }
                let name = e
                    .args
                    .get("name")
                    .and_then(weft_trace::ArgValue::as_str)
                    .unwrap_or("track")
                    .to_owned();
                let name = if chunk > 0 {
                    format!("fsdp chunk {chunk} {name}")
                } else {
                    format!("fsdp {name}")
                };
                TraceEvent::thread_name(e.pid, e.tid, name)
            })
            .collect()
    }
}
