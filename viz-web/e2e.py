#!/usr/bin/env python3
"""Drive headless chromium through chromedriver (WebDriver, stdlib only).

Usage: e2e.py DRIVER_URL PAGE_URL OUT_DIR MODE
MODE: "run" (full checks on the small run), "bad" (malformed trace),
"perf" (large inputs: render and replay times).
Exits non-zero with a message on the first failed check.
"""
import base64, json, os, sys, tempfile, time, urllib.request

driver, page, out, mode = sys.argv[1:5]

def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(driver + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["value"]

flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--user-data-dir=" + tempfile.mkdtemp(prefix="weft-viz-chrome-"), "--window-size=1440,1000"]
caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome",
        "goog:chromeOptions": {"binary": os.environ.get("CHROMIUM", "/usr/bin/chromium"), "args": flags},
        "goog:loggingPrefs": {"browser": "ALL"}}}}
sid = call("POST", "/session", caps)["sessionId"]
S = "/session/" + sid

def js(script, *args):
    return call("POST", S + "/execute/sync", {"script": script, "args": list(args)})

def wait_for(script, what, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = js(script)
        if v:
            return v
        time.sleep(0.1)
    fail("timed out waiting for " + what)

def click(css):
    el = call("POST", S + "/element", {"using": "css selector", "value": css})
    call("POST", S + "/element/" + list(el.values())[0] + "/click", {})

def shot(name):
    png = call("GET", S + "/screenshot")
    with open(os.path.join(out, name), "wb") as f:
        f.write(base64.b64decode(png))
    print("screenshot", os.path.join(out, name))

def fail(msg):
    print("E2E FAIL:", msg)
    try:
        shot("failure.png")
        print(js("return document.body.innerText.slice(0, 2000)"))
    finally:
        call("DELETE", S)
    sys.exit(1)

def check(cond, msg):
    if not cond:
        fail(msg)
    print("ok:", msg)

def console_errors():
    try:
        logs = call("POST", S + "/se/log", {"type": "browser"})
    except Exception:
        return []
    return [l["message"] for l in logs if l.get("level") == "SEVERE"]

def perf():
    return js("const p=document.getElementById('perf');return p?{view:p.dataset.view,last:+p.dataset.lastMs,max:+p.dataset.maxMs,sum:+p.dataset.sumMs,frames:+p.dataset.frames}:null")

try:
    call("POST", S + "/url", {"url": page})
    if mode == "bad":
        text = wait_for("const e=document.querySelector('.error');return e&&e.textContent", "an error message")
        check("trace.json, line" in text, "malformed trace reported with file and line: " + text)
        check(js("return !!document.querySelector('header nav')"), "the page still renders its shell")
        shot("bad-trace.png")
        errs = [e for e in console_errors() if "panicked" in e or "unreachable" in e]
        check(not errs, "no panic in the console " + repr(errs))
    elif mode == "run":
        wait_for("return document.querySelectorAll('svg.timeline g.lane').length", "timeline lanes")
        lanes = js("return document.querySelectorAll('svg.timeline g.lane').length")
        check(lanes == int(os.environ["E2E_LANES"]), f"{lanes} pipeline lanes drawn")
        slices = js("return document.querySelectorAll('svg.timeline rect.slice').length")
        check(slices == int(os.environ["E2E_SLICES"]), f"{slices} slices drawn (F, B, W)")
        kinds = js("return ['k-f','k-b','k-w'].map(k=>document.querySelectorAll('rect.slice.'+k).length)")
        check(all(k > 0 for k in kinds) and len(set(kinds)) >= 1, f"F/B/W each coloured: {kinds}")
        labels = js("return document.querySelectorAll('text.slice-label').length")
        check(labels == slices, f"every slice labelled with its micro-batch ({labels})")
        bubble = js("return document.getElementById('bubble-0').textContent")
        check("bubble" in bubble, "bubble fraction shown: " + bubble)
        x0 = float(js("return document.getElementById('cursor-0').getAttribute('x1')"))
        click("#play")
        time.sleep(1.5)
        x1 = float(js("return document.getElementById('cursor-0').getAttribute('x1')"))
        check(x1 > x0 + 20, f"play moves the cursor ({x0} -> {x1})")
        shot("pipeline.png")
        click("#play")
        # hover details: dispatch a mouse move over the middle of lane 0's first slice
        js("""const r=document.querySelector('svg.timeline rect.slice').getBoundingClientRect();
              const w=document.querySelector('.svg-wrap');
              w.dispatchEvent(new MouseEvent('mousemove',{clientX:r.left+r.width/2,clientY:r.top+r.height/2,bubbles:true}));""")
        det = wait_for("const d=document.getElementById('details');return d&&d.textContent", "hover details", 5)
        check("microbatch" in det, "hover shows the slice's details")
        click("#zoom-in")
        drawn = wait_for("const s=document.querySelectorAll('svg.timeline rect.slice').length;return s<%d&&s" % slices, "zoom", 5)
        check(drawn < slices, f"zoom in draws fewer slices ({drawn})")
        click("#tab-experts")
        wait_for("return document.querySelector('svg.heatmap')", "heatmap")
        h = js("const h=document.querySelector('svg.heatmap').dataset;return [+h.steps,+h.experts,+h.cols,+h.rows]")
        check(h[0] == int(os.environ["E2E_STEPS"]) and h[1] == int(os.environ["E2E_EXPERTS"]), f"heatmap steps x experts = {h}")
        bars = js("return document.querySelectorAll('svg.bars rect.bar').length")
        check(bars == int(os.environ["E2E_EXPERTS"]), f"{bars} expert bars for the current step")
        s0 = float(js("return document.getElementById('step-cursor').getAttribute('x1')"))
        click("#play")
        time.sleep(1.2)
        s1 = float(js("return document.getElementById('step-cursor').getAttribute('x1')"))
        check(s1 > s0, f"play moves the step cursor ({s0} -> {s1})")
        click("#play")
        shot("experts.png")
        click("#tab-metrics")
        wait_for("return document.querySelectorAll('.chart svg').length==4", "metrics charts")
        ev = js("return document.querySelectorAll('.chart line.event').length")
        nev = int(os.environ["E2E_EVENTS"])
        check(ev == 4 * nev, f"{nev} health events marked on each of 4 charts ({ev})")
        nf = js("return +document.querySelector('.chart svg').dataset.nonfinite")
        check(nf == 1, "the NaN loss step is marked")
        warn = js("return document.querySelector('.warning')?.textContent || ''")
        check("metrics.jsonl, line" in warn, "torn last line reported: " + warn)
        shot("metrics.png")
        click("#tab-overview")
        wait_for("return document.querySelector('pre.config')", "overview")
        shot("overview.png")
        errs = console_errors()
        check(not [e for e in errs if "panicked" in e], "no panic in the console")
    elif mode == "perf":
        wait_for("return document.querySelectorAll('svg.timeline g.lane').length", "timeline", 120)
        time.sleep(0.5)
        p = perf()
        drawn = js("return document.querySelector('svg.timeline').dataset.drawn")
        print(f"PERF pipeline first render: {p['last']:.1f} ms ({drawn} rectangles drawn at fit)")
        t0 = time.time()
        js("window.__t=performance.now()")
        click("#play")
        time.sleep(3)
        click("#play")
        p = perf()
        print(f"PERF pipeline replay: {p['frames']:.0f} frames, mean {p['sum']/p['frames']:.1f} ms, max {p['max']:.1f} ms")
        for _ in range(3):
            click("#zoom-in")
        p = perf()
        print(f"PERF pipeline zoomed render: {p['last']:.1f} ms")
        click("#tab-experts")
        wait_for("return document.querySelector('svg.heatmap')", "heatmap", 120)
        time.sleep(0.5)
        p = perf()
        print(f"PERF experts first render (heatmap image built): {p['last']:.1f} ms")
        click("#play")
        time.sleep(3)
        click("#play")
        p = perf()
        print(f"PERF experts replay: {p['frames']:.0f} frames, mean {p['sum']/p['frames']:.1f} ms, max {p['max']:.1f} ms")
        shot("perf-experts.png")
        click("#tab-metrics")
        wait_for("return document.querySelectorAll('.chart svg').length==4", "metrics", 120)
        time.sleep(0.3)
        print(f"PERF metrics render: {perf()['last']:.1f} ms")
finally:
    try:
        call("DELETE", S)
    except Exception:
        pass
print("E2E PASS", mode)
