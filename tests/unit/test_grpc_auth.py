"""The cluster token file: what is accepted, what is presented, rotation, the file's mode."""

import os

import pytest
from dualpath.grpc_auth import OPEN_SERVICES, ClusterToken, TokenError, load, write_token_file


def test_only_the_bearer_token_is_accepted(tmp_path):
    path = write_token_file(tmp_path / "token", "s3cret-token")
    token = ClusterToken(path)
    assert token.first == "s3cret-token"
    assert token.accepts((("authorization", "Bearer s3cret-token"),))
    assert token.accepts((("x-other", "1"), ("authorization", "bearer s3cret-token")))
    for metadata in (
        None,
        (),
        (("authorization", "Bearer s3cret-tokeN"),),
        (("authorization", "Bearer "),),
        (("authorization", "s3cret-token"),),  # no scheme
        (("authorization", "Basic s3cret-token"),),
        (("authorization-bin", b"s3cret-token"),),
        (("x-token", "Bearer s3cret-token"),),
    ):
        assert not token.accepts(metadata), metadata


def test_a_rotation_is_read_without_a_restart(tmp_path, fake_clock):
    clock = fake_clock
    path = write_token_file(tmp_path / "token", "old")
    token = ClusterToken(path, clock=clock)
    path.write_text("new-one\nold\n")
    clock.t += 0.5
    assert token.first == "old"  # re-checked at most every second
    clock.t += 1.0
    assert token.first == "new-one"
    assert token.accepts((("authorization", "Bearer old"),))
    path.write_text("new-one\n")
    clock.t += 1.5
    assert not token.accepts((("authorization", "Bearer old"),))
    assert token.accepts((("authorization", "Bearer new-one"),))
    path.write_text("")  # an emptied file keeps the previous tokens (mid-rotation)
    clock.t += 1.5
    assert token.first == "new-one"


def test_the_token_file_is_private_and_random(tmp_path):
    a = write_token_file(tmp_path / "a")
    b = write_token_file(tmp_path / "b")
    assert a.stat().st_mode & 0o777 == 0o600
    assert a.read_text() != b.read_text() and len(a.read_text().strip()) >= 40
    loose = tmp_path / "loose"
    loose.write_text("x\n")
    os.chmod(loose, 0o644)
    write_token_file(loose)
    assert loose.stat().st_mode & 0o777 == 0o600


def test_a_missing_or_empty_file_is_refused_naming_the_flag(tmp_path, monkeypatch):
    with pytest.raises(TokenError, match="--token-file .*: no such file"):
        ClusterToken(tmp_path / "absent")
    (tmp_path / "empty").write_text("\n# only a comment\n")
    with pytest.raises(SystemExit, match="dualpath scheduler: --token-file .*holds no key"):
        load(str(tmp_path / "empty"), "scheduler")
    monkeypatch.delenv("DUALPATH_TOKEN_FILE", raising=False)
    assert load(None, "scheduler") is None  # unauthenticated, with a warning
    monkeypatch.setenv("DUALPATH_TOKEN_FILE", str(write_token_file(tmp_path / "env", "e")))
    assert load(None, "scheduler").first == "e"


def test_only_health_and_reflection_are_open():
    assert all(s.startswith("/grpc.") for s in OPEN_SERVICES)
    assert not any("dualpath" in s for s in OPEN_SERVICES)


async def test_a_channel_waits_for_a_peer_back_up_between_two_reconnect_attempts():
    """A peer that comes back while the channel backs off: `connected` waits for the next
    attempt, so the first call reaches it (without the wait it fails "failed to connect");
    a peer that stays down costs the bounded wait, and False."""
    import asyncio
    import socket

    import grpc
    from dualpath.grpc_auth import CONNECT_WAIT_S, channel, connected

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    ch = channel(address, None)
    ping = ch.unary_unary("/t.T/Ping")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ping(b"x", timeout=2)  # nobody there: the channel backs off
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not await connected(ch, 0.2)
    await asyncio.sleep(3.0)  # down a while: the reconnect backoff has grown to its cap

    async def echo(request, context):
        return request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "t.T", {"Ping": grpc.unary_unary_rpc_method_handler(echo)}
            ),
        )
    )
    server.add_insecure_port(address)
    await server.start()
    try:
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        # the next attempt comes within the backoff's cap (CONNECT_WAIT_S has 0.3 s to spare;
        # a second more here for a loaded machine)
        assert await connected(ch, CONNECT_WAIT_S + 1.0)
        assert loop.time() - t0 <= CONNECT_WAIT_S + 1.5
        assert await ping(b"x", timeout=2) == b"x"
    finally:
        await ch.close()
        await server.stop(None)
