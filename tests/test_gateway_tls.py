"""The gateway over HTTPS (issue 36 point 2, in part): --https-cert/--https-key, a certificate from a
test authority (trustme), the `openai` client trusting that authority, and a Secure cookie."""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path

import aiohttp
import openai
import pytest
import trustme
from aiohttp import web
from stub_http import lane_app, serve
from test_cli_offline import assert_one_line_error, lanes
from test_gateway_core import healthy, put_plan, put_status, spec
from waiting import eventually

import gateway.edge.access as access
from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings

KEY = "sk-tls-test-0001"
CHAT = json.loads((Path(__file__).parent / "llama_answers.json").read_text())["chat_stream"]


@pytest.fixture
def certificate(tmp_path) -> tuple[trustme.CA, Path, Path]:
    """(the authority, the gateway's certificate chain, its key) for 127.0.0.1."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = tmp_path / "gateway.pem", tmp_path / "gateway.key"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    for more in issued.cert_chain_pems[1:]:
        more.write_to_path(str(cert), append=True)
    issued.private_key_pem.write_to_path(str(key))
    return ca, cert, key


async def _lane() -> tuple[web.AppRunner, int]:
    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(CHAT.encode())
        await resp.write_eof()
        return resp

    app = lane_app({"/v1/chat/completions": chat})
    return await serve(app)


async def test_the_gateway_serves_https_to_the_openai_client_and_its_cookie_is_secure(certificate, tmp_path):
    ca, cert, key = certificate
    lane, port = await _lane()
    gw = Gateway(GatewaySettings(port=0, api_keys=(KEY,), tls_cert=str(cert), tls_key=str(key)))
    put_plan(gw.view, "h", spec("a", "m", port=port))
    put_status(gw.view, "h", healthy("a", port))
    gw.view.mark_synced()
    stop = asyncio.Event()
    # No NATS here (the fleet is filled by hand): its bus side keeps trying, its HTTP side serves.
    task = asyncio.create_task(run_gateway("nats://127.0.0.1:1", stop, gateway=gw))
    try:
        await eventually(lambda: gw.started.is_set(), what="the gateway listening")
        assert gw.url.startswith("https://127.0.0.1:")
        authority = tmp_path / "ca.pem"
        ca.cert_pem.write_to_path(str(authority))

        def ask() -> str:
            # The openai package's own HTTP client (httpx2 from openai 3, httpx before), trusting our authority only.
            client_type = getattr(openai, "DefaultHttpx2Client", None) or openai.DefaultHttpxClient
            with client_type(verify=ssl.create_default_context(cafile=str(authority))) as http:
                client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, http_client=http, max_retries=0)
                assert [m.id for m in client.models.list()] == ["m"]
                answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hi"}])
                return answer.choices[0].message.content

        assert await asyncio.to_thread(ask) == "<|im_end"  # the recorded answer, assembled, over TLS

        trusted = ssl.create_default_context(cafile=str(authority))
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + access.SESSION_PATH, headers={"Authorization": f"Bearer {KEY}"},
                                 ssl=trusted) as resp:  # fmt: skip
                assert resp.status == 200
                cookie = resp.cookies[access.COOKIE]
                assert cookie["secure"] and cookie["httponly"] and cookie["samesite"] == "Strict"
            with pytest.raises(aiohttp.ClientError):  # plain HTTP to the HTTPS port is no way in
                async with http.get(gw.url.replace("https://", "http://") + "/v1/models",
                                    headers={"Authorization": f"Bearer {KEY}"}) as resp:  # fmt: skip
                    await resp.read()
            with pytest.raises(aiohttp.ClientConnectorCertificateError):  # nor a client that trusts no such CA
                async with http.get(gw.url + "/health") as resp:
                    await resp.read()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await lane.cleanup()


def test_tls_flags_come_in_pairs_and_a_bad_pair_is_one_line(certificate, tmp_path):
    _, cert, key = certificate
    assert_one_line_error(lanes("gateway", "--https-cert", cert), "--https-cert and --https-key together")
    other = trustme.CA().issue_cert("127.0.0.1")
    wrong = tmp_path / "other.key"
    other.private_key_pem.write_to_path(str(wrong))
    assert_one_line_error(lanes("gateway", "--https-cert", cert, "--https-key", wrong), "not a certificate and its key")
    assert_one_line_error(lanes("gateway", "--https-cert", tmp_path / "absent.pem", "--https-key", key), "absent.pem")
