"""Worker processes (`dualpath worker --role prefill|decode`): the data plane of docs/design.md
section 3. A decode worker serves a turn end to end (`Generate`), driving a prefill worker
(`Prefill`); KV moves between them through the NIXL transfer engine, by either read path.
"""

# Trailing metadata of a failed `Generate`: the node the failure came from (the decode node
# itself, or the prefill node it drove), for the frontend's retry and the scheduler's breaker.
FAILED_NODE_KEY = "dualpath-failed-node"
