"""Every Redis call: keys, the Lua scripts and their loader, request logs, control and
presence, the queue and heartbeats, the outbox, limits, the multiplexed tail, pools."""
