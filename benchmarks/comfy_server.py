"""A real ComfyUI server, started headless on loopback with this checkout's node pack, driven through `POST /prompt`,
the websocket and `/history`: shared by the real-server tests (`tests/test_comfyui_server.py` and the files beside it)
and the core-vs-Vflash benchmark (`benchmarks/vs_comfy_core.py`).

The server runs ComfyUI's `main.py` (from `root`, with `COMFYUI_PYTHON`, default this interpreter) with this
repository linked into a dedicated custom-nodes folder through an extra-model-paths yaml (or, where ComfyUI's own
`custom_nodes/` already holds this checkout, that copy: a second link would load the pack twice), loading no other
custom nodes than the pack and the given probes; its model folders are under the work folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
API = REPO / "workflows" / "api"

PROBE = REPO / "tests" / "comfy_core_probe"
SMALL_DIT = "h3_small_av.safetensors"
CORE_VIDEO_VAE = "SmallVideoVAE"  # core's H3 video VAE class at the small family's dimensions (comfy_core_probe/small_core.py)


def write_small_family(root: Path, models: Path) -> None:
    """The small random family in the files a ComfyUI user has: a single-file transformer in diffusion_models (24 / 32
    latent channels, text width 32: the released channel counts on a tiny network), and the text encoder and the two
    VAEs in Comfy-Org's formats, written by core's own modules (`small_core.py`, run with ComfyUI's Python)."""
    from dataclasses import replace

    import transformer_files  # tests/: the original-layout writer is test-only code

    from vflash_core.engine.config import H3Config
    from vflash_core.weights import synthetic

    config = replace(H3Config.preset("demo"), in_channels=24, audio_in_channels=32)
    transformer_files.write_original_transformer(models / "diffusion_models" / SMALL_DIT, config, synthetic.random_internal_weights(config, seed=6))
    out = subprocess.run([os.environ.get("COMFYUI_PYTHON", sys.executable), str(PROBE / "small_core.py"), str(models)], cwd=root,
                         check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def installed_pack_copies(custom_nodes: Path) -> list[Path]:
    """The entries of a custom-nodes folder that hold a copy of the Vflash pack (a pyproject.toml naming it)."""
    import tomllib

    copies = []
    for entry in sorted(custom_nodes.iterdir()) if custom_nodes.is_dir() else []:
        try:
            project = tomllib.loads((entry / "pyproject.toml").read_text()).get("project", {})
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if project.get("name") == "vflash" and (entry / "__init__.py").is_file():
            copies.append(entry)
    return copies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Test-only custom nodes the real-server tests load beside the pack: core's H3 classes at the small family's dimensions
# (comfy_core_probe/small_core.py) and what ComfyUI's model management and the pack hold (GET /vflash_test/memory).
TEST_PROBES = {"vflash_test_small_core": PROBE / "small_core_node",
               "vflash_test_memory_probe": REPO / "tests" / "comfy_standins" / "server_memory_probe"}


class Server:
    def __init__(
        self, root: Path, work: Path, copies: tuple[str, ...] | None = None, *,
        probes: Mapping[str, Path] = TEST_PROBES, write_models: Callable[[Path, Path], None] | None = write_small_family,
        launch_args: Sequence[str] = ("--cpu", "--cache-none"), env: Mapping[str, str] | None = None,
    ):
        """The test server; with `copies`, a bare one instead: this checkout linked under each of those folder names,
        no probes and no models (for the duplicate-pack check). `probes` (folder name -> custom-node folder) load beside
        the pack; `write_models(root, models)` fills the model folders first (None: the caller has); `launch_args`
        are the device and cache options of `main.py`; `env` adds to the server's environment."""
        self.work = work
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (work / "nodes").mkdir(parents=True)
        for d in ("models/vflash", "models/diffusion_models", "models/vae_approx", "input", "out", "user"):
            (work / d).mkdir(parents=True, exist_ok=True)
        if copies is None:
            installed = installed_pack_copies(root / "custom_nodes")
            this_checkout = [copy for copy in installed if copy.resolve() == REPO]
            if this_checkout:  # the documented install: ComfyUI loads this checkout from its own custom_nodes already
                self.pack_name = this_checkout[0].name
            else:  # another copy there is not loaded (the whitelist below), and its folder name is kept free
                self.pack_name = "vflash" if "vflash" not in {copy.name for copy in installed} else "vflash_under_test"
                (work / "nodes" / self.pack_name).symlink_to(REPO)
            for name, folder in probes.items():
                (work / "nodes" / name).symlink_to(folder)
            custom_nodes = [self.pack_name, *probes]
            for image in (REPO / "workflows" / "inputs").glob("*.png"):
                shutil.copy(image, work / "input" / image.name)
            if write_models is not None:
                write_models(root, work / "models")
        else:
            self.pack_name = copies[0]
            for name in copies:
                (work / "nodes" / name).symlink_to(REPO)
            custom_nodes = list(copies)
        (work / "extra_paths.yaml").write_text(
            f"vflash_test:\n    custom_nodes: {work / 'nodes'}\n    vflash: {work / 'models' / 'vflash'}\n"
            f"    diffusion_models: {work / 'models' / 'diffusion_models'}\n    text_encoders: {work / 'models' / 'text_encoders'}\n"
            f"    vae: {work / 'models' / 'vae'}\n    vae_approx: {work / 'models' / 'vae_approx'}\n"
        )
        env = {**os.environ, "VFLASH_CACHE": str(work / "cache"), "VFLASH_TEST_SMALL_CORE": "1", **(env or {})}
        self.log = open(work / "server.log", "w")  # noqa: SIM115 - the server writes it until stop() closes it
        self.proc = subprocess.Popen(
            [os.environ.get("COMFYUI_PYTHON", sys.executable), "main.py", *launch_args, "--listen", "127.0.0.1", "--port", str(self.port),
             "--disable-auto-launch", "--disable-api-nodes", "--extra-model-paths-config", str(work / "extra_paths.yaml"),
             "--output-directory", str(work / "out"), "--input-directory", str(work / "input"),
             "--user-directory", str(work / "user"),
             "--database-url", "sqlite:///:memory:",
             # Only these custom-node folders, whatever else the user's custom_nodes holds (another copy included).
             "--disable-all-custom-nodes", "--whitelist-custom-nodes", *custom_nodes],
            cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 180.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/system_stats", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"ComfyUI did not answer /system_stats in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        return "\n".join((self.work / "server.log").read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    # -- the API ------------------------------------------------------------------------------------------------

    async def run_prompt(
        self, prompt: dict, interrupt_at: int | None = None, timeout: float = 900.0, extra_data: dict | None = None,
        interrupt_in_node: tuple[str, float] | None = None,
    ) -> dict:
        """Submit, follow the websocket to the end; returns {"status", "prompt_id", "events", "previews",
        "http_status", "body"}: every JSON event with the monotonic time it arrived ("received"), and the binary
        preview messages as (event type, image type, image bytes).

        With `interrupt_at`, `POST /interrupt` is sent when a progress event reports that value; with
        `interrupt_in_node` (node id, seconds), that long after the node starts executing ("interrupted_at" in the
        result: when the interrupt was answered). `extra_data` goes with the prompt (e.g. {"preview_method": ...}).
        """
        import aiohttp

        client_id = str(uuid.uuid4())
        prompt_id = str(uuid.uuid4())
        events: list[dict] = []
        previews: list[tuple[int, int, bytes]] = []
        interrupted_at: list[float] = []
        async with aiohttp.ClientSession() as http:

            async def interrupt(delay: float = 0.0) -> None:
                await asyncio.sleep(delay)
                async with http.post(f"{self.url}/interrupt", json={}) as ir:
                    assert ir.status == 200
                interrupted_at.append(time.monotonic())

            # No message size limit: aiohttp's default (4 MiB) closes the socket on a large preview or output message.
            async with http.ws_connect(f"{self.url}/ws?clientId={client_id}", max_msg_size=0) as ws:
                payload = {"prompt": prompt, "client_id": client_id, "prompt_id": prompt_id, "extra_data": extra_data or {}}
                async with http.post(f"{self.url}/prompt", json=payload) as r:
                    body = await r.json()
                    if r.status != 200:
                        return {"status": "rejected", "http_status": r.status, "body": body, "events": events, "prompt_id": prompt_id}
                interrupted_sent = False
                pending = None
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    msg = await ws.receive(timeout=deadline - time.monotonic())
                    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        # The socket ended before the prompt did; the server's history says how the prompt ended.
                        status = await self._history_status(http, prompt_id, deadline)
                        return {"status": status, "events": events, "previews": previews, "prompt_id": prompt_id, "websocket_closed": True}
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        kind, image_type = struct.unpack(">II", msg.data[:8])
                        previews.append((kind, image_type, msg.data[8:]))
                        continue
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        continue
                    event = json.loads(msg.data)
                    event["received"] = time.monotonic()
                    data = event.get("data", {})
                    if data.get("prompt_id") not in (None, prompt_id):
                        continue
                    events.append(event)
                    kind = event["type"]
                    if kind == "progress" and interrupt_at is not None and not interrupted_sent and data.get("value") == interrupt_at and data.get("max") == 4:
                        await interrupt()
                        interrupted_sent = True
                    if kind == "executing" and interrupt_in_node is not None and data.get("node") == interrupt_in_node[0] and pending is None:
                        pending = asyncio.ensure_future(interrupt(interrupt_in_node[1]))
                    done = {"events": events, "previews": previews, "prompt_id": prompt_id}
                    if kind in ("execution_error", "execution_interrupted"):
                        if pending is not None:
                            await pending
                        return {"status": kind, "body": data, "interrupted_at": interrupted_at[0] if interrupted_at else None, **done}
                    # The end: `executing` with no node, or `execution_success` (a prompt whose nodes were all cached
                    # may be followed by nothing else for this client). The server sends `execution_success` before
                    # it records the prompt in /history, so that end waits for the record.
                    ended = kind == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id
                    if ended or kind == "execution_success":
                        if pending is not None:
                            await pending
                        status = "success" if ended else await self._history_status(http, prompt_id, deadline)
                        return {"status": status, **done}
                raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout} s:\n{self.tail()}")

    async def _history_status(self, http, prompt_id: str, deadline: float) -> str:
        """How a prompt ended by `/history` ("success" or "execution_error"), polled until it is there."""
        while time.monotonic() < deadline:
            async with http.get(f"{self.url}/history/{prompt_id}") as r:
                entry = (await r.json()).get(prompt_id) if r.status == 200 else None
            if entry and entry.get("status", {}).get("completed") is not None:
                return "success" if entry["status"].get("status_str") == "success" else "execution_error"
            await asyncio.sleep(0.5)
        raise TimeoutError(f"prompt {prompt_id} did not finish in time (its websocket closed):\n{self.tail()}")

    def history_files(self, prompt_id: str, dest: Path) -> list[Path]:
        import urllib.parse
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/history/{prompt_id}") as r:
            history = json.loads(r.read())[prompt_id]
        files = []
        for output in history["outputs"].values():
            for item in output.get("images", []) + output.get("videos", []):
                query = urllib.parse.urlencode({"filename": item["filename"], "subfolder": item["subfolder"], "type": item["type"]})
                with urllib.request.urlopen(f"{self.url}/view?{query}") as r:
                    target = dest / item["filename"]
                    target.write_bytes(r.read())
                    files.append(target)
        return files
