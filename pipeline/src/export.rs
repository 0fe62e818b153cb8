//! Timelines as Chrome trace events.

use weft_trace::{ArgValue, DisplayTimeUnit, Trace, TraceEvent};

use crate::schedule::ActionKind;
use crate::simulate::Timeline;

impl Timeline {
    /// The timeline as Chrome trace events (`trace.json`, open in Perfetto
    /// or weft's visualizer): one process per stage (`pid` = stage, named
    /// `stage i`), complete slices named `F`, `B`, `W` or `BW` with args
    /// `microbatch`, `chunk` and `virtual_stage`, an explicit `idle` slice
    /// for every gap up to the makespan, and an `activation memory` counter
    /// per stage. `us_per_unit` converts the costs' time unit to
    /// microseconds (1000 if a unit is a millisecond).
    #[must_use]
    pub fn to_trace(&self, us_per_unit: f64) -> Trace {
        let mut t = Trace::new();
        t.display_time_unit = Some(DisplayTimeUnit::Milliseconds);
        let other = [
            ("schedule", ArgValue::from(self.name())),
            ("stages", self.num_stages().into()),
            ("microbatches", self.microbatches().into()),
            ("chunks", self.chunks().into()),
            ("makespan_us", (self.makespan() * us_per_unit).into()),
            ("bubble_fraction", self.bubble_fraction().into()),
        ];
        t.other_data = other.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        let end = self.makespan();
        for stage in 0..self.num_stages() {
            let pid = stage as u64;
            t.push(TraceEvent::process_name(pid, format!("stage {stage}")));
            t.push(TraceEvent::process_sort_index(
                pid,
                i64::try_from(stage).unwrap_or(i64::MAX),
            ));
            t.push(TraceEvent::thread_name(pid, 0, "compute"));
            let mut clock = 0.0f64;
            let idle = |t: &mut Trace, from: f64, to: f64| {
                if to > from {
                    t.push(
                        TraceEvent::complete(
                            "idle",
                            from * us_per_unit,
                            (to - from) * us_per_unit,
                            pid,
                            0,
                        )
                        .with_cat("idle")
                        .with_cname("grey"),
                    );
                }
            };
            for (slot, mem) in self.slots(stage).iter().zip(self.memory_after(stage)) {
                idle(&mut t, clock, slot.start);
                let a = slot.action;
                let (cat, cname) = match a.kind {
                    ActionKind::Forward => ("forward", "thread_state_running"),
                    ActionKind::Backward => ("backward", "thread_state_iowait"),
                    ActionKind::BackwardInput => ("backward", "rail_response"),
                    ActionKind::BackwardWeight => ("backward", "rail_load"),
                };
                t.push(
                    TraceEvent::complete(
                        a.kind.symbol(),
                        slot.start * us_per_unit,
                        (slot.end - slot.start) * us_per_unit,
                        pid,
                        0,
                    )
                    .with_cat(cat)
                    .with_cname(cname)
                    .with_arg("microbatch", a.microbatch)
                    .with_arg("chunk", a.chunk)
                    .with_arg("virtual_stage", slot.virtual_stage),
                );
                t.push(TraceEvent::counter(
                    "activation memory",
                    slot.end * us_per_unit,
                    pid,
                    [("activations", *mem)],
                ));
                clock = slot.end;
            }
            idle(&mut t, clock, end);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use crate::{Costs, ScheduleKind, simulate};

    #[test]
    fn trace_covers_every_stage_without_gaps() {
        let s = ScheduleKind::ZbH1.generate(3, 4, 1).unwrap();
        let tl = simulate(&s, &Costs::per_stage(&s, 1.0, 1.0, 1.0, 0.0)).unwrap();
        let tr = tl.to_trace(1000.0);
        tr.check().unwrap();
        assert_eq!(tr.process_names()[&2], "stage 2");
        for stage in 0..3u64 {
            let mut slices: Vec<_> = tr.complete_events().filter(|e| e.pid == stage).collect();
            slices.sort_by(|a, b| a.ts.total_cmp(&b.ts));
            // Work plus explicit idle tiles [0, makespan] exactly.
            let mut clock = 0.0;
            for e in &slices {
                assert!(
                    (e.ts - clock).abs() < 1e-9,
                    "gap before {} at {}",
                    e.name,
                    e.ts
                );
                clock = e.end();
            }
            assert!((clock - tl.makespan() * 1000.0).abs() < 1e-9);
            let work = slices.iter().filter(|e| e.name != "idle").count();
            assert_eq!(work, 3 * 4);
        }
        let f = tr.complete_events().find(|e| e.name == "W").unwrap();
        assert!(f.args.contains_key("microbatch") && f.args.contains_key("chunk"));
        // And it is valid JSON that reads back.
        let json = serde_json::to_string(&tr).unwrap();
        assert_eq!(
            serde_json::from_str::<weft_trace::Trace>(&json).unwrap(),
            tr
        );
    }
}
