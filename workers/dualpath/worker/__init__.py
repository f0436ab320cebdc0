"""Worker processes (`dualpath worker --role prefill|decode`): the data plane of DESIGN
section 3. A decode worker serves a turn end to end (`Generate`), driving a prefill worker
(`Prefill`); KV moves between them through the NIXL transfer engine, by either read path.
"""
