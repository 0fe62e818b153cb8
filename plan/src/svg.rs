//! SVG plots of a plan: step time and its parts against the GPU count per
//! strategy, and memory per GPU by category for the best layouts.

use std::fmt::Write as _;

use crate::explain::Crossover;
use crate::memory::Memory;
use crate::predict::Prediction;

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// One line of a plot.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend.
    pub name: String,
    /// Points `(x, y)`, x increasing.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed.
    pub dashed: bool,
}

/// A line plot with logarithmic axes.
#[must_use]
pub fn log_log(title: &str, xlabel: &str, ylabel: &str, series: &[Series]) -> String {
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|&(x, y)| x > 0.0 && y > 0.0 && x.is_finite() && y.is_finite())
        .collect();
    let mut svg = header(title);
    if pts.is_empty() {
        svg.push_str("</svg>\n");
        return svg;
    }
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in &pts {
        x0 = x0.min(x.log10());
        x1 = x1.max(x.log10());
        y0 = y0.min(y.log10());
        y1 = y1.max(y.log10());
    }
    let (x0, x1) = (x0.floor(), x1.ceil().max(x0.floor() + 1.0));
    let (y0, y1) = (y0.floor(), y1.ceil().max(y0.floor() + 1.0));
    let px = |x: f64| LEFT + (x.log10() - x0) / (x1 - x0) * (W - LEFT - RIGHT);
    let py = |y: f64| H - BOTTOM - (y.log10() - y0) / (y1 - y0) * (H - TOP - BOTTOM);
    axes(&mut svg, xlabel, ylabel);
    for d in (x0 as i32)..=(x1 as i32) {
        let v = 10f64.powi(d);
        let x = px(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{TOP}" stroke="#ddd"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="12">{}</text>"##,
            H - BOTTOM,
            H - BOTTOM + 18.0,
            tick(v)
        );
    }
    for d in (y0 as i32)..=(y1 as i32) {
        let v = 10f64.powi(d);
        let y = py(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="12">{}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            tick(v)
        );
    }
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = s
            .points
            .iter()
            .filter(|&&(x, y)| x > 0.0 && y > 0.0 && x.is_finite() && y.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let dash = if s.dashed {
            r#" stroke-dasharray="6,4""#
        } else {
            ""
        };
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
            path.join(" ")
        );
        for p in &path {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(svg, r#"<circle cx="{x}" cy="{y}" r="3" fill="{color}"/>"#);
        }
        let ly = TOP + 10.0 + 20.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
            W - RIGHT + 10.0,
            W - RIGHT + 34.0,
            W - RIGHT + 40.0,
            ly + 4.0,
            esc(&s.name)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn tick(v: f64) -> String {
    if (1.0..1e6).contains(&v) {
        format!("{v:.0}")
    } else {
        format!("{v:.0e}")
    }
}

fn header(title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" font-family=\"sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{:.1}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        W / 2.0,
        esc(title)
    )
}

fn axes(svg: &mut String, xlabel: &str, ylabel: &str) {
    let _ = writeln!(
        svg,
        r##"<line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#000"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.1}" stroke="#000"/>"##,
        H - BOTTOM,
        W - RIGHT,
        H - BOTTOM,
        H - BOTTOM
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="13">{}</text>"#,
        LEFT + (W - LEFT - RIGHT) / 2.0,
        H - 16.0,
        esc(xlabel)
    );
    let _ = writeln!(
        svg,
        r#"<text x="18" y="{:.1}" text-anchor="middle" font-size="13" transform="rotate(-90 18 {:.1})">{}</text>"#,
        TOP + (H - TOP - BOTTOM) / 2.0,
        TOP + (H - TOP - BOTTOM) / 2.0,
        esc(ylabel)
    );
}

/// Step time against GPU count: for each strategy its step, and for pure
/// FSDP its compute and communication (the crossover).
#[must_use]
pub fn step_time_plot(
    strategies: &[(String, Vec<(usize, Prediction)>)],
    fsdp: &Crossover,
) -> String {
    let mut series: Vec<Series> = strategies
        .iter()
        .map(|(name, pts)| Series {
            name: format!("{name}: step"),
            points: pts.iter().map(|(g, p)| (*g as f64, p.step_s)).collect(),
            dashed: false,
        })
        .collect();
    series.push(Series {
        name: "FSDP: compute".into(),
        points: fsdp
            .points
            .iter()
            .map(|p| (p.gpus as f64, p.compute))
            .collect(),
        dashed: true,
    });
    series.push(Series {
        name: "FSDP: communication".into(),
        points: fsdp
            .points
            .iter()
            .map(|p| (p.gpus as f64, p.comm))
            .collect(),
        dashed: true,
    });
    let title = match fsdp.gpus {
        Some(g) => format!(
            "Step time vs GPUs (batch {}); FSDP crossover at {g} GPUs",
            fsdp.batch
        ),
        None => format!("Step time vs GPUs (batch {})", fsdp.batch),
    };
    log_log(&title, "GPUs", "seconds per step", &series)
}

/// Memory per GPU by category for each of `preds` (horizontal stacked
/// bars), with the GPU's capacity as a line.
#[must_use]
pub fn memory_plot(preds: &[Prediction]) -> String {
    let rows = preds.len().max(1) as f64;
    let bar = 22.0;
    let height = TOP + BOTTOM + rows * (bar + 10.0);
    let label_w = 260.0;
    let width = W + 120.0;
    let max = preds
        .iter()
        .map(|p| p.memory.total().max(p.capacity))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let scale = |b: u64| (b as f64) / max * (width - label_w - 40.0);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{:.1}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">Memory per GPU by layout</text>\n",
        width / 2.0
    );
    let names = Memory::default().categories().map(|(n, _)| n);
    for (i, n) in names.iter().enumerate() {
        let x = label_w + 110.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{:.1}" font-size="12">{n}</text>"#,
            height - 30.0,
            COLORS[i],
            x + 16.0,
            height - 19.0
        );
    }
    for (r, p) in preds.iter().enumerate() {
        let y = TOP + r as f64 * (bar + 10.0);
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">{}</text>"#,
            label_w - 6.0,
            y + bar / 2.0 + 4.0,
            esc(&p.layout.to_string())
        );
        let mut x = label_w;
        for (i, (_, b)) in p.memory.categories().iter().enumerate() {
            let w = scale(*b);
            let _ = writeln!(
                svg,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{bar}" fill="{}"/>"#,
                COLORS[i]
            );
            x += w;
        }
        let cap = label_w + scale(p.capacity);
        let _ = writeln!(
            svg,
            r##"<line x1="{cap:.1}" y1="{:.1}" x2="{cap:.1}" y2="{:.1}" stroke="#000" stroke-dasharray="3,3"/>"##,
            y - 3.0,
            y + bar + 3.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
            x + 4.0,
            y + bar / 2.0 + 4.0,
            crate::memory::bytes(p.memory.total())
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_are_svg_with_every_series() {
        let s = log_log(
            "t",
            "x",
            "y",
            &[
                Series {
                    name: "a<b".into(),
                    points: vec![(1.0, 2.0), (10.0, 20.0)],
                    dashed: false,
                },
                Series {
                    name: "c".into(),
                    points: vec![(1.0, 3.0), (100.0, 0.5)],
                    dashed: true,
                },
            ],
        );
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains("a&lt;b"));
    }
}
