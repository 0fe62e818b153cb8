//! Browser glue: fetching run files, reading dropped files, timers,
//! pointer positions and render timing. On native targets (tests, SSR) each
//! function is a stand-in with the same signature that does nothing, so
//! the components compile and render everywhere.

use yew::Callback;
use yew::prelude::{DragEvent, Event, MouseEvent, WheelEvent};

pub use imp::*;

/// What the server sends the page, piece by piece.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))] // built in the browser only
pub enum Fetched {
    /// The names of the runs served, in order.
    Names(Vec<String>),
    /// One file of run `run`.
    File {
        /// The run's index.
        run: usize,
        /// The file name.
        name: String,
        /// Its text.
        text: String,
    },
}

#[cfg(target_arch = "wasm32")]
mod imp {
    use super::{Callback, DragEvent, Event, Fetched, MouseEvent, WheelEvent};
    use wasm_bindgen::JsCast;
    use wasm_bindgen_futures::{JsFuture, spawn_local};
    use web_sys::{Element, File, HtmlInputElement};
    use yew::TargetCast;

    /// Milliseconds from `performance.now()`.
    #[must_use]
    pub fn now_ms() -> f64 {
        web_sys::window()
            .and_then(|w| w.performance())
            .map_or(0.0, |p| p.now())
    }

    /// Record a render time on the page's `#perf` element (as
    /// `data-last-ms`, `data-max-ms`, `data-frames`, `data-view`).
    pub fn report_perf(view: &str, ms: f64) {
        let Some(el) = web_sys::window()
            .and_then(|w| w.document())
            .and_then(|d| d.get_element_by_id("perf"))
        else {
            return;
        };
        let get = |k: &str| el.get_attribute(k).and_then(|v| v.parse::<f64>().ok());
        let same = el.get_attribute("data-view").as_deref() == Some(view);
        let frames = if same {
            get("data-frames").unwrap_or(0.0)
        } else {
            0.0
        } + 1.0;
        let max = if same {
            get("data-max-ms").unwrap_or(0.0).max(ms)
        } else {
            ms
        };
        let sum = if same {
            get("data-sum-ms").unwrap_or(0.0)
        } else {
            0.0
        } + ms;
        let _ = el.set_attribute("data-view", view);
        let _ = el.set_attribute("data-last-ms", &format!("{ms:.1}"));
        let _ = el.set_attribute("data-max-ms", &format!("{max:.1}"));
        let _ = el.set_attribute("data-sum-ms", &format!("{sum:.1}"));
        let _ = el.set_attribute("data-frames", &format!("{frames}"));
        el.set_text_content(Some(&format!(
            "{view}: render {ms:.1} ms (max {max:.1}, mean {:.1} over {frames} frames)",
            sum / frames
        )));
    }

    /// A repeating timer; dropping it stops it.
    pub struct Ticker(#[allow(dead_code)] gloo_timers::callback::Interval);

    /// Call `cb` every `ms` milliseconds until the [`Ticker`] is dropped.
    #[must_use]
    pub fn ticker(ms: u32, cb: Callback<()>) -> Ticker {
        Ticker(gloo_timers::callback::Interval::new(ms, move || {
            cb.emit(());
        }))
    }

    async fn fetch_text(url: &str) -> Option<String> {
        let w = web_sys::window()?;
        let resp: web_sys::Response = JsFuture::from(w.fetch_with_str(url))
            .await
            .ok()?
            .dyn_into()
            .ok()?;
        if !resp.ok() {
            return None;
        }
        JsFuture::from(resp.text().ok()?).await.ok()?.as_string()
    }

    /// Ask the server which runs it serves (`runs.json`), deliver their
    /// names, then each run's files as [`Fetched::File`]. Without a server
    /// nothing is delivered.
    pub fn fetch_runs(cb: Callback<Fetched>) {
        spawn_local(async move {
            let Some(list) = fetch_text("runs.json").await else {
                return;
            };
            let Ok(runs) = serde_json::from_str::<Vec<weft_compare::load::RunListing>>(&list)
            else {
                return;
            };
            cb.emit(Fetched::Names(
                runs.iter().map(|r| r.name.clone()).collect(),
            ));
            for (run, listing) in runs.into_iter().enumerate() {
                for name in listing.files {
                    if let Some(text) = fetch_text(&format!("run/{run}/{name}")).await {
                        cb.emit(Fetched::File { run, name, text });
                    }
                }
            }
        });
    }

    fn read_files(files: Vec<File>, cb: Callback<(String, String)>) {
        for f in files {
            let cb = cb.clone();
            spawn_local(async move {
                let name = f.name();
                match JsFuture::from(f.text()).await {
                    Ok(v) => cb.emit((name, v.as_string().unwrap_or_default())),
                    Err(_) => cb.emit((name, String::new())),
                }
            });
        }
    }

    fn list(l: Option<web_sys::FileList>) -> Vec<File> {
        let Some(l) = l else { return Vec::new() };
        (0..l.length()).filter_map(|i| l.get(i)).collect()
    }

    /// Read the files dropped on the page.
    pub fn read_dropped(e: &DragEvent, cb: Callback<(String, String)>) {
        e.prevent_default();
        read_files(list(e.data_transfer().and_then(|d| d.files())), cb);
    }

    /// Read the files chosen in an `<input type=file>`.
    pub fn read_input(e: &Event, cb: Callback<(String, String)>) {
        let input: HtmlInputElement = e.target_unchecked_into();
        read_files(list(input.files()), cb);
        input.set_value("");
    }

    /// The pointer position as fractions `(x, y)` of the element `node`
    /// refers to. (yew delegates events to the document root, so the
    /// event's `current_target` is not the element the handler is on.)
    #[must_use]
    pub fn relative_pos(e: &MouseEvent, node: &yew::NodeRef) -> Option<(f64, f64)> {
        let el: Element = node.cast::<Element>()?;
        let r = el.get_bounding_client_rect();
        if r.width() <= 0.0 || r.height() <= 0.0 {
            return None;
        }
        Some((
            (f64::from(e.client_x()) - r.left()) / r.width(),
            (f64::from(e.client_y()) - r.top()) / r.height(),
        ))
    }

    /// The wheel's vertical delta (and stop the page from scrolling).
    #[must_use]
    pub fn wheel_delta(e: &WheelEvent) -> f64 {
        e.prevent_default();
        e.delta_y()
    }
}

#[cfg(not(target_arch = "wasm32"))]
mod imp {
    #![allow(clippy::needless_pass_by_value, missing_docs)]
    //! Native stand-ins: nothing to fetch, no clock, no timers.
    use super::{Callback, DragEvent, Event, Fetched, MouseEvent, WheelEvent};

    #[must_use]
    pub fn now_ms() -> f64 {
        0.0
    }
    pub fn report_perf(_view: &str, _ms: f64) {}
    pub struct Ticker;
    #[must_use]
    pub fn ticker(_ms: u32, _cb: Callback<()>) -> Ticker {
        Ticker
    }
    pub fn fetch_runs(_cb: Callback<Fetched>) {}
    pub fn read_dropped(_e: &DragEvent, _cb: Callback<(String, String)>) {}
    pub fn read_input(_e: &Event, _cb: Callback<(String, String)>) {}
    #[must_use]
    pub fn relative_pos(_e: &MouseEvent, _node: &yew::NodeRef) -> Option<(f64, f64)> {
        None
    }
    #[must_use]
    pub fn wheel_delta(_e: &WheelEvent) -> f64 {
        0.0
    }
}
