"""`dualpath faults`: inject faults into a real local cluster and tell what its clients saw.

Starts `dualpath up` (a subprocess: the supervisor that restarts crashed processes is the real
one) on a small config (tiny model, 1 prefill + 2 decode), learns reference answers on a
healthy cluster (each prompt's first turn: a recompute, nothing read from the store), then
injects one fault per row into the real processes and files while clients send requests:

| row | what is done |
|---|---|
| decode-kill | SIGKILL decode-0 while streams decode on both decode nodes |
| prefill-kill | SIGKILL prefill-0 while turns with store hits are read and relayed |
| scheduler-kill | SIGKILL the scheduler under load (its block index is rebuilt from scans) |
| corrupt-blocks | bytes flipped in the middle of every stored block file |
| truncated-blocks | every stored block file cut to half its size |
| read-only-store | the store made read-only (as root: a read-only remount of its tmpfs, EROFS; else the directories and files chmod a-w, EACCES) |
| full-store | the store's filesystem filled (as root: a small tmpfs plus a filler file, real ENOSPC; without root the row is skipped) |
| disconnects | 100 streams cut by their client after the first chunk, then normal turns |
| overload | a burst of concurrent turns far above what the nodes hold at once |
| http-fuzz | 320 seeded malformed bodies (`dualpath.local.fuzz.http_cases`) |
| grpc-fuzz | seeded malformed Scheduler and Worker calls with the cluster's credentials (`grpc_cases`): every RPC, Prefill's agent metadata and regions included; under mTLS the methods workers call go with a role-wide decode certificate, so malformed input reaches validation rather than the identity check |
| oversized-refusals | 10 Register calls with a 3.9 MB node_id under decode-0's certificate: refused INVALID_ARGUMENT by the field bound, the cluster log grown < 100 KB |
| bad-prefill-addresses | 100 Generate calls naming ports 1-100 of loopback as the prefill: FAILED_PRECONDITION each, decode-0's channels and TCP sockets back to their baseline within 30 s |
| prefill-kills | SIGKILL the only prefill 10 times under load: no client sees a 503 |
| slow-clients | 200 HTTP connections dripping a header line a second: each dropped within the header timeout |
| long-prompt | short-turn TTFT p99 alone, then beside a 10,000-token uncached prompt |
| sigint | SIGINT to `dualpath up` while streams run: they must finish, no process left |

Per row: requests sent, succeeded, failed cleanly (an HTTP error with a JSON body, or a
stream's error event), lost (a connection cut or a stream that ended with neither `[DONE]`
nor an error event), hung (no answer within the request deadline), wrong (greedy tokens
differ from the healthy recompute of the same prompt), empty successes, 503s (a bar where a
restarted worker must be waited for), 5xx from bad input, and the time from the killed
process's restart to serving again.

The package: `runner` (the row registry, `run_rows`, the command), `up` (the cluster as a
subprocess), `client` (turns and their classes), `suite` (what rows share), `report` (a row and
the table), and one module per group of rows (`restarts`, `store`, `load`, `bad_input`,
`holds`).
"""

from dualpath.local.faults.report import RECOVER_BAR_S, Row, table
from dualpath.local.faults.runner import QUICK_ROWS, ROWS, add_arguments, run, run_rows

__all__ = [
    "QUICK_ROWS",
    "RECOVER_BAR_S",
    "ROWS",
    "Row",
    "add_arguments",
    "run",
    "run_rows",
    "table",
]
