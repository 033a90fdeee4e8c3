"""The real-server client's end of a prompt (`benchmarks/comfy_server.py`, `Server.run_prompt`), against a stand-in
endpoint speaking ComfyUI's protocol (`POST /prompt`, the websocket, `GET /history`): a run the server finished must
end the client's wait however the websocket ends it. The benchmark's warm runs (cached models) waited forever here."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from comfy_server import Server

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web


async def _run(ending: str) -> dict:
    """Serve one prompt the way `ending` says, and run the client against it (10 s at most)."""
    prompts: list[str] = []

    async def prompt(request):
        prompts.append((await request.json())["prompt_id"])
        return web.json_response({"prompt_id": prompts[-1]})

    async def socket(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        while not prompts:
            await asyncio.sleep(0.01)
        await ws.send_json({"type": "execution_start", "data": {"prompt_id": prompts[0]}})
        if ending == "large message":  # over aiohttp's default 4 MiB limit, then the usual end
            await ws.send_bytes(b"\0\0\0\1\0\0\0\1" + bytes(5 << 20))
        if ending != "socket closed":
            await ws.send_json({"type": "execution_success", "data": {"prompt_id": prompts[0]}})
        if ending == "large message":  # the server records the prompt, then sends this
            await ws.send_json({"type": "executing", "data": {"node": None, "prompt_id": prompts[0]}})
        await asyncio.sleep(0.2)
        await ws.close()
        return ws

    history_asked: list[int] = []

    async def history(request):  # recorded only from the third request on: the server records after it reports
        history_asked.append(1)
        entry = {"status": {"status_str": "success", "completed": True}, "outputs": {}}
        return web.json_response({prompts[0]: entry} if len(history_asked) > 2 else {})

    app = web.Application()
    app.router.add_post("/prompt", prompt)
    app.router.add_get("/ws", socket)
    app.router.add_get("/history/{prompt_id}", history)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    client = object.__new__(Server)  # the client half only: no ComfyUI process behind this endpoint
    client.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    client.tail = lambda n=60: ""
    try:
        result = await client.run_prompt({}, timeout=10.0)
        result["history_recorded"] = len(history_asked) > 2
        return result
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("ending", ["execution_success only", "large message", "socket closed"])
def test_a_finished_prompt_ends_the_wait(ending):
    result = asyncio.run(_run(ending))
    assert result["status"] == "success"
    assert result["history_recorded"]  # before it is, /history lists none of the prompt's files
    assert result.get("websocket_closed", False) == (ending == "socket closed")
    if ending == "large message":
        assert len(result["previews"]) == 1 and len(result["previews"][0][2]) == 5 << 20
