"""The guide as a site: `mkdocs build --strict` passes, and a real browser draws its pages.

The build (mkdocs.yml) fails on any warning: a page missing from the nav, a link to a page or
an anchor that does not exist, math that cannot be converted. The browser test serves the
built site on 127.0.0.1, opens pages in headless Chromium (Debian's ``chromium`` package)
through the DevTools protocol, and checks that each page drew: its text and images are laid
out, its math is typeset as MathML, the search finds a word, and nothing was logged as an
error (an exception, a failed request, a console error). It skips where Chromium is missing.
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

pytest.importorskip("mkdocs")
pytest.importorskip("material")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once by `mkdocs build --strict` into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    return out


def nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav lists, in order."""
    return re.findall(r":\s*([\w/]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)


def test_every_page_is_in_the_nav_once():
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(nav_pages()) == pages


def test_the_site_is_built_strict_with_search_math_and_images(site):
    index = json.loads((site / "search" / "search_index.json").read_text())
    searched = {d["location"].split("#")[0] for d in index["docs"]}
    for page in nav_pages():
        html = page.replace(".md", ".html")
        assert (site / html).is_file(), html
        assert html in searched or (page == "index.md" and "" in searched), html
    for img in (DOCS / "img").iterdir():
        assert (site / "img" / img.name).is_file(), img.name
    text = (site / "pipeline.html").read_text()
    assert text.count("<math") >= 3 and "arithmatex" not in text


def test_the_site_needs_no_network(site):
    """No page loads a script, style sheet, font or image from another host."""
    remote = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""")
    for page in site.rglob("*.html"):
        hits = remote.findall(page.read_text())
        assert not hits, f"{page.name} loads {hits[:3]}"
    for css in site.rglob("*.css"):
        assert not re.search(r"@import|url\(\s*[\"']?(https?:)?//", css.read_text()), css.name


# --- the browser ------------------------------------------------------------------------------

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))
                 if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (apt-get install chromium)")


class DevTools:
    """A page of headless Chromium, driven over the DevTools protocol (one websocket)."""

    def __init__(self, ws):
        self.ws, self.next_id, self.events = ws, 0, []

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def pump(self, seconds: float) -> None:
        """Collect the events that arrive within ``seconds``."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.ws.settimeout(left)
            try:
                self.events.append(json.loads(self.ws.recv()))
            except Exception:  # the timeout
                break
        self.ws.settimeout(30)

    def js(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = self.js(expression)
            if value:
                return value
            self.pump(0.1)
        raise AssertionError(f"timed out waiting for {expression}")

    def errors(self) -> list[str]:
        """What the page logged as an error: uncaught exceptions, console.error, failed loads."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(p["exceptionDetails"].get("exception", {}).get("description")
                           or p["exceptionDetails"].get("text"))
            elif m == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"{p['entry']['text']} {p['entry'].get('url', '')}")
        return out


@pytest.fixture(scope="module")
def browser(site):
    """(DevTools of one page, the site's base URL); the server and Chromium stop afterwards."""
    websocket = pytest.importorskip("websocket")
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    profile = tempfile.mkdtemp(prefix="refmp-chromium-")
    proc = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-extensions", "--disable-background-networking", "--window-size=1280,900",
         f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = pathlib.Path(profile) / "DevToolsActivePort"
        end = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < end, "Chromium did not start"
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30,
                                         suppress_origin=True)
        tools = DevTools(ws)
        for domain in ("Page", "Runtime", "Log"):
            tools.call(f"{domain}.enable")
        yield tools, f"http://127.0.0.1:{server.server_address[1]}"
        ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no line per request on stderr
        pass


def open_page(tools: DevTools, url: str) -> None:
    tools.events.clear()
    tools.call("Page.navigate", url=url)
    tools.wait_for("document.readyState === 'complete'")
    tools.pump(0.5)  # late work: the search worker loading its index


def screenshot_colours(tools: DevTools) -> int:
    """How many distinct colours the viewport shows (1 for a blank page), from a PNG
    screenshot decoded here (8-bit RGB or RGBA, the five PNG row filters undone)."""
    clip = {"x": 0, "y": 0, "width": 1280, "height": 900, "scale": 0.25}  # small: decoded in Python
    png = base64.b64decode(tools.call("Page.captureScreenshot", format="png", clip=clip)["data"])
    width, height, depth, colour = struct.unpack(">IIBB", png[16:26])
    assert depth == 8 and colour in (2, 6), (depth, colour)
    data, pos = b"", 8
    while pos < len(png):  # the IDAT chunks hold one zlib stream
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data += png[pos + 8:pos + 8 + n] if kind == b"IDAT" else b""
        pos += 12 + n
    raw, bpp = zlib.decompress(data), 3 if colour == 2 else 4
    stride, prev, colours = width * bpp, bytearray(width * bpp), set()
    for y in range(0, height):
        kind, row = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a, b = row[i - bpp] if i >= bpp else 0, prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            row[i] = (row[i] + (0, a, b, (a + b) // 2,
                                a if pa <= pb and pa <= pc else b if pb <= pc else c)[kind]) & 255
        colours.update(bytes(row[i:i + 3]) for i in range(0, stride, bpp))
        prev = row
    return len(colours)


PAGE_CHECK = """(() => {
  const article = document.querySelector("article");
  const maths = [...article.querySelectorAll("math")];
  const imgs = [...article.querySelectorAll("img")];
  return {
    title: document.title,
    text: article.innerText.length,
    height: article.getBoundingClientRect().height,
    maths: maths.length,
    mathDrawn: maths.filter(m => m.getBoundingClientRect().height > 0
                             && getComputedStyle(m).display.includes("math")).length,
    rawTex: /\\\\(frac|sum|left)|\\$\\$/.test(article.innerText),
    imgs: imgs.length,
    imgsDrawn: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
  };
})()"""


@needs_chromium
@pytest.mark.parametrize("page", ["index.html", "pipeline.html", "collectives.html"])
def test_a_browser_draws_the_page(browser, page):
    tools, base = browser
    open_page(tools, f"{base}/{page}")
    got = tools.js(PAGE_CHECK)
    assert got["text"] > 500 and got["height"] > 400, got
    assert got["mathDrawn"] == got["maths"], got
    if page != "index.html":
        assert got["maths"] >= 3, got  # the strategy pages typeset their formulas
    assert not got["rawTex"], got
    assert got["imgsDrawn"] == got["imgs"], got
    assert screenshot_colours(tools) > 20, "the page looks blank"
    assert tools.errors() == [], tools.errors()


@needs_chromium
def test_the_search_finds_a_page(browser):
    tools, base = browser
    open_page(tools, f"{base}/index.html")
    tools.js("""(() => {
      const input = document.querySelector("input.md-search__input");
      input.focus();
      input.value = "bubble";
      input.dispatchEvent(new Event("input", {bubbles: true}));
      input.dispatchEvent(new KeyboardEvent("keyup", {bubbles: true}));
    })()""")
    found = tools.wait_for(
        "[...document.querySelectorAll('.md-search-result__item a')].map(a => a.href)")
    assert any("pipeline.html" in href for href in found), found
    assert tools.errors() == [], tools.errors()


# --- what the hooks draw: pictures from the placement tables, the explorer from refmp.cost ---

STRATEGY_PAGES = ["data_parallel", "pipeline", "tensor_parallel", "experts", "zero", "compression",
                  "context_parallel", "architecture"]
FLOWS = {"ring_allreduce": "collectives", "megatron": "tensor_parallel", "zero_flat": "zero",
         "ulysses": "context_parallel", "moe": "experts"}  # docs/_hooks/flows.py, by page


def hook(name: str):
    """A module of docs/_hooks, imported as mkdocs imports it (its folder on the path)."""
    sys.path.insert(0, str(DOCS / "_hooks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(DOCS / "_hooks"))


def test_every_strategy_page_shows_its_picture_and_the_explorer_table_is_small(site):
    for page in STRATEGY_PAGES:
        assert (site / "img" / "holds" / f"{page}.svg").read_text().startswith("<svg"), page
        assert f'src="img/holds/{page}.svg"' in (site / f"{page}.html").read_text(), page
    for svg in ("hybrid_cp", "hsdp", "folding"):  # the two-level strategies, on one page
        assert (site / "img" / "holds" / f"{svg}.svg").read_text().startswith("<svg"), svg
        assert f'src="img/holds/{svg}.svg"' in (site / "frontier.html").read_text(), svg
    for page, svg in (("pipeline_at_scale", "pipeline"), ("collectives", "collectives")):
        assert f'src="img/measured/{svg}.svg"' in (site / f"{page}.html").read_text(), page
    for name, page in FLOWS.items():  # the data-flow pictures, each on its page
        assert (site / "img" / "flow" / f"{name}.svg").read_text().startswith("<svg"), name
        assert f'src="img/flow/{name}.svg"' in (site / f"{page}.html").read_text(), name
    table = (site / "explorer" / "table.js").read_text()
    assert table.startswith("window.REFMP_EXPLORER = ") and len(table) < 50_000, len(table)
    for name in hook("explorer").MODELS:  # one file a model, each loaded on its own
        text = (site / "explorer" / f"{name}.js").read_text()
        assert text.startswith("window.REFMP_EXPLORER.layouts[") and len(text) < 300_000, name
    assert not (site / "data").exists()  # the measured files stay out of the site


def test_the_explorers_tiny_is_refmp_bench_tiny():
    from refmp.cli.bench import PRESETS

    tiny = hook("explorer").TINY
    bench = PRESETS["tiny"]
    assert (tiny.n_layer, tiny.n_embd, tiny.n_head, tiny.block_size, tiny.vocab_size) == (
        bench["n_layer"], bench["n_embd"], bench["n_head"], bench["block_size"], bench["vocab"])


# (the options chosen on the page, by their text, one after another; the Layout of 8 GPUs and a
# batch of 64 in M micro-batches that they mean, written out here: dp = 8 / (tp pp cp),
# b = 64 / (M dp); tiny-moe is refmp bench's tiny with 4 experts)
EXPLORED = [
    ("gpt2", {"tp": "4"}, dict(tp=4, dp=2, microbatch_size=4, mixed_precision="none")),
    ("gpt2", {"tp": "2", "zero": "3", "sequence_parallel": "on", "recompute": "selective",
              "mixed_precision": "bf16"},
     dict(tp=2, dp=4, zero=3, sequence_parallel=True, recompute="selective",
          mixed_precision="bf16", microbatch_size=2)),
    ("gpt3-6.7b", {"tp": "2", "pp": "2", "zero": "1", "sequence_parallel": "off",
                   "recompute": "full", "schedule": "interleaved (v = 2)"},
     dict(tp=2, pp=2, dp=2, zero=1, recompute="full", mixed_precision="bf16",
          microbatch_size=4, schedule="interleaved", virtual_stages=2)),
    ("tiny-moe", {"mixed_precision": "fp32", "tp": "1", "pp": "1", "schedule": "1f1b",
                  "zero": "0", "recompute": "none", "cp": "2", "ep": "2"},
     dict(cp=2, ep=2, dp=4, mixed_precision="none", microbatch_size=2)),
    ("gpt2", {"mixed_precision": "bf16", "pp": "2", "cp": "1", "microbatches": "16",
              "zero": "1", "recompute": "selective"},
     dict(pp=2, dp=4, zero=1, recompute="selective", mixed_precision="bf16", microbatch_size=1)),
    # hierarchical cp (Ulysses 2 x ring 2), then HSDP (ZeRO-3 in shard groups of 2 dp ranks)
    ("gpt2", {"pp": "1", "microbatches": "8", "zero": "0", "recompute": "none", "cp": "4",
              "cp_ulysses": "2"},
     dict(cp=4, cp_ulysses=2, dp=2, mixed_precision="bf16", microbatch_size=4)),
    ("gpt2", {"cp_ulysses": "1", "cp": "1", "zero": "3", "dp_shard": "2"},
     dict(dp=8, zero=3, dp_shard=2, mixed_precision="bf16", microbatch_size=1)),
    # FP8: current scaling over tp; delayed with ZeRO-3's FP8 weight gathers; MXFP8 in fp32
    ("gpt2", {"dp_shard": "0", "zero": "0", "tp": "2", "fp8": "current (per tensor)"},
     dict(tp=2, dp=4, fp8="tensor", mixed_precision="bf16", microbatch_size=2)),
    ("gpt2", {"fp8": "delayed (amax history)", "zero": "3", "weight_gather": "FP8 (MXFP8)"},
     dict(tp=2, dp=4, zero=3, fp8="delayed", weight_gather="fp8", mixed_precision="bf16",
          microbatch_size=2)),
    ("tiny", {"mixed_precision": "fp32", "weight_gather": "the compute dtype", "zero": "0",
              "fp8": "MXFP8"},
     dict(tp=2, dp=4, fp8="mxfp8", mixed_precision="none", microbatch_size=2)),
    # MoE parallel folding: ep 4 over tp 2 x dp 4's ranks, then each expert split over etp 2
    ("tiny-moe", {"fp8": "off", "ep": "4", "etp": "1"},
     dict(tp=2, dp=4, ep=4, etp=1, mixed_precision="none", microbatch_size=2)),
    ("tiny-moe", {"ep": "2", "etp": "2"},
     dict(tp=2, dp=4, ep=2, etp=2, mixed_precision="none", microbatch_size=2)),
]
# the options that the last cases turn on, off: each changes what is shown
PLAIN = dict(cp_ulysses=1, dp_shard=0, fp8="none", weight_gather="none", etp=0)


def model_of(name: str):
    """The explorer's model: refmp plan's preset, or refmp bench's tiny (with 4 experts)."""
    from refmp.cli.bench import PRESETS
    from refmp.cost.machines import MODELS
    from refmp.nn.params import GPTConfig

    if name.startswith("tiny"):
        t = PRESETS["tiny"]
        return GPTConfig(n_layer=t["n_layer"], n_embd=t["n_embd"], n_head=t["n_head"],
                         vocab_size=t["vocab"], block_size=t["block_size"],
                         n_expert=4 if name == "tiny-moe" else 0)
    L, C, NH, V, T = MODELS[name]
    return GPTConfig(n_layer=L, n_embd=C, n_head=NH, vocab_size=V, block_size=T)

SHOWN = """(() => ({
  memory: Object.fromEntries([...document.querySelectorAll("[id^=explorer-mem-]")]
                             .map(td => [td.id.slice(13), Number(td.dataset.bytes)])),
  bytes: [...document.querySelectorAll("#explorer-bytes td[data-axis]")]
         .map(td => [td.dataset.axis, td.dataset.op, Number(td.dataset.bytes)]),
  ms: Number(document.getElementById("explorer-step")?.dataset.ms),
  bubble: document.getElementById("explorer-bubble")?.dataset.bubble ?? null,
  refused: document.getElementById("explorer-refused")?.textContent ?? null,
}))()"""


def choose(tools: DevTools, name: str, text: str) -> None:
    """Pick an option of one of the explorer's fields by its text, as a reader does."""
    assert tools.js(f"""(() => {{
      const s = document.getElementById("explorer-{name}");
      const o = [...s.options].find(o => o.text === {json.dumps(text)});
      if (!o) return false;
      s.value = o.value;
      s.dispatchEvent(new Event("change"));
      return true;
    }})()"""), (name, text)
    tools.wait_for("document.getElementById('explorer-loading') === null")  # a model's table


@needs_chromium
def test_the_explorer_shows_what_refmp_cost_computes(browser, site):
    """Change the explorer's fields as a reader does; the memory per rank shown is
    refmp.cost.memory.memory of that layout, its bytes per axis and step time predict's, its
    bubble the simulator's; no error, no request to another host, from the server or from disk."""
    from dataclasses import replace

    from refmp.cost.machines import MACHINES
    from refmp.cost.memory import memory
    from refmp.cost.model import Layout, predict
    from refmp.parallel.pipeline.simulate import simulate_schedule

    tools, base = browser
    tools.call("Network.enable")
    open_page(tools, f"{base}/explorer.html")
    assert tools.js("document.getElementById('explorer-tp').selectedOptions[0].text") == "1"
    for model, fields, layout in EXPLORED:
        choose(tools, "model", model)
        for name, text in fields.items():
            choose(tools, name, text)
        got = tools.js(SHOWN)
        assert got["refused"] is None, (fields, got["refused"])
        mcfg = model_of(model)
        lay = Layout(**layout)
        want = memory(lay, mcfg, 64)
        assert got["memory"] == {k: want[k] for k in got["memory"]}, (fields, got["memory"], want)
        assert len(got["memory"]) == 5
        pred = predict(lay, mcfg, 64, MACHINES["dgx-a100"])
        assert sorted(got["bytes"]) == sorted([a, op, b] for a, ops in pred["bytes"][0].items()
                                              for op, b in ops.items() if b), fields
        assert got["ms"] == float(f"{1e3 * pred['step_seconds']:.4g}"), fields
        plain = {k: v for k, v in PLAIN.items() if k in layout}
        if plain:  # the option's own figures: not those of the layout without it
            other = replace(lay, **plain)
            moved = predict(other, mcfg, 64, MACHINES["dgx-a100"])["bytes"][0]
            assert (memory(other, mcfg, 64), moved) != (want, pred["bytes"][0]), fields
        if lay.pp > 1:
            M = 64 // (lay.dp * lay.microbatch_size)
            sim = simulate_schedule(lay.schedule, lay.pp, M, lay.virtual_stages)
            assert float(got["bubble"]) == sim.bubble(), fields
    choose(tools, "etp", "off (experts copied over tp)")
    choose(tools, "ep", "1")
    choose(tools, "fp8", "off")
    choose(tools, "tp", "2")
    choose(tools, "model", "gpt2-xl")  # 25 heads: refmp's own refusal
    assert "must divide the number of heads" in tools.js(SHOWN)["refused"]
    # the same page opened from the built site on disk
    tools.events.clear()
    tools.call("Page.navigate", url=(site / "explorer.html").as_uri())
    tools.wait_for("document.getElementById('explorer-mem-params') !== null")
    choose(tools, "tp", "4")
    assert tools.js(SHOWN)["memory"]["params"] > 0
    tools.pump(0.5)
    hosts = [e["params"]["request"]["url"] for e in tools.events
             if e.get("method") == "Network.requestWillBeSent"]
    assert hosts and all(u.startswith(("file://", "data:")) for u in hosts), hosts
    # from disk the theme's search asks for search/search_index.js, which mkdocs' search
    # plugin does not write (it serves search_index.json): the one error allowed there
    assert [e for e in tools.errors() if "search/search_index.js" not in e] == [], tools.errors()
    tools.call("Page.navigate", url="about:blank")
    tools.pump(0.2)


@needs_chromium
def test_every_picture_loads_and_nothing_comes_from_another_host(browser):
    """A strategy page draws its picture; every picture the hooks wrote loads as an image (all
    of them, from that page); every request went to the site's own server."""
    tools, base = browser
    tools.call("Network.enable")
    open_page(tools, f"{base}/tensor_parallel.html")
    assert tools.js(PAGE_CHECK)["imgsDrawn"] == tools.js(PAGE_CHECK)["imgs"]
    svgs = [f"img/holds/{p}.svg" for p in STRATEGY_PAGES] + ["img/measured/pipeline.svg",
                                                             "img/measured/collectives.svg"] \
        + [f"img/flow/{name}.svg" for name in FLOWS]
    widths = tools.js(f"""Promise.all({json.dumps(svgs)}.map(src => new Promise(done => {{
      const i = new Image();
      i.onload = () => done(i.naturalWidth);
      i.onerror = () => done(0);
      i.src = src;
    }})))""")
    assert all(w > 100 for w in widths), dict(zip(svgs, widths, strict=True))
    assert tools.errors() == [], tools.errors()
    urls = [e["params"]["request"]["url"] for e in tools.events
            if e.get("method") == "Network.requestWillBeSent"]
    assert urls and all(u.startswith((base, "data:")) for u in urls), sorted(set(urls))


# --- the core files annotated side by side (docs/_hooks/annotate.py) -------------------------


def core_files() -> list[str]:
    return hook("annotate").core_files((DOCS / "reading.md").read_text())


def test_every_line_of_a_core_file_is_shown_once_in_order():
    """The cut loses nothing: each line is code, a whole-line comment or a docstring line, once;
    the code keeps the file's order, the notes hold every comment and docstring, and the
    coloured lines are the file's lines."""
    import ast

    annotate = hook("annotate")
    files = core_files()
    assert len(files) >= 16, files
    for path in files:
        source = (ROOT / path).read_text()
        n = len(source.splitlines())
        cut = annotate.cut(source)
        code = [k for s in cut.sections for k in s.code]
        assert code == sorted(set(code)), path
        blank = {k for k, line in enumerate(source.splitlines(), 1) if not line.strip()}
        shown = set(code) | cut.comments | cut.docstrings
        assert not (set(code) & (cut.comments | cut.docstrings)), path
        assert shown | blank == set(range(1, n + 1)), (path, sorted(set(range(1, n + 1)) - shown))
        notes = "\n".join(p for s in cut.sections for p in s.note)
        for node in ast.walk(ast.parse(source)):
            doc = ast.get_docstring(node) if isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef) else None
            assert doc is None or doc in notes, (path, doc[:60] if doc else doc)
        plain = [re.sub(r"<[^>]+>", "", line) for line in annotate.coloured_lines(source)]
        import html as html_lib
        assert [html_lib.unescape(line) for line in plain][:n] == source.splitlines(), path


def test_a_note_typesets_its_math_and_the_pages_are_linked(site):
    """TeX in a comment becomes MathML, as on every page; every core file has its page, linked
    from docs/reading.md's table, its code lines in it."""
    annotate = hook("annotate")

    class Page:
        class file:  # noqa: N801 (what the MathML hook reads of a page)
            src_uri = "source/x.md"

    body = annotate.typeset(annotate.page_html("x.py", "# the norm \\(\\sqrt{x^2}\\)\ny = 1\n",
                                               "../reading.html"), Page)
    assert "<math" in body and "arithmatex" not in body and "<msqrt>" in body, body
    reading = (site / "reading.html").read_text()
    for path in core_files():
        page = annotate.page_of(path).replace(".md", ".html")
        assert f'href="{page}"' in reading, page
        text = (site / page).read_text()
        assert 'class="annotated"' in text and path in text, page
    assert "source/refmp.parallel.tensor.linear.html" in (site / "tensor_parallel.html").read_text()


SIDE_BY_SIDE = """(() => {
  const notes = [...document.querySelectorAll(".annotated > .note")];
  const codes = [...document.querySelectorAll(".annotated > .code")];
  const box = e => e.getBoundingClientRect();
  return {
    rows: notes.length, codes: codes.length,
    beside: notes.filter((n, i) => box(n).right <= box(codes[i]).left + 1
                                   && Math.abs(box(n).top - box(codes[i]).top) < 2).length,
    code: codes.map(c => c.innerText).join("\\n"),
    note: notes.map(n => n.innerText).join("\\n"),
    coloured: document.querySelectorAll(".annotated .code .k, .annotated .code .nf").length,
    overflow: document.documentElement.scrollWidth - window.innerWidth,
    back: document.querySelector('.md-content a[href="../reading.html"]') !== null,
  };
})()"""


@needs_chromium
def test_a_browser_draws_a_core_file_side_by_side(browser):
    """ring.py's page: each note beside its code, coloured, no page-wide overflow, no error."""
    tools, base = browser
    open_page(tools, f"{base}/source/refmp.parallel.context.ring.html")
    got = tools.js(SIDE_BY_SIDE)
    assert got["rows"] == got["codes"] >= 4 and got["beside"] == got["rows"], got
    assert "def _ring(self, kv, tag):" in got["code"] and "yield i, (r - i) % cp, kv" in got["code"]
    assert "lse = log(e^lse1 + e^lse2)" in got["note"] and "Liu et al. 2023" in got["note"]
    assert '"""' not in got["code"], "a docstring was left in the code column"
    assert got["coloured"] > 20 and got["overflow"] <= 0 and got["back"], got
    assert screenshot_colours(tools) > 20, "the page looks blank"
    assert tools.errors() == [], tools.errors()
