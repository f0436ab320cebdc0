"""Rows of malformed input: seeded HTTP bodies and gRPC calls (`dualpath.local.fuzz`)."""

from __future__ import annotations

import asyncio
import time

import httpx

from dualpath.local.faults.client import Result
from dualpath.local.faults.report import Row
from dualpath.local.faults.suite import Suite

# the scheduler methods workers call (made with a worker certificate under mTLS)
WORKER_METHODS = frozenset({"Register", "Heartbeats", "KvEvents", "KvSnapshot"})


async def http_fuzz_row(s: Suite) -> Row:
    from dualpath.local.fuzz import http_cases

    row = Row("http-fuzz")
    cases = http_cases(320, s.c.model)
    results = []
    for endpoint, body in cases:
        res = Result("lost", start_s=time.monotonic())
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        try:
            r = await asyncio.wait_for(
                s.c.http.post(path, content=body, headers={"content-type": "application/json"}),
                s.c.deadline_s,
            )
            res.status = r.status_code
            if r.status_code >= 400:
                res.kind = "failed"
                try:
                    r.json()["error"]["message"]
                except Exception:  # noqa: BLE001
                    res.kind = "lost"  # not our JSON error: something else answered
            elif r.headers.get("content-type", "").startswith("text/event-stream"):
                events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                res.kind = "ok" if events and events[-1] == "[DONE]" else "failed"
                res.empty = res.kind == "ok" and len(events) < 2
            else:
                res.kind = "ok"
                res.empty = not r.json()["choices"][0].get("finish_reason")
        except TimeoutError:
            res.kind = "hung"
        except httpx.TransportError as err:
            res.kind, res.error = "lost", str(err)
        results.append(res)
    after = [await s.c.turn(i) for i in s.ref_ids[:4]]
    row.add(results, bad_input=True)
    row.add(after)
    codes: dict[int, int] = {}
    for r in results:
        codes[r.status] = codes.get(r.status, 0) + 1
    row.note = f"{len(cases)} bodies: " + ", ".join(f"{k}x{v}" for k, v in sorted(codes.items()))
    row.note += "; then 4 good turns"
    return row


async def grpc_fuzz_row(s: Suite) -> Row:
    import grpc

    from dualpath.grpc_auth import channel as worker_channel
    from dualpath.local.cluster import run_dir_auth
    from dualpath.local.fuzz import WORKER_METHODS as WORKER_SERVICE_ROLES
    from dualpath.local.fuzz import grpc_cases
    from dualpath.scheduler.client import channel
    from dualpath.v1 import scheduler_pb2 as pb
    from dualpath.v1 import scheduler_pb2_grpc as pb_grpc
    from dualpath.v1 import worker_pb2 as wpb
    from dualpath.v1 import worker_pb2_grpc as wpb_grpc

    row = Row("grpc-fuzz")
    admin = run_dir_auth(s.cl.run_dir)
    ch = channel(s.cl.scheduler, admin)
    stub = pb_grpc.SchedulerStub(ch)
    # the scheduler methods workers call, with a role-wide decode certificate of the run's CA
    # (under mTLS): malformed input reaches the scheduler's validation, not the identity check
    wauth = s.worker_auth()
    wch = channel(s.cl.scheduler, wauth)
    stubs = (stub, pb_grpc.SchedulerStub(wch))
    # one worker of each role, from the scheduler's view; a real decode agent, so some
    # Prefill calls fail on their regions rather than on the agent
    view = await stub.ClusterView(pb.ClusterViewRequest(), timeout=5)
    roles = {pb.ROLE_PREFILL: "prefill", pb.ROLE_DECODE: "decode"}
    addresses = {roles[n.role]: n.address for n in view.nodes if n.role in roles}
    # Generate is the frontend's (admin may make it); Prefill and GetTransferInfo a worker's
    channels = {
        (role, who): worker_channel(a, admin if who == "admin" else wauth, server_role=role)
        for role, a in addresses.items()
        for who in ("admin", "worker")
    }
    workers = {key: wpb_grpc.WorkerStub(c) for key, c in channels.items()}
    agent = None
    if ("decode", "worker") in workers:
        info = await workers["decode", "worker"].GetTransferInfo(
            wpb.TransferInfoRequest(), timeout=5
        )
        agent = (info.agent, info.metadata)
    bad = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}
    codes: dict[str, int] = {}
    results = []
    cases = grpc_cases(120 if s.quick else 400, decode_agent=agent)
    try:
        for case in cases:
            res = Result("ok", start_s=time.monotonic())
            if case.service == "Worker":
                who = "admin" if case.method == "Generate" else "worker"
                target = workers.get((WORKER_SERVICE_ROLES[case.method], who))
                if target is None:
                    continue
                call = getattr(target, case.method)
            else:
                call = getattr(stubs[case.method in WORKER_METHODS], case.method)
            try:
                if case.method in ("Heartbeats", "KvSnapshot"):
                    await _stream_call(call(timeout=5), case.request)
                elif case.method in ("Generate", "Prefill"):  # server streams
                    async for _ in call(case.request, timeout=5):
                        pass
                else:
                    await call(case.request, timeout=5)
                code = "OK"
            except grpc.aio.AioRpcError as err:
                code = err.code().name
                res.kind = "failed"
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    res.kind = "hung"
                if err.code() in bad:
                    res.status = 500
                    res.error = f"{case.method}: {code}: {err.details()}"
            codes[f"{case.method}:{code}"] = codes.get(f"{case.method}:{code}", 0) + 1
            res.end_s = time.monotonic()
            results.append(res)
    finally:
        await ch.close()
        await wch.close()
        for c in channels.values():
            await c.close()
    after = [await s.c.turn(i) for i in s.ref_ids[:4]]
    row.add(results, bad_input=True)
    row.add(after)
    worst = sorted(codes.items(), key=lambda kv: -kv[1])
    row.note = (
        f"{len(cases)} calls: " + ", ".join(f"{k}x{v}" for k, v in worst) + "; then 4 good turns"
    )
    return row


async def _stream_call(call, messages: list) -> None:  # noqa: ANN001
    """A client-streaming call as a well-behaved client makes it (bidi: one message, then its
    answer, as a heartbeat does), writing nothing once the server has ended the call; raises
    the call's AioRpcError."""
    import grpc

    bidi = hasattr(call, "read")
    try:
        for msg in messages:
            await call.write(msg)
            if bidi and await call.read() is grpc.aio.EOF:
                break
        await call.done_writing()
        if not bidi:
            await call
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
        pass
    code = await call.code()
    if code != grpc.StatusCode.OK:
        raise grpc.aio.AioRpcError(
            code, grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details()
        )
