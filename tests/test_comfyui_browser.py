"""The node pack on ComfyUI's own frontend, driven in headless Chromium through Playwright.

Skipped unless `COMFYUI_ROOT` is set (the server of `test_comfyui_server.py`, its `server` fixture reused), Chromium is
installed (`VFLASH_CHROMIUM`, default /usr/bin/chromium; Debian's `chromium` package) and the `playwright` package
imports (only its driver is used: no browser download). What a user sees is checked on the page itself: the template
browser's search, its cards' visible titles and thumbnails, the Missing Models list of the Comfy-Org template with each
file's name and download URL, the node search, and the tooltips of the Autogrow reference sockets. Screenshots go to `VFLASH_SCREENSHOTS` (default: a
pytest temporary folder); each test prints the paths it wrote.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from comfyui_server_helpers import COMFYUI_ROOT, REPO
from conftest import CARD_TITLE_CHARS, TEMPLATES

CHROMIUM = Path(os.environ.get("VFLASH_CHROMIUM", "/usr/bin/chromium"))
pytestmark = [
    pytest.mark.skipif(not COMFYUI_ROOT, reason="set COMFYUI_ROOT to a ComfyUI checkout to run the browser tests"),
    pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="the browser tests need playwright"),
]

# Without the networking flags Chromium keeps calling out to Google's services, which a closed network refuses.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1600, "height": 1000}
HUB = re.compile(r"https://huggingface\.co/.*")
COMFY_ORG_TEMPLATE = TEMPLATES["t2va_core_loaders"]
VFLASH_NODE_PREFIX = "MiniMax H3 Vflash"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("VFLASH_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def hub_requests() -> list[str]:
    return []


@pytest.fixture
def context(browser, server, hub_requests):
    """A fresh browser profile per test; every request to Hugging Face is recorded (`hub_requests`) and refused in the
    browser, so a download button can be checked for its URL without anything leaving the machine."""
    ctx = browser.new_context(viewport=VIEWPORT)

    def refuse(route):
        hub_requests.append(route.request.url)
        route.abort()

    ctx.route(HUB, refuse)
    try:
        yield ctx
    finally:
        ctx.close()


def _tutorial_completed(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/api/settings/Comfy.TutorialCompleted") as r:
        return json.loads(r.read()) is True


def _open_frontend(context, url: str):
    """The frontend, loaded. On its first visit to a user folder the frontend opens the template browser by itself
    with no template listed (ComfyUI 0.33.0 does so with or without this pack) and records the visit in the user's
    settings; the page is then loaded again, as on the user's next visit, and opens with no dialog."""
    page = context.new_page()
    ready = "() => window.app && window.app.canvas && window.app.graph"
    page.goto(url)
    page.wait_for_function(ready, timeout=120_000)
    if not _tutorial_completed(url):
        deadline = time.monotonic() + 60
        while not _tutorial_completed(url):
            assert time.monotonic() < deadline, "the frontend never recorded its first visit"
            time.sleep(0.5)
        page.reload()
        page.wait_for_function(ready, timeout=120_000)
    return page


def _screenshot(page, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    page.screenshot(path=str(path))
    print(f"screenshot: {path}")
    return path


def _templates_dialog(page):
    """The template browser, opened from the side bar's Templates button."""
    from playwright.sync_api import expect

    dialog = page.get_by_role("dialog").filter(has=page.get_by_text("All Templates", exact=True))
    page.get_by_role("button", name="Templates", exact=True).click()
    expect(dialog).to_be_visible()
    # The cards load after the dialog opens; a search typed before that is cleared by the first render.
    expect(dialog.locator("[data-testid^='template-workflow-']").first).to_be_visible(timeout=60_000)
    return dialog


def _search_templates(dialog, query: str) -> list[str]:
    """Types `query` into the dialog's search; the names of the cards listed, in order, once the list has settled
    (the search applies a moment after typing): the "Showing N of M templates" line and N cards, twice in a row."""
    dialog.get_by_placeholder("Search").fill(query)
    shown = dialog.get_by_text(re.compile(r"^Showing \d+ of \d+ templates$"))
    cards = dialog.locator("[data-testid^='template-workflow-']")
    deadline, last = time.monotonic() + 30, None
    while True:
        count = int(re.match(r"Showing (\d+)", shown.inner_text()).group(1))
        listed = cards.evaluate_all("cards => cards.map(c => c.dataset.testid.slice('template-workflow-'.length))")
        if len(listed) == count and listed == last:
            return listed
        assert time.monotonic() < deadline, f"the search for {query!r} did not settle: {count} announced, {listed}"
        last = listed
        time.sleep(0.5)


# What a card's one-line title shows: the characters laid out on its first line (the frontend clamps the heading to one
# line), less those the ellipsis covers at the end of the line when the title goes on.
VISIBLE_TITLE = """heading => {
    const text = heading.firstChild, range = document.createRange(), box = heading.getBoundingClientRect();
    const style = getComputedStyle(heading), context = document.createElement("canvas").getContext("2d");
    context.font = style.font;
    const right = box.right - parseFloat(style.paddingRight), ellipsis = context.measureText("\u2026").width;
    const rights = [];
    for (let i = 0; i < text.length; i++) {
        range.setStart(text, i);
        range.setEnd(text, i + 1);
        const rect = range.getClientRects()[0];
        if (rect && rights.length && rect.top > rights[0].top + 1) break;
        rights.push({top: rect ? rect.top : (rights.length ? rights[0].top : 0), right: rect ? rect.right : 0});
    }
    if (rights.length === text.length) return text.data;
    let shown = rights.length;
    while (shown > 0 && rights[shown - 1].right > right - ellipsis) shown--;
    return text.data.slice(0, shown) + "\u2026";
}"""


THUMBNAILS_ON_SCREEN_LOADED = """titles => titles.every(title => {
    const card = document.querySelector(`[data-testid="template-workflow-${CSS.escape(title)}"]`);
    if (!card) return true;
    const box = card.getBoundingClientRect(), shown = card.closest("[role=dialog]").getBoundingClientRect();
    if (box.bottom <= shown.top || box.top >= shown.bottom) return true;  // scrolled out of the dialog
    const image = card.querySelector("img");
    return image !== null && image.complete && image.naturalWidth > 0 && getComputedStyle(image).opacity === "1";
})"""


def test_template_browser_search_finds_every_vflash_template_with_its_thumbnail(context, server, shots):
    """Searching the template browser for "MiniMax", "H3" and "Vflash" lists all seven Vflash templates, each card
    titled by its file name and showing its thumbnail: the <img> decoded (naturalWidth > 0) from the <title>.jpg the
    server answered with 200 image/jpeg. What each card's one-line title shows (it is cut with an ellipsis) tells the
    seven apart, and holds at least the CARD_TITLE_CHARS characters (conftest) that `tests/test_workflows.py` finds distinct. A search
    for another model's name lists none of them."""
    from playwright.sync_api import expect

    thumbnails: dict[str, tuple[int, str]] = {}

    def record(response):
        prefix = f"{server.url}/api/workflow_templates/{server.pack_name}/"
        if response.url.startswith(prefix) and response.url.endswith(".jpg"):
            title = urllib.parse.unquote(response.url.removeprefix(prefix).removesuffix(".jpg"))
            thumbnails[title] = (response.status, response.headers.get("content-type", ""))

    page = _open_frontend(context, server.url)
    page.on("response", record)
    dialog = _templates_dialog(page)
    titles = sorted(TEMPLATES.values())
    for query in ("MiniMax", "H3", "Vflash"):
        listed = _search_templates(dialog, query)
        assert sorted(t for t in listed if t in titles) == titles, (query, listed)
        if query == "Vflash":  # the only templates with the word in their title come first
            assert sorted(listed[:len(titles)]) == titles, listed
        shown = {}
        for title in titles:
            card = dialog.get_by_test_id(f"template-workflow-{title}")
            card.scroll_into_view_if_needed()
            heading = card.get_by_role("heading", name=title, exact=True)
            expect(heading).to_be_visible()
            image = card.get_by_role("img", name=title, exact=True)
            expect(image).to_be_visible()
            loaded = "img => img.complete && img.naturalWidth > 0"
            page.wait_for_function(loaded, arg=image.element_handle(), timeout=30_000)
            shown[title] = heading.evaluate(VISIBLE_TITLE)
        print(f"card titles as shown ({query}): {sorted(shown.values())}")
        assert len(set(shown.values())) == len(titles), shown
        for title, visible in shown.items():
            assert title.startswith(visible.removesuffix("\u2026")) and len(visible.removesuffix("\u2026")) >= CARD_TITLE_CHARS, (title, visible)
        first_ours = dialog.get_by_test_id(f"template-workflow-{next(t for t in listed if t in titles)}")
        first_ours.evaluate("card => card.scrollIntoView({block: 'start'})")
        # A card's image is loaded while it is on screen (and let go off screen): the shot waits for those on screen.
        page.wait_for_function(THUMBNAILS_ON_SCREEN_LOADED, arg=titles, timeout=30_000)
        _screenshot(page, shots, f"template_search_{query.lower()}")
    assert {title: thumbnails.get(title) for title in titles} == {title: (200, "image/jpeg") for title in titles}
    assert not set(_search_templates(dialog, "Seedance")) & set(titles)


def _open_comfy_org_template(context, url: str):
    """The frontend with the Comfy-Org template opened from the template browser."""
    from playwright.sync_api import expect

    page = _open_frontend(context, url)
    dialog = _templates_dialog(page)
    assert COMFY_ORG_TEMPLATE in _search_templates(dialog, "Comfy-Org")
    dialog.get_by_test_id(f"template-workflow-{COMFY_ORG_TEMPLATE}").click()
    expect(dialog).to_be_hidden()
    return page


def test_missing_models_lists_the_comfy_org_files_with_their_download_urls(context, server, shots, hub_requests):
    """Opening the Comfy-Org template in a ComfyUI whose model folders lack its files: the Missing Models list names
    exactly the files of the template's `properties.models`, each under its folder and by its bare file name, as core's
    templates name theirs (the Vflash loader's transformer `minimax_h3_fl2va_bf16.safetensors`, no `diffusion_models/`
    prefix: the frontend matches an entry to the widget by the widget's value and names a download after the entry);
    each Download button opens that file's Hugging Face URL as a download named that file, and each Copy URL copies
    the file's Hugging Face page."""
    from playwright.sync_api import expect

    workflow = json.loads((REPO / "workflows" / f"{COMFY_ORG_TEMPLATE}.json").read_text())
    expected = {m["name"]: m for node in workflow["nodes"] for m in node.get("properties", {}).get("models", [])}
    assert len(expected) == 4, expected
    loader = next(n for n in workflow["nodes"] if n["type"] == "VflashModelLoader")
    assert [m["name"] for m in loader["properties"]["models"]] == [loader["widgets_values"][0]] == ["minimax_h3_fl2va_bf16.safetensors"]
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    # The frontend starts a browser download with a link it clicks (href: the URL, download: the name): record them.
    context.add_init_script("""(() => {
        const click = HTMLAnchorElement.prototype.click;
        window.__vflashLinks = [];
        HTMLAnchorElement.prototype.click = function () {
            window.__vflashLinks.push({href: this.href, download: this.getAttribute("download")});
            return click.call(this);
        };
    })()""")

    page = _open_comfy_org_template(context, server.url)
    page.get_by_role("button", name="View details").click()
    group = page.get_by_test_id("error-group-missing-model")
    expect(group.get_by_text("Missing Models", exact=True)).to_be_visible()

    names = group.get_by_role("button").filter(has_text=re.compile(r"\.safetensors$"))
    expect(names).to_have_count(len(expected))
    listed = names.all_inner_texts()
    assert sorted(listed) == sorted(expected)
    assert "minimax_h3_fl2va_bf16.safetensors" in listed and not [name for name in listed if "/" in name], listed
    _screenshot(page, shots, "missing_models")
    for name, copy in zip(listed, group.get_by_role("button", name="Copy URL").all(), strict=True):
        copy.click()
        copied = page.evaluate("() => navigator.clipboard.readText()")
        assert copied.replace("/blob/", "/resolve/", 1) == expected[name]["url"], (name, copied)
    for name, model in expected.items():
        expect(group.get_by_text(model["directory"], exact=True).first).to_be_visible()
        before, links = len(hub_requests), page.evaluate("() => window.__vflashLinks.length")
        with context.expect_page() as opened:
            group.get_by_role("button", name=f"Download {name}", exact=True).click()
        opened.value.wait_for_load_state()
        assert hub_requests[before:] and set(hub_requests[before:]) == {model["url"]}, (name, hub_requests)
        assert page.evaluate("() => window.__vflashLinks")[links:] == [{"href": model["url"], "download": name}], name
        opened.value.close()


def test_the_comfy_org_template_run_without_its_files(context, server, shots):
    """The Comfy-Org template opened where none of its four files is: before Run the frontend says "4 errors found",
    its Missing Models list, one entry per file with its folder and Download button. Run (on a profile this CPU
    machine runs; the shipped sm90 one adds an error on the profile widget here) gives "8 errors found": the four
    Missing Models entries, and the server's four validation errors, one per file, each on the widget holding a file
    that Missing Models lists: the Vflash loader's own refusal (which also names the folder and URL) and core's "Value
    not in list" on Load CLIP and both Load VAE nodes. Why four remain doubled: ComfyUI 0.33.0's frontend (1.49.6)
    counts the Missing Models it found on load and, after Run, every error of the /prompt refusal, without matching
    the two; the refusal must stay (it is what stops the run, and all an API client sees), core's loaders validate
    their own combos, and dropping a file's `properties.models` would only hide its download link before Run."""
    from playwright.sync_api import expect

    workflow = json.loads((REPO / "workflows" / f"{COMFY_ORG_TEMPLATE}.json").read_text())
    titles = {n["title"]: n["properties"]["models"][0]["name"] for n in workflow["nodes"] if n.get("properties", {}).get("models")}
    page = _open_comfy_org_template(context, server.url)
    found = page.get_by_text(re.compile(r"^\d+ errors? found$"))
    expect(found).to_have_text("4 errors found")
    page.evaluate("() => { app.graph.getNodeById(1).widgets.find(w => w.name === 'profile').value = 't2va-base4-exact-cpu' }")
    page.get_by_role("button", name="Run", exact=True).first.click()
    expect(found).to_have_text("8 errors found", timeout=60_000)
    page.get_by_role("button", name="View details").click()
    missing = page.get_by_test_id("error-group-missing-model")
    expect(missing.get_by_role("button").filter(has_text=re.compile(r"\.safetensors$"))).to_have_count(4)
    assert sorted(missing.get_by_role("button").filter(has_text=re.compile(r"\.safetensors$")).all_inner_texts()) == sorted(titles.values())
    rejected = page.get_by_test_id("error-group-execution")
    expect(rejected).to_have_count(2)
    listed = sorted(line for text in rejected.all_inner_texts() for line in text.splitlines() if " - " in line)
    widgets = {"VflashModelLoader": "model", "CLIPLoader": "clip_name", "VAELoader": "vae_name"}
    assert listed == sorted(f"{n['title']} - {widgets[n['type']]}" for n in workflow["nodes"] if n["title"] in titles), listed
    _screenshot(page, shots, "comfy_org_template_run_without_files")


def _slot_position(page, node_type: str, socket: str) -> tuple[float, float]:
    """Where an input socket of the first `node_type` node is drawn on the page, from the canvas's own transform."""
    x, y = page.evaluate(
        """([type, name]) => {
            const node = app.graph.nodes.find(n => n.type === type);
            const slot = node.inputs.findIndex(s => s.name === name);
            if (slot < 0) throw new Error(`no input ${name}`);
            const [cx, cy] = app.canvas.ds.convertOffsetToCanvas(node.getInputPos(slot));
            const box = app.canvas.canvas.getBoundingClientRect();
            return [cx + box.left, cy + box.top];
        }""",
        [node_type, socket],
    )
    return x, y


def _search_nodes(page, query: str):
    """Double-clicks the empty canvas and types `query`; the result options of the node search."""
    from playwright.sync_api import expect

    listbox = page.get_by_role("listbox")
    # Right after a new workflow tab opens, the canvas can drop a double-click while it switches graphs (seen on two
    # cores, after the template tests); a user double-clicks again, and so does this, at most three times.
    for attempt in range(3):
        page.locator("#graph-canvas").dblclick(position={"x": 500, "y": 300})
        try:
            expect(listbox).to_be_visible(timeout=3000)
            break
        except AssertionError:
            if attempt == 2:
                raise
    page.keyboard.type(query)
    options = listbox.get_by_role("option")
    expect(options.first).to_contain_text(query.split()[-1])
    return options


def test_node_search_and_reference_socket_tooltips(context, server, shots):
    """The node search (double-click on the canvas) ranks Vflash nodes among its first five results for "MiniMax H3"
    and gives only Vflash nodes for "Vflash", each shown by its display name and the pack's badge; the server's
    test-only probe node (dev-only) is in neither list, as a user without dev mode sees it. The Prompt / Frames /
    References node added from it shows, on hovering each Autogrow reference socket, the tooltip of
    locales/en/nodeDefs.json."""
    from playwright.sync_api import expect

    page = _open_frontend(context, server.url)
    page.get_by_role("button", name="Create a new blank workflow").click()
    page.wait_for_function("() => app.graph.nodes.length === 0")
    for query, least in (("MiniMax H3", 1), ("Vflash", 5)):
        options = _search_nodes(page, query)
        listed = [option.inner_text().split("\n")[:2] for option in options.all()]
        top = listed[:5]
        ours = [name for name, badge in top if name.startswith(VFLASH_NODE_PREFIX) and badge == server.pack_name]
        assert len(top) == 5 and len(ours) >= least, (query, top)
        assert not [name for name, _ in listed if "VflashTest" in name], (query, listed)
        _screenshot(page, shots, f"node_search_{query.lower().replace(' ', '_')}")
        page.keyboard.press("Escape")
        expect(page.get_by_role("listbox")).to_be_hidden()

    options = _search_nodes(page, "Vflash Prompt")
    expect(options.first).to_contain_text("MiniMax H3 Vflash Prompt / Frames / References")
    page.keyboard.press("Enter")
    # A node added from the search follows the pointer until a click places it.
    page.wait_for_function("() => app.graph.nodes.some(n => n.flags.ghost)")
    expect(page.get_by_role("listbox")).to_be_hidden()
    page.mouse.move(480, 240)
    page.mouse.move(500, 250, steps=4)
    page.mouse.click(500, 250)
    page.wait_for_function("() => !app.graph.nodes.some(n => n.flags.ghost)")
    assert page.evaluate("() => app.graph.nodes.map(n => [n.type, !!n.flags.ghost])") == [["VflashEncode", False]]
    tooltips = json.loads((REPO / "locales" / "en" / "nodeDefs.json").read_text())["VflashEncode"]["inputs"]
    tooltip = page.locator(".node-tooltip")
    sockets = ("ref_images.ref_image_0", "ref_videos.ref_video_0", "ref_video_audios.ref_video_audio_0",
               "ref_audios.ref_audio_0")
    for socket in sockets:
        x, y = _slot_position(page, "VflashEncode", socket)
        page.mouse.move(x + 40, y + 200)  # away first: the tooltip shows once the pointer rests on the socket
        page.mouse.move(x, y)
        expect(tooltip).to_have_text(tooltips[socket.replace(".", "_")]["tooltip"])
        if socket == sockets[0]:
            _screenshot(page, shots, "reference_socket_tooltip")
