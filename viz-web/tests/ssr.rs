//! The components rendered to HTML with yew's server-side renderer: what
//! the page draws for a prepared run.

use weft_viz_web::app::{App, AppProps, Tab};
use weft_viz_web::run::{Run, Runs};

async fn render(run: Run, tab: Option<Tab>) -> String {
    render_runs(run.into(), tab).await
}

async fn render_runs(runs: Runs, tab: Option<Tab>) -> String {
    yew::LocalServerRenderer::<App>::with_props(AppProps {
        initial: runs,
        fetch: false,
        tab,
    })
    .render()
    .await
}

fn count(html: &str, needle: &str) -> usize {
    html.matches(needle).count()
}

/// A 2-stage 1F1B-like trace: 2 micro-batches, F and B each.
const TRACE: &str = r#"{"traceEvents":[
 {"name":"process_name","ph":"M","pid":0,"args":{"name":"stage 0"}},
 {"name":"process_name","ph":"M","pid":1,"args":{"name":"stage 1"}},
 {"name":"F","ph":"X","ts":0,"dur":10,"pid":0,"args":{"microbatch":0,"chunk":0}},
 {"name":"F","ph":"X","ts":10,"dur":10,"pid":0,"args":{"microbatch":1,"chunk":0}},
 {"name":"F","ph":"X","ts":10,"dur":10,"pid":1,"args":{"microbatch":0,"chunk":0}},
 {"name":"B","ph":"X","ts":20,"dur":10,"pid":1,"args":{"microbatch":0,"chunk":0}},
 {"name":"W","ph":"X","ts":30,"dur":10,"pid":1,"args":{"microbatch":0,"chunk":0}},
 {"name":"B","ph":"X","ts":30,"dur":10,"pid":0,"args":{"microbatch":0,"chunk":0}},
 {"name":"idle","ph":"X","ts":0,"dur":10,"pid":1,"cat":"idle"}],
 "otherData":{"schedule":"ZB-H1","bubble_fraction":0.25}}"#;

#[tokio::test]
async fn pipeline_lanes_slices_labels_and_cursor() {
    let mut run = Run::default();
    run.ingest("trace.json", TRACE);
    let html = render(run, None).await;
    assert_eq!(count(&html, "class=\"lane\""), 2, "{html}");
    assert_eq!(
        count(&html, "class=\"slice k-"),
        6,
        "idle is background, not a slice"
    );
    assert_eq!(count(&html, "slice k-f"), 3);
    assert_eq!(count(&html, "slice k-b"), 2);
    assert_eq!(count(&html, "slice k-w"), 1);
    assert_eq!(count(&html, "class=\"slice-label\""), 6);
    assert!(html.contains("bubble 25.00%"), "bubble from otherData");
    assert!(
        !html.contains("simulator predicts"),
        "no prediction in the file"
    );
    assert!(
        !html.contains("step-window"),
        "no step marks, no step windows"
    );
    assert!(html.contains("makespan 40.0 µs"));
    assert!(html.contains("ZB-H1"));
    assert!(html.contains("id=\"cursor-0\""));
    assert!(html.contains("id=\"play\""));
    assert!(html.contains("stage 1"));
}

/// Two steps of 2 stages with 70 µs between them; the writer averages
/// step 2 only. Step 1: one F each, window 20, bubble 1 − 20/40 = 50%;
/// step 2: two F each, window 30, bubble 1 − 40/60 = 33.33%.
const STEPS: &str = r#"{"traceEvents":[
 {"name":"F","ph":"X","ts":0,"dur":10,"pid":0,"args":{"microbatch":0,"step":1}},
 {"name":"F","ph":"X","ts":10,"dur":10,"pid":1,"args":{"microbatch":0,"step":1}},
 {"name":"optimizer","ph":"X","ts":20,"dur":80,"pid":0},
 {"name":"F","ph":"X","ts":100,"dur":10,"pid":0,"args":{"microbatch":0,"step":2}},
 {"name":"F","ph":"X","ts":110,"dur":10,"pid":0,"args":{"microbatch":1,"step":2}},
 {"name":"F","ph":"X","ts":110,"dur":10,"pid":1,"args":{"microbatch":0,"step":2}},
 {"name":"F","ph":"X","ts":120,"dur":10,"pid":1,"args":{"microbatch":1,"step":2}}],
 "otherData":{"bubble_steps":[2],"bubble_predicted":0.3}}"#;

#[tokio::test]
async fn multi_step_bubble_is_shown_per_step() {
    let mut run = Run::default();
    run.ingest("trace.json", STEPS);
    let html = render(run, None).await;
    assert!(
        html.contains("bubble 33.33% per step (mean of 1 of 2 steps)"),
        "{html}"
    );
    assert!(
        html.contains("step 1 50.00% (not in the mean) · step 2 33.33%"),
        "{html}"
    );
    assert!(html.contains("makespan 30.0 µs per step (trace 130.0 µs)"));
    assert!(html.contains("(computed)"));
    assert!(html.contains("simulator predicts 30.00%"), "{html}");
    // The two step windows are marked under the axis, the gap is not.
    assert_eq!(count(&html, "class=\"step-window"), 2, "{html}");
    assert!(html.contains("step 2: bubble 33.33%, makespan 30.0 µs"));
}

#[tokio::test]
async fn compare_draws_a_second_timeline() {
    let mut run = Run::default();
    run.ingest("a.trace.json", TRACE);
    run.ingest("b.trace.json", TRACE);
    let html = render(run, Some(Tab::Pipeline)).await;
    assert_eq!(count(&html, "class=\"timeline\""), 2);
    assert!(html.contains("id=\"cursor-1\""));
}

#[tokio::test]
async fn malformed_trace_is_a_message_naming_file_and_line() {
    let mut run = Run::default();
    run.ingest("trace.json", &TRACE[..200]);
    let html = render(run, None).await;
    assert!(html.contains("class=\"error\""), "{html}");
    assert!(html.contains("trace.json, line 4, column"), "{html}");
    assert!(html.contains("truncated"), "{html}");
    assert!(html.contains("<nav>"), "the shell still renders");
}

#[tokio::test]
async fn heatmap_bars_and_curves() {
    let mut run = Run::default();
    let mut text = String::new();
    for step in 1..=30 {
        for layer in 0..2 {
            text.push_str(&format!(
                "{{\"step\":{step},\"layer\":{layer},\"tokens_per_expert\":[8,4,2,2],\"dropped\":{}}}\n",
                u32::from(step < 5)
            ));
        }
    }
    run.ingest("expert_load.jsonl", &text);
    let html = render(run, None).await;
    for attr in [
        "data-steps=\"30\"",
        "data-experts=\"4\"",
        "data-cols=\"30\"",
        "data-rows=\"4\"",
    ] {
        assert!(html.contains(attr), "{attr}");
    }
    assert!(
        html.contains("href=\"data:image/bmp;base64,Qk"),
        "a BMP image"
    );
    assert_eq!(count(&html, "class=\"bar\""), 4);
    assert!(html.contains("max/mean 2.000"), "8 over a mean of 4");
    assert!(html.contains("dropped token assignments"));
    assert!(html.contains("layer 1"));
}

#[tokio::test]
async fn metrics_charts_events_and_floor() {
    let mut run = Run::default();
    let mut text = String::new();
    for step in 1..=20 {
        let loss = if step == 7 {
            "\"NaN\"".to_owned()
        } else {
            format!("{}", 3.0 - f64::from(step) * 0.05)
        };
        text.push_str(&format!(
            "{{\"step\":{step},\"loss\":{loss},\"lr\":0.001,\"grad_norm\":1.5,\"tokens_per_s\":900,\"time_s\":{step}}}\n"
        ));
    }
    text.push_str(concat!(
        "{\"step\":7,\"event\":\"skip\",\"loss\":\"NaN\",\"grad_norm\":\"NaN\"}\n",
        "{\"step\":0,\"event\":\"eval\",\"val_loss\":5.598353492328897,\"floor\":1.674503751393173}\n",
        "{\"step\":10,\"event\":\"eval\",\"val_loss\":2.6,\"floor\":1.674503751393173}\n",
        "{\"step\":12,\"event\":\"spike\",\"loss\":5.123456789012345,\"median\":2.0000001,\"batch\":{\"step\":12,\"micro_batches\":1}}\n",
    ));
    run.ingest("metrics.jsonl", &text);
    run.ingest("summary.json", "{\"data\":{\"entropy_floor\":1.9}}");
    run.ingest(
        "config.toml",
        "[model]\nblock_size = 64\n\n[train]\nbatch_size = 32\n",
    );
    let html = render(run.clone(), Some(Tab::Metrics)).await;
    assert_eq!(count(&html, "class=\"card chart\""), 4);
    assert_eq!(count(&html, "class=\"event ev-skip\""), 4, "on every chart");
    assert_eq!(
        count(&html, "class=\"event ev-spike\""),
        4,
        "on every chart"
    );
    // evaluations are the loss chart's curve, not health events
    assert_eq!(count(&html, "ev-eval"), 0, "{html}");
    assert_eq!(count(&html, "class=\"eval-series\""), 1);
    assert_eq!(count(&html, "class=\"point\""), 2, "the eval losses");
    assert!(html.contains("health events (2)"));
    assert!(!html.contains("val_loss="), "{html}");
    // details at a readable precision
    assert!(html.contains("loss=5.123  median=2"), "{html}");
    assert!(!html.contains("5.1234"), "{html}");
    assert!(html.contains("data-nonfinite=\"1\""));
    assert!(html.contains("entropy floor 1.900"));
    // smoothing on by default: each measured curve over its raw values
    assert_eq!(
        count(&html, "class=\"raw\""),
        3,
        "loss, grad norm, tokens/s"
    );
    assert!(html.contains("id=\"smoothing\""));
    assert!(html.contains("id=\"log-loss\""));
    assert!(html.contains("id=\"ignore-outliers\""));
    assert!(
        html.contains("<option value=\"10\">last 10%</option>"),
        "{html}"
    );
    // both axes labelled: steps, and tokens (32 × 64 = 2048 per step)
    assert_eq!(count(&html, ">step</text>"), 4);
    assert_eq!(count(&html, ">tokens</text>"), 4);
    assert!(html.contains(">20.5k</text>"), "step 10: {html}");
    let overview = render(run, Some(Tab::Overview)).await;
    assert!(
        overview.contains("20 steps, 2 evaluations, 2 health events"),
        "{overview}"
    );
}

#[tokio::test]
async fn recovery_events_join_the_metrics_timeline() {
    let mut run = Run::default();
    let mut text = String::new();
    for s in 1..=12 {
        text.push_str(&format!(
            "{{\"step\":{s},\"loss\":3.0,\"lr\":0.001,\"grad_norm\":1.0,\"tokens_per_s\":100,\"time_s\":{s}}}\n"
        ));
    }
    run.ingest("metrics.jsonl", &text);
    run.ingest(
        "events.jsonl",
        concat!(
            "{\"time\":1.0,\"event\":\"start\",\"attempt\":0,\"resume\":false,\"pid\":100,\"dp\":2,\"ranks\":2}\n",
            "{\"time\":2.0,\"event\":\"failure\",\"attempt\":0,\"failure\":\"signal 9\",\"rank\":null,\"last_step\":8}\n",
            "{\"time\":2.1,\"event\":\"restart\",\"attempt\":1,\"from_checkpoint_step\":5,\"unverified_checkpoints\":[],\"lost_steps\":3,\"action\":\"restart\",\"dp\":2,\"ranks\":2,\"spares_left\":null,\"excluded_hosts\":[]}\n",
            "{\"time\":3.0,\"event\":\"straggler\",\"step\":10,\"rank\":1,\"ratio\":2.5,\"window_steps\":20}\n",
        ),
    );
    let overview = render(run.clone(), Some(Tab::Overview)).await;
    assert!(
        overview.contains("4 health and recovery events, 3 on the metrics timeline"),
        "{overview}"
    );
    let html = render(run, Some(Tab::Metrics)).await;
    for kind in ["failure", "restart", "straggler"] {
        assert_eq!(
            count(&html, &format!("class=\"event ev-{kind}\"")),
            4,
            "{kind} on every chart"
        );
    }
    assert!(html.contains("health events (3)"));
    assert!(html.contains("lost_steps=3"), "details in the table");
}

#[tokio::test]
async fn overview_lists_files_config_and_summary() {
    let mut run = Run::default();
    run.ingest("config.toml", "[train]\nsteps = 10\n");
    run.ingest(
        "summary.json",
        "{\"steps\":10,\"final_eval_loss\":1.736581316228694}",
    );
    run.ingest("metrics.jsonl", "{\"step\":1}\n{\"step\":2}\n");
    let html = render(run, None).await;
    assert!(html.contains("steps = 10"));
    assert!(html.contains("<td>steps</td><td>10</td>"), "{html}");
    assert!(
        html.contains("<td>final_eval_loss</td><td title=\"1.736581316228694\">1.737</td>"),
        "numbers at a readable precision, in full on hover: {html}"
    );
    assert!(
        html.contains("metrics.jsonl, line 1: missing field `loss`"),
        "{html}"
    );
    assert!(html.contains("not loaded"));
}

/// Four ranks of a pp=2 × dp=2 mesh, in mesh order, labelled by stage.
const MESH_TRACE: &str = r#"{"traceEvents":[
 {"name":"process_name","ph":"M","pid":0,"args":{"name":"rank 0: pp 0, dp 0, tp 0"}},
 {"name":"process_name","ph":"M","pid":1,"args":{"name":"rank 1: pp 0, dp 1, tp 0"}},
 {"name":"process_name","ph":"M","pid":2,"args":{"name":"rank 2: pp 1, dp 0, tp 0"}},
 {"name":"process_name","ph":"M","pid":3,"args":{"name":"rank 3: pp 1, dp 1, tp 0"}},
 {"name":"process_sort_index","ph":"M","pid":3,"args":{"sort_index":3}},
 {"name":"process_sort_index","ph":"M","pid":2,"args":{"sort_index":2}},
 {"name":"process_sort_index","ph":"M","pid":1,"args":{"sort_index":1}},
 {"name":"process_sort_index","ph":"M","pid":0,"args":{"sort_index":0}},
 {"name":"process_labels","ph":"M","pid":0,"args":{"labels":"pp 0"}},
 {"name":"process_labels","ph":"M","pid":1,"args":{"labels":"pp 0"}},
 {"name":"process_labels","ph":"M","pid":2,"args":{"labels":"pp 1"}},
 {"name":"process_labels","ph":"M","pid":3,"args":{"labels":"pp 1"}},
 {"name":"F","ph":"X","ts":10,"dur":10,"pid":3,"args":{"microbatch":0}},
 {"name":"F","ph":"X","ts":10,"dur":10,"pid":2,"args":{"microbatch":0}},
 {"name":"F","ph":"X","ts":0,"dur":10,"pid":1,"args":{"microbatch":0}},
 {"name":"F","ph":"X","ts":0,"dur":10,"pid":0,"args":{"microbatch":0}},
 {"name":"gather","ph":"X","ts":0,"dur":5,"pid":0,"tid":3,"cat":"fsdp.comm"}]}"#;

#[tokio::test]
async fn ranks_are_grouped_by_mesh_coordinate() {
    let mut run = Run::default();
    run.ingest("trace.json", MESH_TRACE);
    let html = render(run, None).await;
    // five lanes (rank 0 has a compute and an FSDP communication lane), in
    // mesh order, one boundary where the stage changes
    assert_eq!(count(&html, "class=\"lane\""), 5, "{html}");
    let order: Vec<usize> = [
        "rank 0: pp 0",
        "rank 1: pp 0",
        "rank 2: pp 1",
        "rank 3: pp 1",
    ]
    .iter()
    .map(|n| {
        html.find(n)
            .unwrap_or_else(|| panic!("{n} missing: {html}"))
    })
    .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
    assert_eq!(count(&html, "class=\"group-sep\""), 1, "{html}");
    assert_eq!(count(&html, "class=\"group-name\""), 2, "{html}");
    assert_eq!(count(&html, "data-group=\"pp 1\""), 2, "{html}");
}

/// The value of `attr` of the first element of class `class` in `html`.
fn attr_of(html: &str, class: &str, attr: &str) -> f64 {
    let at = html
        .find(&format!("class=\"{class}\""))
        .unwrap_or_else(|| panic!("no {class}"));
    let tag = &html[html[..at].rfind('<').unwrap()..at];
    let v = tag.split(&format!(" {attr}=\"")).nth(1).unwrap();
    v.split('"').next().unwrap().parse().unwrap()
}

#[tokio::test]
async fn lane_names_and_group_labels_each_fit_their_column() {
    let mut run = Run::default();
    run.ingest("trace.json", MESH_TRACE);
    let html = render(run, None).await;
    let names: Vec<&str> = html
        .split("class=\"lane-name\"")
        .skip(1)
        .map(|t| t.split('>').nth(1).unwrap().split('<').next().unwrap())
        .collect();
    assert_eq!(names.len(), 5);
    let longest = names.iter().map(|n| n.chars().count()).max().unwrap();
    assert!(longest >= "rank 0: pp 0, dp 0, tp 0 / ".len(), "{names:?}");
    // 6.5 SVG units a character: about the width of 11 px system-ui text
    #[allow(clippy::cast_precision_loss)]
    let name_w = 6.5 * longest as f64;
    let name_x = attr_of(&html, "lane-name", "x");
    let timeline_x = attr_of(&html, "lane-bg", "x");
    assert!(
        name_x + name_w <= timeline_x,
        "lane names ({name_x} + {name_w}) run over the timeline at {timeline_x}"
    );
    let group_x = attr_of(&html, "group-name", "x");
    assert!(
        group_x + 6.0 * "pp 0".len() as f64 <= name_x,
        "group labels ({group_x}) run into the lane names at {name_x}"
    );
    // the second group's label sits beside its lanes, not above a name
    assert_eq!(count(&html, "class=\"group-bracket\""), 2);
}

/// `metrics.jsonl` of `steps` steps whose loss is `loss(step)`, with an
/// eval at step 10.
fn metrics(steps: u32, loss: impl Fn(u32) -> f64) -> String {
    let mut text = String::new();
    for step in 1..=steps {
        text.push_str(&format!(
            "{{\"step\":{step},\"loss\":{},\"lr\":0.001,\"grad_norm\":1.5,\"tokens_per_s\":900,\"time_s\":{step}}}\n",
            loss(step)
        ));
    }
    text.push_str("{\"step\":10,\"event\":\"eval\",\"val_loss\":2.6}\n");
    text
}

fn named(runs: Vec<(&str, String)>) -> Runs {
    Runs::new(
        runs.into_iter()
            .map(|(name, text)| {
                let mut r = Run::default();
                r.ingest("metrics.jsonl", &text);
                (name.to_owned(), r)
            })
            .collect(),
    )
    .unwrap()
}

#[tokio::test]
async fn several_runs_overlay_their_metrics_with_a_legend_and_a_difference_chart() {
    // seed-2 equals base for 4 steps, then is 0.25 higher; it has 15 steps
    let base = metrics(20, |s| 3.0 - f64::from(s) * 0.0625);
    let other = metrics(15, |s| {
        3.0 - f64::from(s) * 0.0625 + if s > 4 { 0.25 } else { 0.0 }
    });
    let html = render_runs(
        named(vec![("base", base), ("seed-2", other)]),
        Some(Tab::Metrics),
    )
    .await;
    assert!(html.contains("class=\"legend run-legend\""), "{html}");
    let legend: Vec<&str> = html
        .split("class=\"key run-key\"")
        .skip(1)
        .map(|k| k.split("</i>").nth(1).unwrap().split('<').next().unwrap())
        .collect();
    assert_eq!(legend, ["base", "seed-2"]);
    // the 4 charts, one curve per run each, and the difference chart
    assert_eq!(count(&html, "class=\"card chart\""), 4);
    assert_eq!(count(&html, "class=\"card chart diff\""), 1);
    assert_eq!(count(&html, "data-series=\"2\""), 4);
    assert_eq!(count(&html, "class=\"series\""), 4 * 2 + 1);
    assert_eq!(count(&html, "data-run=\"base\""), 4);
    assert_eq!(
        count(&html, "data-run=\"seed-2\""),
        4 + 1 + 1,
        "curves, diff, row"
    );
    assert!(html.contains("id=\"loss-diff\""));
    let diff = html.split("id=\"loss-diff\"").nth(1).unwrap();
    let diff = diff.split("</section>").next().unwrap();
    assert_eq!(count(diff, "class=\"series\""), 1);
    assert!(diff.contains("data-steps=\"15\""), "{diff}");
    assert!(diff.contains("data-max-abs=\"0.25\""), "{diff}");
    assert!(diff.contains("0 = base"), "the zero line is the first run");
    assert!(html.contains("loss difference against base"));
    assert!(html.contains("first differs at step 5 (bit for bit equal for 4 steps before)"));
    assert!(html.contains("15 common steps, 5 in one run only"));
    assert_eq!(count(&html, "class=\"point\""), 2, "each run's eval");
    assert_eq!(
        count(&html, "class=\"eval-series\""),
        2,
        "each run's eval curve"
    );
    assert!(
        !html.contains("<h2>health events"),
        "evaluations are no health events"
    );
}

#[tokio::test]
async fn three_runs_two_differences_and_one_run_keeps_its_single_view() {
    let a = metrics(10, |s| 3.0 - f64::from(s) * 0.125);
    let html = render_runs(
        named(vec![
            ("a", a.clone()),
            ("b", a.clone()),
            ("c", metrics(10, |_| 1.0)),
        ]),
        Some(Tab::Metrics),
    )
    .await;
    assert_eq!(count(&html, "data-series=\"3\""), 4);
    let diff = html.split("id=\"loss-diff\"").nth(1).unwrap();
    let diff = diff.split("</section>").next().unwrap();
    assert_eq!(count(diff, "class=\"series\""), 2);
    assert!(
        html.contains("bit for bit equal at all 10 common steps"),
        "b is a"
    );
    // one run: no legend of runs, no difference chart, one curve per chart
    let mut one = Run::default();
    one.ingest("metrics.jsonl", &a);
    let html = render(one, Some(Tab::Metrics)).await;
    assert!(!html.contains("run-legend"));
    assert!(!html.contains("loss-diff"));
    assert_eq!(count(&html, "data-series=\"1\""), 4);
    assert!(!html.contains("data-run="));
}

#[tokio::test]
async fn several_runs_are_listed_on_the_overview_and_their_errors_named() {
    let mut runs = named(vec![
        ("base", metrics(5, |_| 2.0)),
        ("broken", "{\"step\":1,\"loss\":[]}\n".to_owned()),
    ]);
    runs.ingest(0, "config.toml", "[train]\nsteps = 5\n");
    let html = render_runs(runs, Some(Tab::Overview)).await;
    assert!(html.contains("2 runs (the first is the one"), "{html}");
    assert_eq!(count(&html, "class=\"run-row\""), 2);
    assert!(
        html.contains("broken: metrics.jsonl, line 1"),
        "errors name the run"
    );
}
