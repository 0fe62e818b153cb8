//! `weft viz` serves the page built into the binary: no `viz-web/dist`, no
//! `--assets`, no WEFT_VIZ_ASSETS, run from a folder outside the source
//! tree, as an installed `weft` would be; and several run folders at once.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// Kills the server when the test ends, however it ends.
struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET path` over HTTP/1.1: (status line, body).
fn get(addr: &str, path: &str) -> (String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head.lines().next().unwrap_or("").to_owned();
    (status, raw[split + 4..].to_vec())
}

#[test]
fn viz_serves_the_built_in_page_and_several_runs_without_any_built_folder() {
    let dir = std::env::temp_dir().join(format!("weft-viz-embedded-{}", std::process::id()));
    for (run, text) in [("runs/a", "{\"step\":1}\n"), ("runs/b", "{\"step\":2}\n")] {
        std::fs::create_dir_all(dir.join(run)).unwrap();
        std::fs::write(dir.join(run).join("metrics.jsonl"), text).unwrap();
    }
    let child = Command::new(WEFT)
        .args(["viz", "runs/a", "runs/b", "--port", "0"])
        .current_dir(&dir)
        .env_remove("WEFT_VIZ_ASSETS")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("the page built into this binary"), "{line}");
    assert!(line.contains("serving runs/a, runs/b with"), "{line}");
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .to_owned();
    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join("../viz/page");
    for (path, file) in [
        ("/", "index.html"),
        ("/weft_viz_web.js", "weft_viz_web.js"),
        ("/weft_viz_web_bg.wasm", "weft_viz_web_bg.wasm"),
        ("/style.css", "style.css"),
    ] {
        let (status, body) = get(&addr, path);
        assert_eq!(status, "HTTP/1.1 200 OK", "{path}");
        assert!(
            body == std::fs::read(page.join(file)).unwrap(),
            "{path} is not viz/page/{file}"
        );
    }
    let (status, body) = get(&addr, "/runs.json");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(
        String::from_utf8_lossy(&body),
        r#"[{"name":"a","files":["metrics.jsonl"]},{"name":"b","files":["metrics.jsonl"]}]"#
    );
    let (_, body) = get(&addr, "/run/1/metrics.jsonl");
    assert_eq!(body, b"{\"step\":2}\n");
    let (status, body) = get(&addr, "/run/metrics.jsonl");
    assert_eq!(
        (status.as_str(), body.as_slice()),
        ("HTTP/1.1 200 OK", b"{\"step\":1}\n".as_slice())
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
