#!/usr/bin/env python3
"""Drive headless chromium through chromedriver (WebDriver, stdlib only).

Usage: e2e.py DRIVER_URL PAGE_URL OUT_DIR MODE [RUN_DIR...]
MODE: "train" (a real run of weft train) or "run" (synthetic logs): full
checks, every expected count read from RUN_DIR's files; "bad" (malformed
trace); "perf" (large inputs: render and replay times); "compare" (several
RUN_DIRs served together: legend, overlaid curves and the loss difference
against the first run, read from their files).
Exits non-zero with a message on the first failed check.
"""
import base64, json, os, re, sys, tempfile, time, urllib.request

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
    # the page mounts asynchronously (the wasm loads, then the run files):
    # wait for the element rather than race it
    wait_for(f"return document.querySelector({json.dumps(css)}) !== null", css)
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
    """Every SEVERE message of the browser console (the favicon the server
    does not have aside); a console that cannot be read fails the test."""
    try:
        logs = call("POST", S + "/se/log", {"type": "browser"})
    except Exception as e:
        fail("cannot read the browser console: " + repr(e))
    return [l["message"] for l in logs
            if l.get("level") == "SEVERE" and "favicon.ico" not in l["message"]]

def perf():
    return js("const p=document.getElementById('perf');return p?{view:p.dataset.view,last:+p.dataset.lastMs,max:+p.dataset.maxMs,sum:+p.dataset.sumMs,frames:+p.dataset.frames}:null")

def expected(run):
    """What the page must show, read from the run folder's own files."""
    trace = json.load(open(os.path.join(run, "trace.json")))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    order = {e["pid"]: e["args"]["sort_index"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_sort_index"}
    lanes = {}
    for e in events:
        if e.get("ph") == "X" and e["name"] != "idle":  # idle: the lane's background
            key = (order.get(e["pid"], e["pid"]), e["pid"], e.get("tid", 0))
            lanes[key] = lanes.get(key, 0) + 1
    load, layers, experts = {}, set(), 0
    for line in open(os.path.join(run, "expert_load.jsonl")):
        r = json.loads(line)
        tpe = r["tokens_per_expert"]
        experts = len(tpe)
        layers.add(r["layer"])
        acc = load.setdefault(r["step"], [0] * experts)
        load[r["step"]] = [a + b for a, b in zip(acc, tpe)]
    # evaluations are the loss chart's curve; every other event is a
    # health event
    n_events, n_evals, nonfinite, torn = 0, 0, 0, False
    for line in open(os.path.join(run, "metrics.jsonl")):
        try:
            r = json.loads(line)
        except ValueError:
            torn = True
            continue
        if r.get("event") == "eval":
            n_evals += 1
        elif "event" in r:
            n_events += 1
        elif not isinstance(r.get("loss"), (int, float)) or r["loss"] != r["loss"]:
            nonfinite += 1
    # events.jsonl's events with a place on the step axis join them
    ev_path = os.path.join(run, "events.jsonl")
    if os.path.exists(ev_path):
        for line in open(ev_path):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if any(isinstance(r.get(k), int) for k in ("step", "last_step", "from_checkpoint_step")):
                n_events += 1
    # The bubble: the trainer's own figure (summary.json: the mean over the
    # traced steps after the first of each step's bubble in its own window)
    # when a trainer wrote the run, else the trace writer's otherData; and
    # each traced step's figure, where the trace has step marks.
    other = trace.get("otherData", {}) if isinstance(trace, dict) else {}
    bubble, predicted = other.get("bubble_fraction"), other.get("bubble_predicted")
    summary = os.path.join(run, "summary.json")
    if os.path.exists(summary):
        pb = json.load(open(summary)).get("pipeline_bubble")
        if pb is not None:
            bubble, predicted = pb["measured"], pb["predicted"]
    marks = sorted({e["args"]["step"] for e in events
                    if e.get("ph") == "X" and "step" in e.get("args", {})})
    step_bubbles = {s["step"]: s["bubble_fraction"] for s in other.get("step_bubble_fractions", [])}
    return {"lane_events": [lanes[k] for k in sorted(lanes)], "steps": sorted(load),
            "bubble": bubble, "predicted": predicted, "marks": marks, "averaged": other.get("bubble_steps", marks),
            "step_bubbles": step_bubbles,
            "load": load, "layers": len(layers), "experts": experts,
            "events": n_events, "evals": n_evals, "nonfinite": nonfinite, "torn": torn}

try:
    call("POST", S + "/url", {"url": page})
    if mode == "bad":
        text = wait_for("const e=document.querySelector('.error');return e&&e.textContent", "an error message")
        check("trace.json, line" in text, "malformed trace reported with file and line: " + text)
        check(js("return !!document.querySelector('header nav')"), "the page still renders its shell")
        shot("bad-trace.png")
        errs = console_errors()
        check(not errs, "no error in the console " + repr(errs))
    elif mode in ("train", "run"):
        exp = expected(sys.argv[5])
        # Pipeline: one lane per (stage, track) of trace.json, every event
        # accounted for (merged sub-pixel slices carry their count).
        wait_for("return document.querySelectorAll('svg.timeline g.lane').length", "timeline lanes")
        lanes = js("return document.querySelectorAll('svg.timeline').length==1 && [...document.querySelectorAll('svg.timeline g.lane')].map(g=>[...g.querySelectorAll('rect.slice')].reduce((a,r)=>a+(+r.dataset.n),0))")
        check(lanes == exp["lane_events"], f"{len(lanes)} pipeline lanes drawn with {lanes} events; trace.json: {exp['lane_events']}")
        slices = js("return document.querySelectorAll('svg.timeline rect.slice').length")
        kinds = js("return ['k-f','k-b','k-w'].map(k=>document.querySelectorAll('rect.slice.'+k).length)")
        check(all(k > 0 for k in kinds), f"F/B/W each coloured: {kinds}")
        labels = js("return document.querySelectorAll('text.slice-label').length")
        check(labels > 0, f"slices labelled with their micro-batch ({labels})")
        bubble = js("return document.getElementById('bubble-0').textContent")
        check("bubble" in bubble, "bubble fraction shown: " + bubble)
        shown = float(re.match(r"bubble ([0-9.]+)%", bubble).group(1))
        if exp["bubble"] is not None:
            check(abs(shown - 100 * exp["bubble"]) < 0.006,
                  f"bubble {shown}% = {100 * exp['bubble']:.4f}% from the run folder")
        pred = js("const p=document.getElementById('bubble-predicted-0');return p&&p.textContent")
        if exp["predicted"] is not None:
            got = float(re.search(r"([0-9.]+)%", pred or "nan%").group(1))
            check(abs(got - 100 * exp["predicted"]) < 0.006,
                  f"the simulator's prediction shown beside it: {pred} ({100 * exp['predicted']:.4f}%)")
        else:
            check(not pred, "no prediction shown when the run folder has none")
        marks = exp["marks"]
        if marks:
            n, m = len([s for s in exp["averaged"] if s in marks]), len(marks)
            scope = f"({m} step{'s' if m > 1 else ''})" if n == m else f"(mean of {n} of {m} steps)"
            check(bubble.endswith("per step " + scope), f"the bubble is per step, {scope}: {bubble}")
            windows = js("return [...document.querySelectorAll('svg.timeline rect.step-window')].map(r=>+r.dataset.step)")
            check(windows == marks, f"each step's window marked under the axis: {windows}")
            per = js("return document.getElementById('step-bubbles-0').textContent")
            got = {int(a): float(b) for a, b in re.findall(r"step (\d+) ([0-9.]+)%", per)}
            want = exp["step_bubbles"]
            check(sorted(got) == marks[:len(got)] and len(got) == min(m, 12), f"per-step bubbles listed: {per}")
            if want:
                bad = {k: (v, 100 * want[k]) for k, v in got.items() if abs(v - 100 * want[k]) >= 0.006}
                check(not bad, f"each step's bubble (from its events) = the trainer's per-step figure ({len(got)} steps)" + (f": {bad}" if bad else ""))
            mean = sum(got[s] for s in exp["averaged"] if s in got) / max(1, n)
            if exp["bubble"] is not None and n == len([s for s in exp["averaged"] if s in got]):
                check(abs(mean - 100 * exp["bubble"]) < 0.01,
                      f"the mean of the averaged steps' bubbles {mean:.3f}% = the trainer's {100 * exp['bubble']:.3f}%")
        else:
            check(not js("return document.getElementById('step-bubbles-0')"), "no per-step list without step marks")
        x0 = float(js("return document.getElementById('cursor-0').getAttribute('x1')"))
        click("#play")
        time.sleep(1.5)
        x1 = float(js("return document.getElementById('cursor-0').getAttribute('x1')"))
        check(x1 > x0 + 20, f"play moves the cursor ({x0} -> {x1})")
        shot(mode + "-pipeline.png")
        click("#play")
        # hover details: dispatch a mouse move over the middle of the first F slice
        js("""const r=document.querySelector('svg.timeline rect.slice.k-f').getBoundingClientRect();
              const w=document.querySelector('.svg-wrap');
              w.dispatchEvent(new MouseEvent('mousemove',{clientX:r.left+r.width/2,clientY:r.top+r.height/2,bubbles:true}));""")
        det = wait_for("const d=document.getElementById('details');return d&&d.textContent", "hover details", 5)
        check("microbatch" in det, "hover shows the slice's details")
        click("#zoom-in")
        drawn = wait_for("const s=document.querySelectorAll('svg.timeline rect.slice');return [...s].reduce((a,r)=>a+(+r.dataset.n),0)<%d&&s.length" % sum(exp["lane_events"]), "zoom", 5)
        check(drawn > 0, f"zoom in draws a part of the events ({drawn} rectangles)")
        # Expert load: steps x experts, the layers, the bars of the shown step.
        click("#tab-experts")
        wait_for("return document.querySelector('svg.heatmap')", "heatmap")
        h = js("const h=document.querySelector('svg.heatmap').dataset;return [+h.steps,+h.experts,+h.cols,+h.rows]")
        check(h[:2] == [len(exp["steps"]), exp["experts"]], f"heatmap steps x experts = {h}")
        layers = js("return document.querySelectorAll('#layer option').length - 1")
        check(layers == exp["layers"], f"{layers} layers to choose from")
        bars = js("return [...document.querySelectorAll('svg.bars rect.bar title')].map(t=>+t.textContent.match(/: (\\d+) tokens/)[1])")
        step = int(js("return document.querySelector('.experts section:nth-of-type(2) h2').textContent.match(/^step (\\d+)/)[1]"))
        check(bars == exp["load"][step], f"step {step}: bars {bars} = tokens per expert summed over layers in expert_load.jsonl")
        s0 = float(js("return document.getElementById('step-cursor').getAttribute('x1')"))
        click("#play")
        time.sleep(1.2)
        s1 = float(js("return document.getElementById('step-cursor').getAttribute('x1')"))
        check(s1 > s0, f"play moves the step cursor ({s0} -> {s1})")
        click("#play")
        shot(mode + "-experts.png")
        # Metrics: four charts, one marker per health event per chart.
        click("#tab-metrics")
        wait_for("return document.querySelectorAll('.chart svg').length==4", "metrics charts")
        ev = js("return document.querySelectorAll('.chart line.event').length")
        check(ev == 4 * exp["events"], f"{exp['events']} health events marked on each of 4 charts ({ev})")
        dots = js("return document.querySelectorAll('.chart g.evals circle.point').length")
        curves = js("return document.querySelectorAll('.chart path.eval-series').length")
        check(dots == exp["evals"] and curves == (exp["evals"] > 0),
              f"{exp['evals']} evaluations drawn as the loss chart's eval curve ({curves} curve, {dots} dots)")
        check(js("return document.querySelectorAll('.ev-eval').length") == 0, "evaluations are not health events")
        nf = js("return +document.querySelector('.chart svg').dataset.nonfinite")
        check(nf == exp["nonfinite"], f"{nf} non-finite loss steps marked")
        warn = js("return document.querySelector('.warning')?.textContent || ''")
        if exp["torn"]:
            check("metrics.jsonl, line" in warn, "torn last line reported: " + warn)
        else:
            check("metrics.jsonl" not in warn, "no warning for a complete metrics.jsonl: " + repr(warn))
        shot(mode + "-metrics.png")
        # the last 10% of the steps: fewer points on the loss chart; log y
        pts = js("return +document.querySelector('.chart svg').dataset.points")
        js("const r=document.getElementById('range');r.value='10';r.dispatchEvent(new Event('change',{bubbles:true}))")
        fewer = wait_for("const n=+document.querySelector('.chart svg').dataset.points;return n<%d&&n" % pts, "last 10%", 5)
        check(0 < fewer < pts, f"last 10% of the steps: {fewer} of {pts} loss points drawn")
        click("#log-loss")
        wait_for("return document.querySelector('.chart h3').textContent.includes('log scale')", "log-scale loss", 5)
        check(True, "log-scale loss")
        shot(mode + "-metrics-zoomed.png")
        js("const r=document.getElementById('range');r.value='100';r.dispatchEvent(new Event('change',{bubbles:true}))")
        click("#log-loss")
        click("#tab-overview")
        wait_for("return document.querySelector('pre.config')", "overview")
        shot(mode + "-overview.png")
        errs = console_errors()
        check(not errs, "no error in the console " + repr(errs))
    elif mode == "compare":
        runs = sys.argv[5:]
        names = [os.path.basename(r.rstrip("/")) for r in runs]
        def losses(run):
            out = {}
            for line in open(os.path.join(run, "metrics.jsonl")):
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if "event" not in r and isinstance(r.get("loss"), (int, float)):
                    out[r["step"]] = r["loss"]  # the last line of a step wins
            return out
        base = losses(runs[0])
        click("#tab-metrics")
        charts = 4 + (len(runs) > 1)
        wait_for(f"return document.querySelectorAll('.chart svg').length=={charts}", "metrics charts")
        legend = js("return [...document.querySelectorAll('.run-legend .run-key')].map(e=>e.textContent)")
        check(legend == names, f"legend names the runs {names} ({legend})")
        per_chart = js("return [...document.querySelectorAll('.chart:not(.diff) svg')].map(s=>s.querySelectorAll('path.series').length)")
        check(per_chart == [len(runs)] * 4, f"one curve per run on each of the 4 charts ({per_chart})")
        drawn = js("return [...document.querySelectorAll('.chart:not(.diff) svg')].map(s=>[...s.querySelectorAll('path.series')].map(p=>p.getAttribute('d').length))")
        check(all(all(n > 0 for n in c) for c in drawn), "every curve is drawn")
        diffs = js("return [...document.querySelectorAll('#loss-diff path.series')].map(p=>[p.dataset.run,+p.dataset.steps,+p.dataset.maxAbs])")
        check(len(diffs) == len(runs) - 1, f"one difference curve per other run ({len(diffs)})")
        for (name, steps, max_abs), run in zip(diffs, runs[1:]):
            other = losses(run)
            common = sorted(set(base) & set(other))
            want = max(abs(other[s] - base[s]) for s in common)
            check(name == os.path.basename(run.rstrip("/")), f"difference curve of {name}")
            check(steps == len(common), f"{name}: the difference at the {len(common)} steps both runs have ({steps})")
            check(abs(max_abs - want) <= 1e-9 * max(1.0, want), f"{name}: max |loss difference| {want:.6g} ({max_abs:.6g})")
        shot(mode + "-metrics.png")
        errs = console_errors()
        check(not errs, "no error in the console " + repr(errs))
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
