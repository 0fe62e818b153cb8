//! The yew components: the app shell and its four views.

use std::rc::Rc;

use yew::prelude::*;

use weft_compare::LoadError;
use weft_compare::chart::{self, Frame};
use weft_compare::load::{FileKind, Marker, MetricsLog};
use weft_compare::stats::{self, StepDiff};
use weft_trace::MetricsEventKind;

use crate::expert::{ExpertLoad, LayerSel};
use crate::plot;
use crate::run::{NamedRun, Run, Runs, Slot};
use crate::timeline::{self, SliceKind, Timeline};
use crate::web;

/// Width of the drawings in SVG user units (they scale to the page).
const W: f64 = 1200.0;
/// Width of the label column of the expert charts, and the least width of
/// the timeline's label columns ([`label_columns`]).
const LEFT: f64 = 132.0;
/// Width of one character of a lane name (11 px, semi-bold) in SVG units:
/// an upper estimate over the fonts a browser picks for `system-ui`.
const NAME_CHAR_W: f64 = 6.6;
/// Width of one character of a group label (10 px).
const GROUP_CHAR_W: f64 = 6.2;
/// Height of one lane.
const LANE_H: f64 = 26.0;
/// Height of the time axis.
const AXIS_H: f64 = 20.0;

/// A message to the runs reducer.
enum Msg {
    /// A file dropped or opened: it joins the first run.
    Dropped(String, String),
    /// What the server sent.
    Fetched(web::Fetched),
}

#[derive(Default, PartialEq)]
struct RunState(Runs);

impl Reducible for RunState {
    type Action = Msg;
    fn reduce(self: Rc<Self>, m: Msg) -> Rc<Self> {
        let mut runs = self.0.clone();
        match m {
            Msg::Dropped(name, text) => runs.ingest(0, &name, &text),
            Msg::Fetched(web::Fetched::Names(names)) => runs.name(&names),
            Msg::Fetched(web::Fetched::File { run, name, text }) => runs.ingest(run, &name, &text),
        }
        Rc::new(Self(runs))
    }
}

/// Stroke colours of the runs, in order (then again).
const RUN_COLOURS: [&str; 8] = [
    "#3b7dd8", "#e8a33d", "#9c36b5", "#c92a2a", "#1098ad", "#5c940d", "#495057", "#d6336c",
];

/// The colour of run `i`.
fn run_colour(i: usize) -> &'static str {
    RUN_COLOURS[i % RUN_COLOURS.len()]
}

/// The page's tabs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tab {
    /// Config, summary and file status.
    Overview,
    /// The pipeline timeline.
    Pipeline,
    /// The expert-load heatmap.
    Experts,
    /// Loss, learning rate, grad norm, throughput.
    Metrics,
}

impl Tab {
    const ALL: [Self; 4] = [Self::Overview, Self::Pipeline, Self::Experts, Self::Metrics];
    fn label(self) -> &'static str {
        match self {
            Self::Overview => "Overview",
            Self::Pipeline => "Pipeline",
            Self::Experts => "Expert load",
            Self::Metrics => "Metrics",
        }
    }
    fn id(self) -> &'static str {
        match self {
            Self::Overview => "tab-overview",
            Self::Pipeline => "tab-pipeline",
            Self::Experts => "tab-experts",
            Self::Metrics => "tab-metrics",
        }
    }
}

/// Properties of [`App`].
#[derive(Properties, PartialEq, Clone)]
pub struct AppProps {
    /// Runs already loaded (tests render prepared runs; a single [`Run`]
    /// converts with `.into()`).
    #[prop_or_default]
    pub initial: Runs,
    /// Fetch the runs' files from the server on start.
    #[prop_or(true)]
    pub fetch: bool,
    /// Tab to open; by default the first view that has data.
    #[prop_or_default]
    pub tab: Option<Tab>,
}

/// The whole page.
#[component]
pub fn App(props: &AppProps) -> Html {
    let run = {
        let initial = props.initial.clone();
        use_reducer(move || RunState(initial))
    };
    let tab = use_state(|| props.tab);
    let on_file = {
        let run = run.dispatcher();
        Callback::from(move |(name, text): (String, String)| run.dispatch(Msg::Dropped(name, text)))
    };
    {
        let run = run.dispatcher();
        let fetch = props.fetch;
        use_effect_with((), move |()| {
            if fetch {
                web::fetch_runs(Callback::from(move |f| run.dispatch(Msg::Fetched(f))));
            }
        });
    }
    let runs = &run.0;
    let r = &runs.first().run;
    // a second run's trace is drawn below the first, as a second trace is
    let second = runs.all().get(1).and_then(|n| n.run.trace.get());
    let auto = if r.trace.get().is_some() {
        Tab::Pipeline
    } else if r.expert.get().is_some() {
        Tab::Experts
    } else if r.metrics.get().is_some() {
        Tab::Metrics
    } else {
        Tab::Overview
    };
    let current = tab.unwrap_or(auto);
    let ondrop = {
        let on_file = on_file.clone();
        Callback::from(move |e: DragEvent| web::read_dropped(&e, on_file.clone()))
    };
    let ondragover = Callback::from(|e: DragEvent| e.prevent_default());
    let onchange = {
        let on_file = on_file.clone();
        Callback::from(move |e: Event| web::read_input(&e, on_file.clone()))
    };
    let tabs = Tab::ALL.iter().map(|t| {
        let tab = tab.clone();
        let t = *t;
        let class = if t == current { "tab active" } else { "tab" };
        html! { <button id={t.id()} class={class} onclick={move |_| tab.set(Some(t))}>{ t.label() }</button> }
    });
    let several = runs.all().len() > 1;
    let named = |n: &NamedRun, s: String| {
        if several {
            format!("{}: {s}", n.name)
        } else {
            s
        }
    };
    let errors: Vec<(String, String)> = runs
        .all()
        .iter()
        .flat_map(|n| n.run.errors().into_iter().map(move |e| (n, e)))
        .map(|(n, e)| (e.file().to_owned(), named(n, e.to_string())))
        .collect();
    let warnings: Vec<String> = runs
        .all()
        .iter()
        .flat_map(|n| n.run.warnings().into_iter().map(move |w| (n, w)))
        .map(|(n, w)| named(n, w.to_string()))
        .collect();
    let body = match current {
        Tab::Overview => {
            html! { <OverviewView run={Rc::new(r.clone())} runs={Rc::new(runs.clone())} /> }
        }
        Tab::Pipeline => match (&r.trace, r.compare.get().or(second)) {
            (Slot::Loaded(a, _), b) => html! { <PipelineView a={a.clone()} b={b.cloned()} /> },
            (Slot::Failed(e), _) => missing_view("pipeline", Some(e)),
            (Slot::Absent, _) => missing_view("trace.json", None),
        },
        Tab::Experts => match &r.expert {
            Slot::Loaded(x, _) => html! { <ExpertView data={x.clone()} /> },
            Slot::Failed(e) => missing_view("expert load", Some(e)),
            Slot::Absent => missing_view("expert_load.jsonl", None),
        },
        Tab::Metrics => match &r.metrics {
            Slot::Loaded(..) => {
                let data: Vec<RunMetrics> = runs
                    .all()
                    .iter()
                    .filter_map(|n| {
                        Some(RunMetrics {
                            name: n.name.clone(),
                            log: Rc::clone(n.run.metrics.get()?),
                            markers: n.run.markers(),
                            tokens_per_step: n
                                .run
                                .config
                                .get()
                                .and_then(|c| plot::tokens_per_step(c)),
                        })
                    })
                    .collect();
                let missing: Vec<String> = runs
                    .all()
                    .iter()
                    .filter(|n| n.run.metrics.get().is_none())
                    .map(|n| n.name.clone())
                    .collect();
                html! { <MetricsView runs={Rc::new(data)} {missing} floor={r.entropy_floor()} /> }
            }
            Slot::Failed(e) => missing_view("metrics", Some(e)),
            Slot::Absent => missing_view("metrics.jsonl", None),
        },
    };
    html! {
        <div class="app" {ondrop} {ondragover}>
            <header>
                <span class="brand">{ "weft viz" }</span>
                <nav>{ for tabs }</nav>
                <label class="open">{ "Open files…" }
                    <input id="file-input" type="file" multiple=true {onchange} />
                </label>
            </header>
            if !errors.is_empty() {
                <div class="errors">
                    { for errors.iter().map(|(file, e)| html! { <div class="error" data-file={file.clone()}>{ e.clone() }</div> }) }
                </div>
            }
            if !warnings.is_empty() {
                <div class="warnings">
                    { for warnings.iter().map(|w| html! { <div class="warning">{ w.clone() }</div> }) }
                </div>
            }
            <main>{ body }</main>
            <footer>
                <span>{ "Drop run files anywhere on the page: trace.json, metrics.jsonl, expert_load.jsonl, config.toml, summary.json, events.jsonl. A second trace is drawn below the first for comparison." }</span>
                <span id="perf"></span>
            </footer>
        </div>
    }
}

fn missing_view(what: &str, err: Option<&LoadError>) -> Html {
    match err {
        Some(e) => html! {
            <div class="empty failed"><p>{ format!("The {what} could not be loaded:") }</p><pre class="error">{ e.to_string() }</pre></div>
        },
        None => html! {
            <div class="empty"><p>{ format!("No {what} in this run. Drop one onto the page or use “Open files…”.") }</p></div>
        },
    }
}

// ---------------------------------------------------------------- overview

#[derive(Properties, PartialEq)]
struct OverviewProps {
    run: Rc<Run>,
    runs: Rc<Runs>,
}

#[component]
fn OverviewView(p: &OverviewProps) -> Html {
    let r = &p.run;
    let status = |name: &str, s: Option<Result<String, String>>| {
        let (class, text) = match s {
            None => ("absent", "not loaded".to_owned()),
            Some(Ok(t)) => ("ok", t),
            Some(Err(e)) => ("bad", e),
        };
        html! { <tr class={class}><td>{ name.to_owned() }</td><td>{ text }</td></tr> }
    };
    fn st<T>(s: &Slot<T>, f: impl Fn(&T) -> String) -> Option<Result<String, String>> {
        match s {
            Slot::Absent => None,
            Slot::Loaded(v, w) if w.is_empty() => Some(Ok(f(v))),
            Slot::Loaded(v, w) => Some(Ok(format!("{} ({} warning(s))", f(v), w.len()))),
            Slot::Failed(e) => Some(Err(e.to_string())),
        }
    }
    let rows = [
        status(
            FileKind::RUN_FILES[0],
            st(&r.trace, |t| {
                format!(
                    "{} lanes, {} slices, makespan {}, {}",
                    t.lanes.len(),
                    t.work_slices(),
                    timeline::format_us(t.makespan()),
                    t.bubble_label()
                )
            }),
        ),
        status(
            FileKind::RUN_FILES[1],
            st(&r.metrics, |m| {
                let evals = m
                    .events
                    .iter()
                    .filter(|e| matches!(e.kind, MetricsEventKind::Eval { .. }))
                    .count();
                format!(
                    "{} steps, {evals} evaluations, {} health events",
                    m.records.len(),
                    m.events.len() - evals
                )
            }),
        ),
        status(
            FileKind::RUN_FILES[2],
            st(&r.expert, |x| {
                format!(
                    "{} steps × {} experts × {} layers",
                    x.steps.len(),
                    x.experts,
                    x.layers.len()
                )
            }),
        ),
        status(
            FileKind::RUN_FILES[3],
            st(&r.config, |c| format!("{} lines", c.lines().count())),
        ),
        status(
            FileKind::RUN_FILES[4],
            st(&r.summary, |s| format!("{} entries", s.len())),
        ),
        status(
            FileKind::RUN_FILES[5],
            st(&r.events, |e| {
                format!(
                    "{} health and recovery events, {} on the metrics timeline",
                    e.len(),
                    e.iter().filter(|e| e.kind.step().is_some()).count()
                )
            }),
        ),
    ];
    let last = r.metrics.get().and_then(|m| m.records.last().copied());
    let runs = p.runs.all();
    let run_rows = runs.iter().enumerate().map(|(i, n)| {
        let last = n.run.metrics.get().and_then(|m| m.records.last().copied());
        html! { <tr class="run-row"><td><i class="sw" style={format!("background:{}", run_colour(i))}></i>{ format!(" {}", n.name) }</td>
            <td>{ format!("{} file(s)", n.run.files.len()) }</td>
            <td class="mono">{ last.map(|m| format!("step {}: loss {:.4}", m.step, m.loss)).unwrap_or_default() }</td></tr> }
    });
    html! {
        <div class="overview">
            if runs.len() > 1 {
                <section class="card">
                    <h2>{ format!("{} runs (the first is the one the others are compared with; the files below are its)", runs.len()) }</h2>
                    <table class="files runs">{ for run_rows }</table>
                </section>
            }
            <section class="card">
                <h2>{ "Run files" }</h2>
                <table class="files">{ for rows }</table>
                if let Some(m) = last {
                    <p class="kv">{ format!("Last step {}: loss {:.4}, lr {:.3e}, grad norm {:.3}, {:.0} tokens/s, {:.1} s", m.step, m.loss, m.lr, m.grad_norm, m.tokens_per_s, m.time_s) }</p>
                }
                if let Some(f) = r.entropy_floor() {
                    <p class="kv">{ format!("Entropy floor of the corpus: {f:.4} nats/token") }</p>
                }
            </section>
            if let Some(s) = r.summary.get() {
                <section class="card">
                    <h2>{ "summary.json" }</h2>
                    <table class="summary">
                        { for s.iter().map(|(k, v)| {
                            // the full value on hover, where it is shortened
                            let short = plot::short_number(v);
                            let title = (short != *v).then(|| v.clone());
                            html! { <tr><td>{ k.clone() }</td><td {title}>{ short }</td></tr> }
                        }) }
                    </table>
                </section>
            }
            if let Some(c) = r.config.get() {
                <section class="card">
                    <h2>{ "config.toml" }</h2>
                    <pre class="config">{ c.as_str().to_owned() }</pre>
                </section>
            }
        </div>
    }
}

// ---------------------------------------------------------------- replay

/// Playback state shared by the replaying views.
#[derive(Debug, Clone, PartialEq)]
struct Replay {
    /// Cursor position in [0, 1] of the whole range.
    pos: f64,
    playing: bool,
    speed: f64,
}

enum ReplayMsg {
    Toggle,
    Tick,
    Seek(f64),
    Speed(f64),
}

/// Timer period of playback, ms.
const TICK_MS: u32 = 40;
/// At 1× a replay takes this many seconds end to end.
const REPLAY_S: f64 = 10.0;

impl Reducible for Replay {
    type Action = ReplayMsg;
    fn reduce(self: Rc<Self>, m: ReplayMsg) -> Rc<Self> {
        let mut s = (*self).clone();
        match m {
            ReplayMsg::Toggle => {
                s.playing = !s.playing;
                if s.playing && s.pos >= 1.0 {
                    s.pos = 0.0;
                }
            }
            ReplayMsg::Tick if s.playing => {
                s.pos += f64::from(TICK_MS) / 1000.0 / REPLAY_S * s.speed;
                if s.pos >= 1.0 {
                    s.pos = 1.0;
                    s.playing = false;
                }
            }
            ReplayMsg::Tick => return self,
            ReplayMsg::Seek(p) => s.pos = p.clamp(0.0, 1.0),
            ReplayMsg::Speed(v) => s.speed = v,
        }
        Rc::new(s)
    }
}

#[hook]
fn use_replay() -> UseReducerHandle<Replay> {
    let replay = use_reducer(|| Replay {
        pos: 0.0,
        playing: false,
        speed: 1.0,
    });
    {
        let d = replay.dispatcher();
        use_effect_with(replay.playing, move |playing| {
            let t = playing.then(|| {
                web::ticker(
                    TICK_MS,
                    Callback::from(move |()| d.dispatch(ReplayMsg::Tick)),
                )
            });
            move || {
                let _stop = t;
            }
        });
    }
    replay
}

fn replay_controls(replay: &UseReducerHandle<Replay>, position: String) -> Html {
    let d = replay.dispatcher();
    let toggle = Callback::from(move |_: MouseEvent| d.dispatch(ReplayMsg::Toggle));
    let d = replay.dispatcher();
    let oninput = Callback::from(move |e: InputEvent| {
        let v: web_sys::HtmlInputElement = e.target_unchecked_into();
        d.dispatch(ReplayMsg::Seek(
            v.value().parse::<f64>().unwrap_or(0.0) / 1000.0,
        ));
    });
    let d = replay.dispatcher();
    let onchange = Callback::from(move |e: Event| {
        let v: web_sys::HtmlInputElement = e.target_unchecked_into();
        d.dispatch(ReplayMsg::Speed(v.value().parse::<f64>().unwrap_or(1.0)));
    });
    #[allow(clippy::cast_possible_truncation)]
    let scrub = (replay.pos * 1000.0).round() as i64;
    html! {
        <div class="replay">
            <button id="play" onclick={toggle}>{ if replay.playing { "❚❚ Pause" } else { "▶ Play" } }</button>
            <label>{ "speed " }
                <select id="speed" {onchange}>
                    { for [0.25, 0.5, 1.0, 2.0, 4.0, 8.0].iter().map(|s| html! {
                        <option value={s.to_string()} selected={(*s - replay.speed).abs() < 1e-9}>{ format!("{s}×") }</option>
                    }) }
                </select>
            </label>
            <input id="scrub" class="scrub" type="range" min="0" max="1000" value={scrub.to_string()} {oninput} />
            <span id="cursor-pos" class="mono">{ position }</span>
        </div>
    }
}

#[hook]
fn use_render_timer(view: &'static str) {
    let start = web::now_ms();
    use_effect(move || web::report_perf(view, web::now_ms() - start));
}

// ---------------------------------------------------------------- pipeline

#[derive(Properties, PartialEq)]
struct PipelineProps {
    a: Rc<Timeline>,
    b: Option<Rc<Timeline>>,
}

#[derive(Debug, Clone, PartialEq)]
struct Hover {
    which: usize,
    lane: usize,
    event: usize,
}

#[component]
fn PipelineView(p: &PipelineProps) -> Html {
    use_render_timer("pipeline");
    let (lo, hi) = match &p.b {
        Some(b) => (p.a.start.min(b.start), p.a.end.max(b.end)),
        None => (p.a.start, p.a.end),
    };
    let full = (lo, if hi > lo { hi } else { lo + 1.0 });
    let window = use_state(|| full);
    {
        let window = window.clone();
        use_effect_with(full_key(full), move |_| window.set(full));
    }
    let replay = use_replay();
    let hover = use_state(|| None::<Hover>);
    let drag = use_mut_ref(|| None::<(f64, (f64, f64))>);
    let wraps = [use_node_ref(), use_node_ref()];
    let (t0, t1) = *window;
    let cursor = full.0 + replay.pos * (full.1 - full.0);

    let zoom = |factor: f64, at: f64| {
        let window = window.clone();
        move |_: MouseEvent| {
            let (t0, t1) = *window;
            window.set(zoomed((t0, t1), full, factor, at));
        }
    };
    let mid = (t0 + t1) / 2.0;
    let timelines: Vec<(usize, Rc<Timeline>)> = std::iter::once(p.a.clone())
        .chain(p.b.clone())
        .enumerate()
        .collect();
    // one label column for both timelines, so that their time axes align
    let cols = label_columns(timelines.iter().map(|(_, tl)| &**tl));
    let left = cols.left;
    let charts = timelines.iter().map(|(which, tl)| {
        let which = *which;
        let node = wraps[which.min(1)].clone();
        let lanes_h = AXIS_H + LANE_H * tl.lanes.len() as f64;
        let onmousemove = {
            let hover = hover.clone();
            let window = window.clone();
            let drag = drag.clone();
            let tl = tl.clone();
            let node = node.clone();
            move |e: MouseEvent| {
                let Some((fx, fy)) = web::relative_pos(&e, &node) else { return };
                let (t0, t1) = *window;
                let t = t0 + (fx * W - left) / (W - left) * (t1 - t0);
                if let Some((start_t, w0)) = *drag.borrow() {
                    let dt = start_t - t;
                    let span = w0.1 - w0.0;
                    let s = (w0.0 + dt).clamp(full.0, (full.1 - span).max(full.0));
                    window.set((s, s + span));
                    return;
                }
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let lane = ((fy * lanes_h - AXIS_H) / LANE_H).floor();
                let found = (lane >= 0.0)
                    .then_some(lane as usize)
                    .and_then(|l| tl.lanes.get(l).map(|ln| (l, ln)))
                    .and_then(|(l, ln)| ln.slice_at(t).map(|s| Hover { which, lane: l, event: s.event }));
                if *hover != found {
                    hover.set(found);
                }
            }
        };
        let onmousedown = {
            let drag = drag.clone();
            let window = window.clone();
            let node = node.clone();
            move |e: MouseEvent| {
                if let Some((fx, _)) = web::relative_pos(&e, &node) {
                    let (t0, t1) = *window;
                    *drag.borrow_mut() = Some((t0 + (fx * W - left) / (W - left) * (t1 - t0), (t0, t1)));
                }
            }
        };
        let onmouseup = {
            let drag = drag.clone();
            move |_: MouseEvent| *drag.borrow_mut() = None
        };
        let onwheel = {
            let window = window.clone();
            let node = node.clone();
            move |e: WheelEvent| {
                let dy = web::wheel_delta(&e);
                let m: &MouseEvent = &e;
                let Some((fx, _)) = web::relative_pos(m, &node) else { return };
                let (t0, t1) = *window;
                let at = t0 + ((fx * W - left) / (W - left)).clamp(0.0, 1.0) * (t1 - t0);
                window.set(zoomed((t0, t1), full, if dy < 0.0 { 0.8 } else { 1.25 }, at));
            }
        };
        let per_step = if tl.steps.is_empty() { "" } else { " per step" };
        let title = format!(
            "{}{} — {} lanes, makespan {}{per_step}, bubble {:.1}%{per_step}{}",
            tl.schedule.as_deref().map(|s| format!("{s} · ")).unwrap_or_default(),
            tl.file,
            tl.lanes.len(),
            timeline::format_us(tl.step_makespan()),
            100.0 * tl.bubble_fraction,
            match tl.bubble_disagreement() {
                _ if !tl.bubble_from_file => " (computed)".to_owned(),
                Some(c) => format!(" (the events give {:.1}%)", 100.0 * c),
                None => String::new(),
            },
        );
        let makespan = if tl.steps.is_empty() {
            format!("makespan {}", timeline::format_us(tl.makespan()))
        } else {
            format!(
                "makespan {} per step (trace {})",
                timeline::format_us(tl.step_makespan()),
                timeline::format_us(tl.makespan())
            )
        };
        html! {
            <section class="card">
                <h2 class="tl-title" data-which={which.to_string()}>{ title }</h2>
                <div class="stats mono">
                    <span id={format!("makespan-{which}")}>{ makespan }</span>
                    <span id={format!("bubble-{which}")}>{ tl.bubble_label() }</span>
                    if let Some(b) = tl.bubble_predicted {
                        <span id={format!("bubble-predicted-{which}")}>{ format!("simulator predicts {:.2}%", 100.0 * b) }</span>
                    }
                    { for tl.counts.iter().map(|(k, n)| html! { <span>{ format!("{}: {n}", k.label()) }</span> }) }
                </div>
                if let Some(steps) = tl.steps_label(12) {
                    <div id={format!("step-bubbles-{which}")} class="stats mono">{ steps }</div>
                }
                <div ref={node} {onmousemove} {onmousedown} {onmouseup} {onwheel} class="svg-wrap">
                    { timeline_svg(tl, which, cols, (t0, t1), cursor, hover.as_ref().filter(|h| h.which == which)) }
                </div>
            </section>
        }
    });
    let running = timelines.iter().map(|(which, tl)| {
        let rows = tl.lanes.iter().map(|l| {
            let text = match l.slice_at(cursor) {
                Some(s) if s.kind != SliceKind::Idle => {
                    let name = &tl.trace.trace_events[s.event].name;
                    match (s.microbatch, s.chunk) {
                        (Some(m), Some(c)) if tl.chunked => format!("{name} mb {m} chunk {c}"),
                        (Some(m), _) => format!("{name} mb {m}"),
                        _ => name.clone(),
                    }
                }
                _ => "idle".to_owned(),
            };
            html! { <tr class="running-row"><td>{ l.name.clone() }</td><td class="mono">{ text }</td></tr> }
        });
        html! { <table class="running" data-which={which.to_string()}><tr><th colspan="2">{ if *which == 0 { "running at cursor" } else { "compare: running at cursor" } }</th></tr>{ for rows }</table> }
    });
    let details = hover.as_ref().and_then(|h| {
        let tl = &timelines.get(h.which)?.1;
        let lane = tl.lanes.get(h.lane)?;
        Some(html! {
            <table id="details" class="details">
                <tr><th colspan="2">{ lane.name.clone() }</th></tr>
                { for tl.details(h.event).into_iter().map(|(k, v)| html! { <tr><td>{ k }</td><td class="mono">{ v }</td></tr> }) }
            </table>
        })
    });
    let reset = {
        let window = window.clone();
        move |_: MouseEvent| window.set(full)
    };
    html! {
        <div class="pipeline">
            <div class="toolbar">
                { replay_controls(&replay, format!("t = {}", timeline::format_us(cursor - full.0))) }
                <div class="zoom">
                    <button id="zoom-in" onclick={zoom(0.5, mid)}>{ "+" }</button>
                    <button id="zoom-out" onclick={zoom(2.0, mid)}>{ "−" }</button>
                    <button id="zoom-fit" onclick={reset}>{ "fit" }</button>
                    <span class="mono">{ format!("{} – {}", timeline::format_us(t0 - full.0), timeline::format_us(t1 - full.0)) }</span>
                </div>
            </div>
            <div class="legend">
                { for [SliceKind::Forward, SliceKind::BackwardInput, SliceKind::BackwardWeight, SliceKind::Backward, SliceKind::Comm, SliceKind::Other, SliceKind::Idle]
                    .into_iter().filter(|k| *k == SliceKind::Idle || timelines.iter().any(|(_, t)| t.counts.contains_key(k)))
                    .map(|k| html! { <span class="key"><i class={classes!("sw", k.class())}></i>{ k.label() }</span> }) }
                <span class="hint">{ "wheel: zoom · drag: pan · hover: details · labels: micro-batch[.chunk]" }</span>
            </div>
            { for charts }
            <div class="below">
                { for running }
                { details.unwrap_or_default() }
            </div>
        </div>
    }
}

fn full_key(full: (f64, f64)) -> (u64, u64) {
    (full.0.to_bits(), full.1.to_bits())
}

/// `window` scaled by `factor` around `at`, kept inside `full`.
fn zoomed(window: (f64, f64), full: (f64, f64), factor: f64, at: f64) -> (f64, f64) {
    let span = ((window.1 - window.0) * factor).clamp((full.1 - full.0) * 1e-6, full.1 - full.0);
    let u = if window.1 > window.0 {
        (at - window.0) / (window.1 - window.0)
    } else {
        0.5
    };
    let mut s = at - u * span;
    s = s.clamp(full.0, full.1 - span);
    (s, s + span)
}

/// Where the timeline's labels go: group labels (mesh coordinates) in
/// the first column, lane names in the second, the time axis after both.
#[derive(Debug, Clone, Copy, PartialEq)]
struct LabelColumns {
    /// Width of the group column (0 without groups).
    group: f64,
    /// Where the time axis starts.
    left: f64,
}

/// Label columns wide enough for the lane names and group labels of
/// `timelines` (at least [`LEFT`], at most half the drawing; longer names
/// are cut by [`fit_label`]).
fn label_columns<'a>(timelines: impl IntoIterator<Item = &'a Timeline>) -> LabelColumns {
    let (mut name, mut group) = (0, 0);
    for l in timelines.into_iter().flat_map(|t| &t.lanes) {
        name = name.max(l.name.chars().count());
        group = group.max(l.group.as_deref().map_or(0, |g| g.chars().count()));
    }
    #[allow(clippy::cast_precision_loss)]
    let group = if group > 0 {
        group as f64 * GROUP_CHAR_W + 14.0
    } else {
        0.0
    };
    #[allow(clippy::cast_precision_loss)]
    let left = (group + name as f64 * NAME_CHAR_W + 10.0).clamp(LEFT, W / 2.0);
    LabelColumns { group, left }
}

/// `text` cut to fit `width` at `char_w` per character (with an
/// ellipsis), and whether it was cut.
fn fit_label(text: &str, width: f64, char_w: f64) -> (String, bool) {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let max = (width / char_w).floor().max(1.0) as usize;
    if text.chars().count() <= max {
        (text.to_owned(), false)
    } else {
        let mut s: String = text.chars().take(max - 1).collect();
        s.push('…');
        (s, true)
    }
}

fn timeline_svg(
    tl: &Timeline,
    which: usize,
    cols: LabelColumns,
    (t0, t1): (f64, f64),
    cursor: f64,
    hover: Option<&Hover>,
) -> Html {
    let left = cols.left;
    let inner = W - left;
    let rects = tl.layout(t0, t1, inner);
    #[allow(clippy::cast_precision_loss)]
    let h = AXIS_H + LANE_H * tl.lanes.len() as f64;
    let drawn: usize = rects.iter().map(Vec::len).sum();
    let ticks = timeline::ticks(t0 - tl.start.min(t0), t1 - tl.start.min(t0), 8);
    let base = tl.start.min(t0);
    let px = |t: f64| left + (t - t0) / (t1 - t0) * inner;
    let axis = ticks.iter().map(|&t| {
        let x = px(t + base);
        html! { <g class="tick"><line x1={f(x)} x2={f(x)} y1={f(AXIS_H - 4.0)} y2={f(h)} /><text x={f(x + 2.0)} y="12">{ timeline::format_us(t) }</text></g> }
    });
    // Each step's window (what its bubble is measured over) as a bar under
    // the axis; the gaps between bars are outside every step.
    let windows = tl.steps.iter().filter(|s| s.end >= t0 && s.start <= t1).map(|s| {
        let (x0, x1) = (px(s.start).max(left), px(s.end).min(W));
        let title = format!(
            "step {}: bubble {:.2}%{}, makespan {}",
            s.step,
            100.0 * s.bubble_fraction,
            if s.in_mean { "" } else { " (not in the mean)" },
            timeline::format_us(s.makespan())
        );
        html! {
            <rect class={classes!("step-window", (!s.in_mean).then_some("excluded"))} data-step={s.step.to_string()}
                  x={f(x0)} y={f(AXIS_H - 5.0)} width={f((x1 - x0).max(1.0))} height="3"><title>{ title }</title></rect>
        }
    });
    let lanes = tl.lanes.iter().zip(&rects).enumerate().map(|(i, (lane, rs))| {
        #[allow(clippy::cast_precision_loss)]
        let y = AXIS_H + LANE_H * i as f64;
        // a boundary where the mesh group (the process's label) changes
        let starts_group = lane.group.is_some()
            && (i == 0 || tl.lanes[i - 1].group != lane.group);
        let boundary = (starts_group && i > 0).then(|| html! {
            <line class="group-sep" x1="0" x2={f(W)} y1={f(y + 1.0)} y2={f(y + 1.0)} />
        });
        // the group's label in its own column, beside the group's lanes
        let group_label = starts_group.then(|| {
            let n = tl.lanes[i..].iter().take_while(|l| l.group == lane.group).count();
            #[allow(clippy::cast_precision_loss)]
            let bottom = y + LANE_H * n as f64;
            html! { <g>
                <line class="group-bracket" x1={f(cols.group - 5.0)} x2={f(cols.group - 5.0)} y1={f(y + 4.0)} y2={f(bottom - 4.0)} />
                <text class="group-name" x="4" y={f((y + bottom) / 2.0 + 4.0)}>{ lane.group.clone().unwrap_or_default() }</text>
            </g> }
        });
        let (name, cut) = fit_label(&lane.name, left - cols.group - 8.0, NAME_CHAR_W);
        let slices = rs.iter().map(|r| {
            let hovered = hover.is_some_and(|h| h.lane == i && Some(h.event) == r.slice);
            let class = classes!("slice", r.kind.class(), hovered.then_some("hover"), (r.merged > 1).then_some("merged"));
            let label = r.label.as_ref().map(|l| html! {
                <text class="slice-label" x={f(left + r.x + r.w / 2.0)} y={f(y + LANE_H / 2.0 + 4.0)}>{ l.clone() }</text>
            });
            html! { <>
                <rect class={class} x={f(left + r.x)} y={f(y + 2.0)} width={f(r.w)} height={f(LANE_H - 4.0)}
                      data-n={r.merged.to_string()} />
                { label.unwrap_or_default() }
            </> }
        });
        html! {
            <g class="lane" data-lane={i.to_string()} data-slices={rs.len().to_string()}
               data-group={lane.group.clone().unwrap_or_default()}>
                <rect class="lane-bg" x={f(left)} y={f(y + 2.0)} width={f(inner)} height={f(LANE_H - 4.0)} />
                <text class="lane-name" x={f(cols.group + 4.0)} y={f(y + LANE_H / 2.0 + 4.0)}>{ name }
                    if cut { <title>{ lane.name.clone() }</title> }
                </text>
                { boundary.unwrap_or_default() }
                { group_label.unwrap_or_default() }
                { for slices }
            </g>
        }
    });
    let cx = px(cursor);
    let cursor_html = (left..=W).contains(&cx).then(|| html! {
        <line id={format!("cursor-{which}")} class="cursor" x1={f(cx)} x2={f(cx)} y1="0" y2={f(h)} />
    });
    html! {
        <svg class="timeline" viewBox={format!("0 0 {W} {h}")} preserveAspectRatio="none"
             data-lanes={tl.lanes.len().to_string()} data-drawn={drawn.to_string()} data-which={which.to_string()}>
            <defs>
                <pattern id="idle-hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">
                    <rect width="6" height="6" fill="#eceff3" /><line x1="0" y1="0" x2="0" y2="6" stroke="#cfd5dd" stroke-width="2" />
                </pattern>
            </defs>
            { for axis }
            { for windows }
            { for lanes }
            { cursor_html.unwrap_or_default() }
        </svg>
    }
}

/// An SVG coordinate with one decimal.
fn f(x: f64) -> String {
    format!("{x:.1}")
}

// ---------------------------------------------------------------- experts

#[derive(Properties, PartialEq)]
struct ExpertProps {
    data: Rc<ExpertLoad>,
}

/// Height of one expert row in the heatmap when there are few experts.
const HEAT_H: f64 = 260.0;

#[component]
fn ExpertView(p: &ExpertProps) -> Html {
    use_render_timer("experts");
    let x = &p.data;
    let sel = use_state(|| LayerSel::All);
    let replay = use_replay();
    let image = {
        let x = x.clone();
        use_memo((*sel, Rc::as_ptr(&x) as usize), move |(s, _)| {
            let h = x.heatmap(*s);
            (h.cols, h.rows, h.data_url())
        })
    };
    let curves = {
        let x = x.clone();
        use_memo((*sel, Rc::as_ptr(&x) as usize), move |(s, _)| x.curves(*s))
    };
    let ns = x.steps.len();
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let si = ((replay.pos * ns.saturating_sub(1) as f64).round() as usize).min(ns - 1);
    let step = x.steps[si];
    let onchange = {
        let sel = sel.clone();
        Callback::from(move |e: Event| {
            let v: web_sys::HtmlInputElement = e.target_unchecked_into();
            sel.set(
                v.value()
                    .parse::<usize>()
                    .map_or(LayerSel::All, LayerSel::One),
            );
        })
    };
    let inner = W - LEFT;
    #[allow(clippy::cast_precision_loss)]
    let cx = LEFT
        + if ns > 1 {
            si as f64 / (ns - 1) as f64
        } else {
            0.0
        } * inner;
    #[allow(clippy::cast_precision_loss)]
    let row_h = HEAT_H / x.experts as f64;
    let label_every = (x.experts / 16).max(1);
    let expert_labels = (0..x.experts).step_by(label_every).map(|e| {
        #[allow(clippy::cast_precision_loss)]
        let y = row_h * (e as f64 + 0.5) + 4.0;
        html! { <text class="axis-label" x={f(LEFT - 6.0)} y={f(y)} text-anchor="end">{ format!("e{e}") }</text> }
    });
    let loads = x.at(*sel, si);
    let max_load = loads.iter().copied().max().unwrap_or(0).max(1);
    #[allow(clippy::cast_precision_loss)]
    let bar_w = inner / x.experts as f64;
    let total: u64 = loads.iter().sum();
    #[allow(clippy::cast_precision_loss)]
    let mean = total as f64 / x.experts as f64;
    let bars = loads.iter().enumerate().map(|(e, v)| {
        #[allow(clippy::cast_precision_loss)]
        let hgt = 110.0 * (*v as f64) / (max_load as f64);
        #[allow(clippy::cast_precision_loss)]
        let rel = if mean > 0.0 { *v as f64 / mean } else { 0.0 };
        let [r, g, b] = crate::expert::colour(rel);
        #[allow(clippy::cast_precision_loss)]
        let bx = LEFT + bar_w * e as f64;
        html! { <rect class="bar" x={f(bx + 0.5)} y={f(120.0 - hgt)} width={f((bar_w - 1.0).max(0.5))} height={f(hgt)}
                     fill={format!("rgb({r},{g},{b})")} stroke="#888" stroke-width="0.3"><title>{ format!("expert {e}: {v} tokens ({rel:.2}× mean)") }</title></rect> }
    });
    let mean_y = 120.0 - 110.0 * mean / max_load as f64;
    let steps_f: Rc<Vec<f64>> = {
        let x = x.clone();
        use_memo(Rc::as_ptr(&x) as usize, move |_| {
            x.steps.iter().map(|s| *s as f64).collect()
        })
    };
    let dropped_f: Vec<f64> = curves.dropped.iter().map(|d| *d as f64).collect();
    let any_dropped = curves.dropped.iter().any(|d| *d > 0);
    let cur_step = Some(step as f64);
    let layer_opts = x.layers.iter().enumerate().map(|(i, l)| {
        html! { <option value={i.to_string()} selected={*sel == LayerSel::One(i)}>{ format!("layer {l}") }</option> }
    });
    html! {
        <div class="experts">
            <div class="toolbar">
                { replay_controls(&replay, format!("step {step} ({} of {ns})", si + 1)) }
                <label>{ "layer " }
                    <select id="layer" {onchange}>
                        <option value="all" selected={*sel == LayerSel::All}>{ "all layers (sum)" }</option>
                        { for layer_opts }
                    </select>
                </label>
            </div>
            <section class="card">
                <h2>{ format!("{} — tokens per expert relative to the step's mean: {} steps × {} experts × {} layers", x.file, ns, x.experts, x.layers.len()) }</h2>
                <svg class="heatmap" viewBox={format!("0 0 {W} {}", HEAT_H + 18.0)} preserveAspectRatio="none"
                     data-steps={ns.to_string()} data-experts={x.experts.to_string()}
                     data-cols={image.0.to_string()} data-rows={image.1.to_string()}>
                    <image class="heat" href={image.2.clone()} x={f(LEFT)} y="0" width={f(inner)} height={f(HEAT_H)} preserveAspectRatio="none" />
                    { for expert_labels }
                    <text class="axis-label" x={f(LEFT)} y={f(HEAT_H + 14.0)}>{ format!("step {}", x.steps[0]) }</text>
                    <text class="axis-label" x={f(W)} y={f(HEAT_H + 14.0)} text-anchor="end">{ format!("step {}", x.steps[ns - 1]) }</text>
                    <line id="step-cursor" class="cursor" x1={f(cx)} x2={f(cx)} y1="0" y2={f(HEAT_H)} />
                </svg>
                <div class="legend"><span class="key"><i class="sw" style="background:#2166ac"></i>{ "≤ ¼ of mean" }</span>
                    <span class="key"><i class="sw" style="background:#f7f7f7"></i>{ "= mean" }</span>
                    <span class="key"><i class="sw" style="background:#b2182b"></i>{ "≥ 4× mean" }</span>
                    if image.0 < ns { <span class="hint">{ format!("{} steps per column (mean)", ns.div_ceil(image.0)) }</span> }
                </div>
            </section>
            <section class="card">
                <h2>{ format!("step {step}: tokens per expert (max/mean {:.3}, dropped {})", curves.max_over_mean[si], curves.dropped[si]) }</h2>
                <svg class="bars" viewBox={format!("0 0 {W} 124")} preserveAspectRatio="none" data-bars={loads.len().to_string()}>
                    { for bars }
                    <line class="mean-line" x1={f(LEFT)} x2={f(W)} y1={f(mean_y)} y2={f(mean_y)} />
                    <text class="axis-label" x={f(LEFT - 6.0)} y={f(mean_y + 4.0)} text-anchor="end">{ "mean" }</text>
                </svg>
            </section>
            <div class="grid2">
                { line_chart("max / mean load (1 = balanced)", &steps_f, &curves.max_over_mean, &ChartOpts { cursor: cur_step, floor: Some(1.0), ..ChartOpts::default() }) }
                { line_chart("MaxVio = max/mean − 1", &steps_f, &curves.max_vio, &ChartOpts { cursor: cur_step, ..ChartOpts::default() }) }
                if any_dropped {
                    { line_chart("dropped token assignments", &steps_f, &dropped_f, &ChartOpts { cursor: cur_step, ..ChartOpts::default() }) }
                } else {
                    <section class="card chart"><h3>{ "dropped token assignments" }</h3><p class="hint">{ "none: no token was dropped in any step" }</p></section>
                }
            </div>
        </div>
    }
}

// ---------------------------------------------------------------- charts

#[derive(Default)]
struct ChartOpts<'a> {
    cursor: Option<f64>,
    floor: Option<f64>,
    floor_label: Option<&'a str>,
    log_y: bool,
    /// Health and recovery events: a vertical line each.
    events: &'a [Marker],
    /// The first step shown (the steps before it are left out).
    from: Option<f64>,
    /// Fit the y-axis to the values between [`plot::INLIER_QUANTILES`].
    ignore_outliers: bool,
    /// Tokens trained per step: a second row of x-axis labels.
    tokens_per_step: Option<u64>,
    /// An `id` for the chart's card.
    id: Option<&'static str>,
    /// Extra classes of the chart's card.
    class: Option<&'static str>,
}

/// One curve of a chart.
#[derive(Default)]
struct Series<'a> {
    xs: &'a [f64],
    /// The values drawn (smoothed, where `raw` is given).
    ys: &'a [f64],
    /// The values before smoothing, drawn faintly behind `ys`.
    raw: Option<&'a [f64]>,
    /// Its evaluations (step, loss): a dashed curve with dots, in its
    /// colour.
    evals: &'a [(f64, f64)],
    /// The run it belongs to (its colour) and the run's name, when the
    /// chart draws several runs.
    run: Option<(usize, &'a str)>,
    /// Steps and largest |value| of a difference curve, for its attributes.
    diff: Option<(usize, f64)>,
}

/// Width of a chart in SVG units.
const CH_W: f64 = 580.0;
/// Width of the y-axis labels.
const CH_L: f64 = 56.0;
/// Margin above the plot.
const CH_T: f64 = 6.0;
/// Height of the plot.
const CH_P: f64 = 140.0;
/// Height of one row of x-axis labels.
const CH_ROW: f64 = 13.0;

/// A chart of one curve.
fn line_chart(title: &str, xs: &[f64], ys: &[f64], o: &ChartOpts<'_>) -> Html {
    let one = Series {
        xs,
        ys,
        ..Series::default()
    };
    multi_chart(title, &[one], o)
}

/// The points of `xs`, `ys` at steps from `from` on.
fn from_step(xs: &[f64], ys: &[f64], from: f64) -> (Vec<f64>, Vec<f64>) {
    xs.iter()
        .zip(ys)
        .filter(|(x, _)| **x >= from)
        .map(|(x, y)| (*x, *y))
        .unzip()
}

/// The part of a [`Series`] a chart shows: its points from a step on.
struct Shown {
    xs: Vec<f64>,
    ys: Vec<f64>,
    raw: Option<Vec<f64>>,
    evals: Vec<(f64, f64)>,
}

impl Shown {
    fn of(s: &Series<'_>, from: f64) -> Self {
        let (xs, ys) = from_step(s.xs, s.ys, from);
        Self {
            xs,
            ys,
            raw: s.raw.map(|r| from_step(s.xs, r, from).1),
            evals: s.evals.iter().copied().filter(|p| p.0 >= from).collect(),
        }
    }
}

/// The `id` of a chart's clip path, from its title.
fn clip_id(title: &str) -> String {
    let s: String = title
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    format!("clip-{s}")
}

/// A chart of several curves on shared axes (fitted to all of them, or
/// to most of their values with [`ChartOpts::ignore_outliers`]; what runs
/// past the plot is clipped).
#[allow(clippy::too_many_lines)]
fn multi_chart(title: &str, series: &[Series<'_>], o: &ChartOpts<'_>) -> Html {
    let from = o.from.unwrap_or(f64::NEG_INFINITY);
    let shown: Vec<Shown> = series.iter().map(|s| Shown::of(s, from)).collect();
    // every point drawn, evaluations included, fits the axes
    let (xs_all, mut ys_all): (Vec<f64>, Vec<f64>) = shown
        .iter()
        .flat_map(|s| {
            s.xs.iter()
                .copied()
                .zip(s.ys.iter().copied())
                .chain(s.evals.iter().copied())
        })
        .unzip();
    let mut extra: Vec<f64> = o.floor.into_iter().collect();
    if o.ignore_outliers {
        // the noise of the raw values belongs to the range, the evaluations too
        let pool: Vec<f64> = shown
            .iter()
            .flat_map(|s| {
                let ys = s.raw.as_ref().unwrap_or(&s.ys).iter().copied();
                ys.chain(s.evals.iter().map(|p| p.1))
            })
            .collect();
        if let Some((lo, hi)) = plot::inlier_range(&pool, o.log_y) {
            for y in &mut ys_all {
                *y = y.clamp(lo, hi);
            }
            extra.extend([lo, hi]);
        }
    }
    let plot_w = CH_W - CH_L;
    let frame = Frame::fit(plot_w, CH_P, &xs_all, &ys_all, &extra, o.log_y);
    let rows = if o.tokens_per_step.is_some() {
        2.0
    } else {
        1.0
    };
    let ch_h = CH_T + CH_P + 4.0 + rows * CH_ROW;
    let mut n = 0;
    let colour = |s: &Series<'_>| s.run.map(|(i, _)| run_colour(i));
    let raws = series.iter().zip(&shown).filter_map(|(s, sh)| {
        let (d, _) = chart::path(&frame, &sh.xs, sh.raw.as_deref()?);
        let style = colour(s).map(|c| format!("stroke:{c}"));
        Some(html! { <path class="raw" {d} {style} /> })
    });
    let paths: Vec<Html> = series
        .iter()
        .zip(&shown)
        .map(|(s, sh)| {
            let (d, drawn) = chart::path(&frame, &sh.xs, &sh.ys);
            n += drawn;
            let style = colour(s).map(|c| format!("stroke:{c}"));
            let run = s.run.map(|(_, name)| name.to_owned());
            let steps = s.diff.map(|(k, _)| k.to_string());
            let max_abs = s.diff.map(|(_, m)| format!("{m:?}"));
            html! { <path class="series" {d} {style} data-run={run} data-steps={steps} data-max-abs={max_abs} /> }
        })
        .collect();
    let evals = series.iter().zip(&shown).filter(|(_, sh)| !sh.evals.is_empty()).map(|(s, sh)| {
        let ev = &sh.evals;
        let (xs, ys): (Vec<f64>, Vec<f64>) = ev.iter().copied().unzip();
        let (d, _) = chart::path(&frame, &xs, &ys);
        let stroke = colour(s).map(|c| format!("stroke:{c}"));
        let fill = colour(s).map(|c| format!("fill:{c}"));
        let dots = ev.iter().filter_map(|(x, y)| {
            let py = frame.py(*y)?;
            Some(html! { <circle class="point" cx={f(frame.px(*x))} cy={f(py)} r="3" style={fill.clone()}>
                <title>{ format!("step {x}: eval loss {}", plot::short_number(&format!("{y:?}"))) }</title></circle> })
        });
        html! { <g class="evals" data-points={ev.len().to_string()}><path class="eval-series" {d} style={stroke} />{ for dots }</g> }
    });
    let yt = if o.log_y {
        plot::log_ticks(frame.y.0, frame.y.1)
    } else {
        timeline::ticks(frame.y.0, frame.y.1, 4)
    };
    // one number of decimals, but on a log axis over decades (0.01, 1, 100)
    let decades = o.log_y
        && yt
            .first()
            .zip(yt.last())
            .is_some_and(|(a, b)| b / a >= 10.0);
    let ylabels = plot::tick_labels(&yt, !decades);
    let yticks = yt.into_iter().zip(ylabels).filter_map(|(v, label)| {
        let y = frame.py(v)? + CH_T;
        Some(html! { <g class="tick"><line x1={f(CH_L)} x2={f(CH_W)} y1={f(y)} y2={f(y)} /><text x={f(CH_L - 4.0)} y={f(y + 4.0)} text-anchor="end">{ label }</text></g> })
    });
    let row_y = |r: f64| CH_T + CH_P + r * CH_ROW;
    let xt = timeline::ticks(frame.x.0, frame.x.1, 6).into_iter().map(|v| {
        let x = CH_L + frame.px(v);
        let anchor = if x > CH_W - 16.0 { "end" } else { "middle" };
        let x = f(x.min(CH_W - 2.0));
        #[allow(clippy::cast_precision_loss)]
        let tokens = o.tokens_per_step.map(|t| html! {
            <text class="axis-label tokens" x={x.clone()} y={f(row_y(2.0))} text-anchor={anchor}>{ plot::fmt_count(v * t as f64) }</text>
        });
        html! { <>
            <text class="axis-label" x={x.clone()} y={f(row_y(1.0))} text-anchor={anchor}>{ chart::fmt_value(v) }</text>
            { tokens.unwrap_or_default() }
        </> }
    });
    let axis_titles = html! { <>
        <text class="axis-title" x={f(CH_L - 8.0)} y={f(row_y(1.0))} text-anchor="end">{ "step" }</text>
        if o.tokens_per_step.is_some() {
            <text class="axis-title" x={f(CH_L - 8.0)} y={f(row_y(2.0))} text-anchor="end">{ "tokens" }</text>
        }
    </> };
    let in_x = |x: f64| x >= frame.x.0 && x <= frame.x.1;
    let bad: Vec<f64> = shown
        .iter()
        .flat_map(|s| s.xs.iter().zip(s.raw.as_ref().unwrap_or(&s.ys)))
        .filter(|(_, y)| !y.is_finite())
        .map(|(x, _)| *x)
        .collect();
    let bad_marks = bad.iter().take(500).map(|x| {
        let px = CH_L + frame.px(*x);
        html! { <line class="nonfinite" x1={f(px)} x2={f(px)} y1={f(CH_T)} y2={f(CH_T + 8.0)}><title>{ format!("step {x}: not finite") }</title></line> }
    });
    #[allow(clippy::cast_precision_loss)]
    let events: Vec<&Marker> = o.events.iter().filter(|e| in_x(e.step as f64)).collect();
    let event_lines = events.iter().map(|e| {
        #[allow(clippy::cast_precision_loss)]
        let px = CH_L + frame.px(e.step as f64);
        html! { <line class={classes!("event", format!("ev-{}", e.kind))} x1={f(px)} x2={f(px)} y1={f(CH_T)} y2={f(CH_T + CH_P)}>
            <title>{ format!("step {}: {} {}", e.step, e.kind, detail_text(e)) }</title></line> }
    });
    let floor = o.floor.and_then(|v| frame.py(v)).map(|y| html! {
        <g><line class="floor" x1={f(CH_L)} x2={f(CH_W)} y1={f(y + CH_T)} y2={f(y + CH_T)} />
        <text class="floor-label" x={f(CH_W - 4.0)} y={f(y + CH_T - 4.0)} text-anchor="end">{ o.floor_label.unwrap_or("") }</text></g>
    });
    let cursor = o.cursor.filter(|c| in_x(*c)).map(|c| {
        let x = CH_L + frame.px(c);
        html! { <line class="cursor" x1={f(x)} x2={f(x)} y1={f(CH_T)} y2={f(CH_T + CH_P)} /> }
    });
    // the first curve's last value
    let last = series
        .first()
        .and_then(|s| s.raw.unwrap_or(s.ys).iter().rev().find(|y| y.is_finite()))
        .map(|y| chart::fmt_value(*y))
        .unwrap_or_default();
    let clip = clip_id(title);
    html! {
        <section class={classes!("card", "chart", o.class)} id={o.id}>
            <h3>{ title.to_owned() }<span class="last mono">{ last }</span></h3>
            <svg viewBox={format!("0 0 {CH_W} {ch_h}")} data-points={n.to_string()} data-series={series.len().to_string()} data-nonfinite={bad.len().to_string()} data-events={events.len().to_string()}>
                <defs><clipPath id={clip.clone()}><rect x="0" y="0" width={f(plot_w)} height={f(CH_P)} /></clipPath></defs>
                { for yticks }
                { for xt }
                { axis_titles }
                { floor.unwrap_or_default() }
                { for event_lines }
                <g transform={format!("translate({CH_L} {CH_T})")} clip-path={format!("url(#{clip})")}>
                    { for raws }
                    { for paths }
                    { for evals }
                </g>
                { for bad_marks }
                { cursor.unwrap_or_default() }
            </svg>
        </section>
    }
}

/// An event's details as `key=value` text, numbers at a readable precision.
fn detail_text(e: &Marker) -> String {
    e.detail
        .iter()
        .map(|(k, v)| format!("{k}={}", plot::short_number(v)))
        .collect::<Vec<_>>()
        .join("  ")
}

// ---------------------------------------------------------------- metrics

/// One run's input to the metrics view.
#[derive(PartialEq)]
struct RunMetrics {
    /// The legend's name.
    name: String,
    /// Its `metrics.jsonl`.
    log: Rc<MetricsLog>,
    /// Its health and recovery events on the step axis ([`Run::markers`]).
    markers: Vec<Marker>,
    /// Tokens per step, from its `config.toml`.
    tokens_per_step: Option<u64>,
}

#[derive(Properties, PartialEq)]
struct MetricsProps {
    /// Each run that has metrics; the first run first.
    runs: Rc<Vec<RunMetrics>>,
    /// Runs without metrics, by name.
    #[prop_or_default]
    missing: Vec<String>,
    floor: Option<f64>,
}

/// How the metrics charts are drawn: the controls above them.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ChartView {
    /// The last percent of the steps shown (100: all).
    percent: u32,
    /// Smoothing weight of the measured curves ([`plot::smooth`]; 0: none).
    smoothing: f64,
    /// The y-axes of measured values fitted to most of them
    /// ([`plot::inlier_range`]).
    ignore_outliers: bool,
    /// The loss on a log axis.
    log_loss: bool,
}

impl Default for ChartView {
    /// TensorBoard's defaults: smoothing 0.6, outliers ignored in scaling.
    fn default() -> Self {
        Self {
            percent: 100,
            smoothing: 0.6,
            ignore_outliers: true,
            log_loss: false,
        }
    }
}

/// The choices of [`ChartView::percent`].
const RANGES: [u32; 5] = [100, 50, 20, 10, 5];

/// One run's columns for the metrics charts.
struct Columns {
    xs: Vec<f64>,
    loss: Vec<f64>,
    lr: Vec<f64>,
    grad_norm: Vec<f64>,
    tokens_per_s: Vec<f64>,
    /// The three measured columns smoothed (empty without smoothing).
    smooth_loss: Vec<f64>,
    smooth_grad_norm: Vec<f64>,
    smooth_tokens_per_s: Vec<f64>,
    evals: Vec<(f64, f64)>,
}

impl Columns {
    #[allow(clippy::cast_precision_loss)]
    fn new(m: &MetricsLog, smoothing: f64) -> Self {
        let col = |g: fn(&weft_trace::MetricsRecord) -> f64| -> Vec<f64> {
            m.records.iter().map(g).collect()
        };
        let sm = |v: &[f64]| {
            if smoothing > 0.0 {
                plot::smooth(v, smoothing)
            } else {
                Vec::new()
            }
        };
        let evals = m
            .events
            .iter()
            .filter_map(|e| match e.kind {
                MetricsEventKind::Eval { val_loss, .. } => Some((e.step as f64, val_loss)),
                _ => None,
            })
            .collect();
        let (loss, grad_norm, tokens_per_s) = (
            col(|r| r.loss),
            col(|r| r.grad_norm),
            col(|r| r.tokens_per_s),
        );
        Self {
            xs: m.records.iter().map(|r| r.step as f64).collect(),
            smooth_loss: sm(&loss),
            smooth_grad_norm: sm(&grad_norm),
            smooth_tokens_per_s: sm(&tokens_per_s),
            loss,
            lr: col(|r| r.lr),
            grad_norm,
            tokens_per_s,
            evals,
        }
    }
}

/// A run's training loss by step, the last line of a step winning (as
/// `weft compare` reads it).
fn loss_by_step(m: &MetricsLog) -> Vec<(u64, f64)> {
    stats::last_per_step(m.records.iter().map(|r| (r.step, r.loss)))
}

/// The controls of the metrics charts.
fn chart_controls(view: &UseStateHandle<ChartView>) -> Html {
    let v = **view;
    let on_range = {
        let view = view.clone();
        Callback::from(move |e: Event| {
            let s: web_sys::HtmlSelectElement = e.target_unchecked_into();
            let percent = s.value().parse().unwrap_or(100);
            view.set(ChartView { percent, ..*view });
        })
    };
    let on_smoothing = {
        let view = view.clone();
        Callback::from(move |e: InputEvent| {
            let i: web_sys::HtmlInputElement = e.target_unchecked_into();
            let smoothing = i.value().parse().unwrap_or(0.0);
            view.set(ChartView { smoothing, ..*view });
        })
    };
    let check = |set: fn(&mut ChartView, bool)| {
        let view = view.clone();
        Callback::from(move |e: Event| {
            let i: web_sys::HtmlInputElement = e.target_unchecked_into();
            let mut v = *view;
            set(&mut v, i.checked());
            view.set(v);
        })
    };
    html! {
        <div class="toolbar chart-controls">
            <label>{ "steps " }
                <select id="range" onchange={on_range}>
                    { for RANGES.iter().map(|p| html! {
                        <option value={p.to_string()} selected={*p == v.percent}>{ if *p == 100 { "all".to_owned() } else { format!("last {p}%") } }</option>
                    }) }
                </select>
            </label>
            <label title="exponential moving average, debiased (TensorBoard's); the raw values are drawn faintly behind">{ "smoothing " }
                <input id="smoothing" type="range" min="0" max="0.99" step="0.01" value={v.smoothing.to_string()} oninput={on_smoothing} />
                <span class="mono">{ format!("{:.2}", v.smoothing) }</span>
            </label>
            <label title="fit the y-axes to the values between the 5th and 95th percentiles: the first steps' loss runs off the top">
                <input id="ignore-outliers" type="checkbox" checked={v.ignore_outliers} onchange={check(|v, c| v.ignore_outliers = c)} />
                { " ignore outliers in the y-range" }
            </label>
            <label>
                <input id="log-loss" type="checkbox" checked={v.log_loss} onchange={check(|v, c| v.log_loss = c)} />
                { " log-scale loss" }
            </label>
        </div>
    }
}

#[component]
#[allow(clippy::too_many_lines)]
fn MetricsView(p: &MetricsProps) -> Html {
    use_render_timer("metrics");
    let view = use_state(ChartView::default);
    let v = *view;
    let several = p.runs.len() > 1;
    let cols: Vec<Columns> = p
        .runs
        .iter()
        .map(|r| Columns::new(&r.log, v.smoothing))
        .collect();
    // every run's health and recovery events on the charts
    let events: Vec<Marker> = p
        .runs
        .iter()
        .flat_map(|r| r.markers.iter().cloned())
        .collect();
    // a column of every run: `smoothed` (where smoothing is on) over its
    // raw values, or the raw values alone
    type Col = fn(&Columns) -> &Vec<f64>;
    let series = |raw: Col, smoothed: Option<Col>, with_evals: bool| -> Vec<Series<'_>> {
        cols.iter()
            .zip(p.runs.iter())
            .enumerate()
            .map(|(i, (c, r))| {
                let sm = smoothed.map(|g| g(c)).filter(|s| !s.is_empty());
                Series {
                    xs: &c.xs,
                    ys: sm.unwrap_or(raw(c)),
                    raw: sm.map(|_| raw(c).as_slice()),
                    evals: if with_evals { &c.evals } else { &[] },
                    run: several.then_some((i, r.name.as_str())),
                    diff: None,
                }
            })
            .collect()
    };
    let any_evals = cols.iter().any(|c| !c.evals.is_empty());
    let floor_label = p.floor.map(|v| format!("entropy floor {v:.3}"));
    let loss_title = format!(
        "loss (nats/token{}): training{}{}",
        if v.log_loss { ", log scale" } else { "" },
        if v.smoothing > 0.0 { ", smoothed" } else { "" },
        if any_evals {
            "; dashed with dots: evaluation"
        } else {
            ""
        },
    );
    let mut kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    // the steps shown: the last percent of every run's steps
    let (first, last) = cols
        .iter()
        .flat_map(|c| c.xs.iter().copied())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
            (a.min(x), b.max(x))
        });
    let from =
        (v.percent < 100 && first.is_finite()).then(|| plot::range_start(first, last, v.percent));
    // the tokens axis, where every run trains the same tokens per step
    let tokens_per_step = p
        .runs
        .first()
        .and_then(|r| r.tokens_per_step)
        .filter(|t| p.runs.iter().all(|r| r.tokens_per_step == Some(*t)));
    let ev_opts = || ChartOpts {
        events: &events,
        from,
        tokens_per_step,
        ignore_outliers: v.ignore_outliers,
        ..ChartOpts::default()
    };
    // the loss of each other run against the first, step by step
    let diffs: Vec<(usize, &str, StepDiff)> = match p.runs.split_first() {
        Some((first, rest)) if !rest.is_empty() => {
            let base = loss_by_step(&first.log);
            rest.iter()
                .enumerate()
                .map(|(i, r)| {
                    (
                        i + 1,
                        r.name.as_str(),
                        StepDiff::between(&base, &loss_by_step(&r.log)),
                    )
                })
                .collect()
        }
        _ => Vec::new(),
    };
    #[allow(clippy::cast_precision_loss)]
    let diff_cols: Vec<(Vec<f64>, Vec<f64>)> = diffs
        .iter()
        .map(|(_, _, d)| d.points.iter().map(|&(s, v)| (s as f64, v)).unzip())
        .collect();
    let diff_series: Vec<Series<'_>> = diffs
        .iter()
        .zip(&diff_cols)
        .map(|((i, name, d), (xs, ys))| Series {
            xs,
            ys,
            run: Some((*i, name)),
            diff: Some((d.points.len(), d.max_abs)),
            ..Series::default()
        })
        .collect();
    let first_name = p.runs.first().map_or("", |r| r.name.as_str());
    let zero_label = format!("0 = {first_name}");
    let diff_rows = diffs.iter().map(|(i, name, d)| {
        let same = match d.first_differing {
            _ if d.points.is_empty() => "no step in common".to_owned(),
            None => format!("bit for bit equal at all {} common steps", d.points.len()),
            Some(s) => format!("first differs at step {s} (bit for bit equal for {} steps before)", d.bitwise_span),
        };
        html! { <tr class="diff-row" data-run={name.to_string()}>
            <td><i class="sw" style={format!("background:{}", run_colour(*i))}></i>{ format!(" {name} − {first_name}") }</td>
            <td class="mono">{ format!("max |Δ| {}", chart::fmt_value(d.max_abs)) }</td>
            <td class="mono">{ format!("mean |Δ| {}", chart::fmt_value(d.mean_abs)) }</td>
            <td>{ same }</td>
            <td class="mono">{ format!("{} common steps{}", d.points.len(), if d.unmatched > 0 { format!(", {} in one run only", d.unmatched) } else { String::new() }) }</td></tr> }
    });
    let table_runs = p.runs.iter().filter(|r| !r.markers.is_empty()).count();
    html! {
        <div class="metrics">
            { chart_controls(&view) }
            if several {
                <div class="legend run-legend">
                    { for p.runs.iter().enumerate().map(|(i, r)| html! {
                        <span class="key run-key" data-run={i.to_string()}><i class="sw" style={format!("background:{}", run_colour(i))}></i>{ r.name.clone() }</span>
                    }) }
                    if !p.missing.is_empty() {
                        <span class="hint">{ format!("no metrics.jsonl: {}", p.missing.join(", ")) }</span>
                    }
                </div>
            }
            <div class="legend">
                { for kinds.iter().map(|k| html! { <span class="key"><i class={classes!("sw", format!("ev-{k}"))}></i>{ format!("{k} ({})", events.iter().filter(|e| e.kind == *k).count()) }</span> }) }
                if events.is_empty() {
                    <span class="hint">{ "no health events (restarts, rewinds, skips, spikes, stragglers) · red ticks: non-finite values" }</span>
                } else {
                    <span class="hint">{ "vertical lines: health events (hover for details) · red ticks: non-finite values" }</span>
                }
            </div>
            <div class="grid2">
                { multi_chart(&loss_title, &series(|c| &c.loss, Some(|c| &c.smooth_loss), true), &ChartOpts { floor: p.floor, floor_label: floor_label.as_deref(), log_y: v.log_loss, ..ev_opts() }) }
                { multi_chart("learning rate", &series(|c| &c.lr, None, false), &ChartOpts { ignore_outliers: false, ..ev_opts() }) }
                { multi_chart("gradient norm (log scale)", &series(|c| &c.grad_norm, Some(|c| &c.smooth_grad_norm), false), &ChartOpts { log_y: true, ..ev_opts() }) }
                { multi_chart("tokens / s", &series(|c| &c.tokens_per_s, Some(|c| &c.smooth_tokens_per_s), false), &ev_opts()) }
                if !diffs.is_empty() {
                    { multi_chart(&format!("loss difference against {first_name} (per step)"), &diff_series, &ChartOpts { floor: Some(0.0), floor_label: Some(&zero_label), id: Some("loss-diff"), class: Some("diff"), from, tokens_per_step, ..ChartOpts::default() }) }
                }
            </div>
            if !diffs.is_empty() {
                <section class="card">
                    <h2>{ format!("training loss against {first_name}, at the steps both runs have") }</h2>
                    <table class="events diffs">{ for diff_rows }</table>
                </section>
            }
            if table_runs > 0 {
                <section class="card">
                    <h2>{ format!("health events ({})", events.len()) }</h2>
                    <table class="events">
                        { for p.runs.iter().flat_map(|r| r.markers.iter().map(move |e| (&r.name, e))).take(200).map(|(name, e)| html! {
                            <tr class={format!("ev-row ev-{}", e.kind)}>
                                if several { <td>{ name.clone() }</td> }
                                <td class="mono">{ e.step }</td><td>{ e.kind.clone() }</td>
                                <td class="mono">{ detail_text(e) }</td></tr>
                        }) }
                    </table>
                </section>
            }
        </div>
    }
}
